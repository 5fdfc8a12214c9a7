"""What answers in an episode: a chat model behind an API, or a scripted replay of known solutions.

Every policy speaks the same internal conversation format, OpenAI chat messages:
  {"role": "system"|"user", "content": str}
  {"role": "assistant", "content": str|None, "tool_calls": [{"id", "type": "function",
       "function": {"name", "arguments": str}}], "reasoning_content": str (optional)}
  {"role": "tool", "tool_call_id": str, "name": str, "content": str}
Clients for other APIs translate on the way out and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, Field

from harness.tool_schemas import ToolSpec
from harness.trajectory import Usage
from tasks import Task

# message keys that only the harness reads; never sent to an API
PRIVATE_KEYS = ("thinking_blocks", "is_error")


class ModelTurn(BaseModel):
    message: dict[str, Any] = Field(description="the assistant message, internal (OpenAI) format")
    finish_reason: str | None = None
    usage: Usage = Field(default_factory=Usage)
    latency_s: float = 0.0
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    response_id: str | None = None
    policy_version: int | None = None


class ModelError(RuntimeError):
    """The model endpoint failed (after the client's retries)."""

    def __init__(self, message: str, context_exceeded: bool = False):
        super().__init__(message)
        self.context_exceeded = context_exceeded


@dataclass
class EpisodeContext:
    task: Task
    sample: int
    backend: str
    workspace_id: str | None
    state: dict[str, Any] = field(default_factory=dict)  # the policy's per-episode scratch


class Policy(Protocol):
    def describe(self) -> dict[str, Any]:
        """provider, model, endpoint(s): recorded with every episode."""
        ...

    def sampling(self) -> dict[str, Any]:
        ...

    async def complete(self, ctx: EpisodeContext, messages: list[dict[str, Any]], tools: list[ToolSpec],
                       max_tokens: int | None) -> ModelTurn:
        ...

    async def end_episode(self, ctx: EpisodeContext) -> None:
        ...

    async def aclose(self) -> None:
        ...


def tool_calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    return list(message.get("tool_calls") or [])


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def api_history(messages: list[dict[str, Any]], keep_reasoning: bool) -> list[dict[str, Any]]:
    """The conversation as sent back to an OpenAI-compatible API.

    Arguments that are not a JSON object are replaced by {}: servers such as vLLM parse earlier
    tool calls' arguments to render the chat template and reject the whole request otherwise. The
    trajectory keeps what the model really wrote.
    """
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in PRIVATE_KEYS}
        if not keep_reasoning:
            m.pop("reasoning_content", None)
        calls = tool_calls_of(m)
        if calls:
            fixed = []
            for c in calls:
                args = c.get("function", {}).get("arguments", "")
                if not is_json_object(args):
                    c = {**c, "function": {**c["function"], "arguments": "{}"}}
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out
