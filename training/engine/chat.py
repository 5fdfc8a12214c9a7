"""What every backend shares: requests rendered through the model's chat template, completions
parsed into content and Hermes/Qwen-style tool calls, and the OpenAI response built around them."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from training.chat_template import IM_END, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


class RequestError(ValueError):
    """A request the engine cannot serve; becomes a 400 with this message."""


@dataclass
class Sampling:
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_request(cls, body: dict[str, Any], default_max: int) -> Sampling:
        max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                          default_max)
        try:
            s = cls(max_tokens=int(max_tokens), temperature=float(body.get("temperature", 1.0)),
                    top_p=float(body.get("top_p", 1.0)),
                    top_k=int(body["top_k"]) if body.get("top_k") is not None else None,
                    seed=int(body["seed"]) if body.get("seed") is not None else None)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling parameter: {e}") from None
        if s.max_tokens < 1 or s.temperature < 0 or not 0 < s.top_p <= 1:
            raise RequestError("max_tokens must be >= 1, temperature >= 0 and top_p in (0, 1]")
        return s


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # of each generated token under the model's own distribution (temperature 1)
    finish_reason: str  # "stop" (end of turn) or "length"
    policy_version: int | None = None  # the weights that generated it (None: the backend's current version)


class Backend(Protocol):
    tokenizer: Any
    model_name: str
    version: int
    max_context: int

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        ...

    def load_weights(self, path: str, version: int | None = None) -> int:
        ...


def render_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                 for m in messages):
        raise RequestError("messages must be a non-empty list of objects with a role")
    msgs = []
    for m in messages:
        m = dict(m)
        calls = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    if not isinstance(json.loads(args), dict):
                        raise ValueError
                except ValueError:
                    raise RequestError("tool call arguments in the history are not a JSON object") from None
            calls.append({**c, "function": {"name": fn.get("name", ""), "arguments": args}})
        if calls:
            m["tool_calls"] = calls
        msgs.append(m)
    tools = body.get("tools") or None
    try:
        ids = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    except Exception as e:  # a template error on odd input is the request's fault
        raise RequestError(f"the chat template cannot render these messages: {e}") from None
    return list(ids)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content before the first <tool_call>, and the calls. Arguments are returned exactly as the model
    wrote them, so the history renders back to the same text; a call whose JSON is broken is still a
    call (with its raw arguments) when its name can be read, so the harness charges it as malformed."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return (text or None), []
    content = text[:start] or None
    calls = []
    for i, block in enumerate(re.findall(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE)
                                         + r"|$)", text[start:], flags=re.S)):
        name_m = _NAME.search(block)
        args_m = _ARGS.search(block)
        if not name_m:
            continue
        raw = "{}"
        if args_m:
            rest = block[args_m.end():]
            try:
                _, end = json.JSONDecoder().raw_decode(rest)
                raw = rest[:end]
            except json.JSONDecodeError:
                raw = rest.rstrip().removesuffix("}").rstrip()
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}_{i}", "type": "function",
                      "function": {"name": name_m.group(1), "arguments": raw}})
    if not calls:
        return (text or None), []
    return content, calls


def chat_completion(backend: Backend, body: dict[str, Any], default_max: int = 1024) -> dict[str, Any]:
    """One /v1/chat/completions request answered (n = 1, no streaming)."""
    if body.get("stream"):
        raise RequestError("streaming is not supported")
    if int(body.get("n") or 1) != 1:
        raise RequestError("only n = 1 is supported")
    sampling = Sampling.from_request(body, default_max)
    tok = backend.tokenizer
    prompt = render_prompt(tok, body)
    room = backend.max_context - len(prompt)
    if room < 1:
        raise RequestError(f"This model's maximum context length is {backend.max_context} tokens; the prompt "
                           f"has {len(prompt)}")
    sampling.max_tokens = min(sampling.max_tokens, room)
    gen = backend.generate(prompt, sampling)
    text = tok.decode(gen.token_ids, skip_special_tokens=False)
    text = text[: -len(IM_END)] if text.endswith(IM_END) else text
    content, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish = gen.finish_reason
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None,
                                           "top_logprobs": []} for t, lp in zip(gen.token_ids, gen.logprobs,
                                                                                 strict=True)]}
    version = gen.policy_version if gen.policy_version is not None else backend.version
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": backend.model_name, "policy_version": version, "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(gen.token_ids),
                  "total_tokens": len(prompt) + len(gen.token_ids)}}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt
        choice["token_ids"] = gen.token_ids
    return out
