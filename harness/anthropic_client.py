"""Anthropic's Messages API (optional extra: `pip install anthropic`).

The conversation stays in the internal OpenAI format; this module translates it to content blocks
on the way out and the answer back. Thinking blocks are kept (signature included) on the assistant
message so they can be sent back unchanged, which the API requires while a tool call is open.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio

from harness.config import ModelConfig, SamplingConfig
from harness.policy import EpisodeContext, ModelError, ModelTurn, is_json_object
from harness.tool_schemas import ToolSpec
from harness.trajectory import Usage

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length",
           "pause_turn": "stop", "refusal": "content_filter", "model_context_window_exceeded": "length"}


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def to_anthropic(messages: list[dict[str, Any]], keep_thinking: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(system prompt, messages) for the Messages API; consecutive turns of one role are merged."""
    system_parts: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": list(blocks)})

    for m in messages:
        role = m["role"]
        if role == "system":
            system_parts.append(m.get("content") or "")
        elif role == "user":
            add("user", [_text_block(m.get("content") or "")])
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m.get("content") or "",
                          "is_error": bool(m.get("is_error", False))}])
        elif role == "assistant":
            blocks: list[dict[str, Any]] = []
            if keep_thinking:
                blocks.extend(m.get("thinking_blocks") or [])
            if m.get("content"):
                blocks.append(_text_block(m["content"]))
            for c in m.get("tool_calls") or []:
                args = c["function"].get("arguments") or "{}"
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(args) if is_json_object(args) else {}})
            add("assistant", blocks or [_text_block("(no content)")])
    return ("\n\n".join(system_parts) or None), out


def from_anthropic(data: dict[str, Any]) -> tuple[dict[str, Any], str | None, Usage]:
    """The response as an internal assistant message, a finish reason in OpenAI terms, and usage."""
    texts, thinking, calls = [], [], []
    for block in data.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind in ("thinking", "redacted_thinking"):
            thinking.append({k: v for k, v in block.items() if v is not None})
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["thinking_blocks"] = thinking
        reasoning = "".join(b.get("thinking") or "" for b in thinking)
        if reasoning:
            message["reasoning_content"] = reasoning
    u = data.get("usage") or {}
    cached = u.get("cache_read_input_tokens")
    prompt = int(u.get("input_tokens") or 0) + int(cached or 0) + int(u.get("cache_creation_input_tokens") or 0)
    usage = Usage(prompt_tokens=prompt, completion_tokens=int(u.get("output_tokens") or 0), cached_tokens=cached)
    stop = data.get("stop_reason")
    return message, _FINISH.get(stop, stop), usage


class AnthropicPolicy:
    def __init__(self, model: ModelConfig, sampling: SamplingConfig):
        from anthropic import AsyncAnthropic

        self.model = model
        self.sampling_cfg = sampling
        url = model.base_url[0] if model.base_url else None
        self.client = AsyncAnthropic(api_key=model.resolved_key(), base_url=url, timeout=model.request_timeout_s,
                                     max_retries=model.max_retries)
        self.limiter = anyio.CapacityLimiter(model.max_requests_per_endpoint)

    def describe(self) -> dict[str, Any]:
        return {"provider": "anthropic", "model": self.model.model, "base_url": self.model.base_url or None}

    def sampling(self) -> dict[str, Any]:
        out = self.sampling_cfg.model_dump(exclude_none=True)
        if self.model.anthropic_thinking_budget:
            out["thinking_budget"] = self.model.anthropic_thinking_budget
        return out

    def request(self, messages: list[dict[str, Any]], tools: list[ToolSpec], max_tokens: int | None) -> dict[str, Any]:
        s = self.sampling_cfg
        system, msgs = to_anthropic(messages)
        body: dict[str, Any] = {"model": self.model.model, "messages": msgs, "max_tokens": max_tokens or 8192}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [t.anthropic() for t in tools]
        for name, key in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                          ("stop", "stop_sequences")):
            value = getattr(s, name)
            if value is not None:
                body[key] = value
        if self.model.anthropic_thinking_budget:
            body["thinking"] = {"type": "enabled", "budget_tokens": self.model.anthropic_thinking_budget}
        return body

    async def complete(self, ctx: EpisodeContext, messages: list[dict[str, Any]], tools: list[ToolSpec],
                       max_tokens: int | None) -> ModelTurn:
        import anthropic

        body = self.request(messages, tools, max_tokens)
        # only the fields every SDK version takes as arguments; the rest (sampling parameters come and go
        # between API versions) travel in the body as they are
        core = {k: body.pop(k) for k in ("model", "messages", "max_tokens")}
        extra = {**body, **self.sampling_cfg.extra_body}
        t0 = time.perf_counter()
        try:
            async with self.limiter:
                response = await self.client.messages.create(**core, extra_body=extra or None)
        except anthropic.APIStatusError as e:
            text = f"{e.status_code}: {e.message}"
            raise ModelError(text, context_exceeded="prompt is too long" in text.lower()) from e
        except anthropic.APIError as e:
            raise ModelError(f"{type(e).__name__}: {e}") from e
        data = response.model_dump()
        message, finish, usage = from_anthropic(data)
        return ModelTurn(message=message, finish_reason=finish, usage=usage, latency_s=time.perf_counter() - t0,
                         response_id=data.get("id"))

    async def end_episode(self, ctx: EpisodeContext) -> None:
        return None

    async def aclose(self) -> None:
        await self.client.close()
