"""Any OpenAI-compatible chat-completions endpoint with tool calling: vLLM, SGLang, OpenAI, others.

Non-standard response fields are read when present: `reasoning_content`/`reasoning` (vLLM's
reasoning parsers), `prompt_token_ids` and `choices[].token_ids` (vLLM with return_token_ids), and
`policy_version` (the weights version of the project's own engine, training.engine).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import anyio

from harness.config import ModelConfig, SamplingConfig
from harness.policy import EpisodeContext, ModelError, ModelTurn, api_history
from harness.tool_schemas import ToolSpec
from harness.trajectory import Usage

_CONTEXT_WORDS = ("context length", "context_length", "maximum context", "too many tokens", "prompt is too long",
                  "max_model_len", "context window")


@dataclass
class Endpoint:
    url: str | None
    client: Any
    limiter: anyio.CapacityLimiter
    episodes: int = 0


def _official(url: str | None) -> bool:
    return url is None or "api.openai.com" in url


class OpenAIChatPolicy:
    def __init__(self, model: ModelConfig, sampling: SamplingConfig):
        from openai import AsyncOpenAI

        self.model = model
        self.sampling_cfg = sampling
        key = model.resolved_key() or "EMPTY"  # local servers usually take any key
        urls: list[str | None] = list(model.base_url) or [None]
        self.endpoints = [Endpoint(url, AsyncOpenAI(base_url=url, api_key=key, timeout=model.request_timeout_s,
                                                    max_retries=model.max_retries),
                                   anyio.CapacityLimiter(model.max_requests_per_endpoint)) for url in urls]

    def describe(self) -> dict[str, Any]:
        return {"provider": "openai", "model": self.model.model,
                "base_url": [e.url for e in self.endpoints if e.url] or None}

    def sampling(self) -> dict[str, Any]:
        return self.sampling_cfg.model_dump(exclude_none=True)

    def _endpoint(self, ctx: EpisodeContext) -> Endpoint:
        # an episode stays on one endpoint so the server's prefix cache keeps its conversation
        idx = ctx.state.get("endpoint")
        if idx is None:
            idx = min(range(len(self.endpoints)), key=lambda i: self.endpoints[i].episodes)
            ctx.state["endpoint"] = idx
            self.endpoints[idx].episodes += 1
        return self.endpoints[idx]

    async def end_episode(self, ctx: EpisodeContext) -> None:
        idx = ctx.state.pop("endpoint", None)
        if idx is not None:
            self.endpoints[idx].episodes -= 1

    async def aclose(self) -> None:
        for ep in self.endpoints:
            await ep.client.close()

    def request(self, messages: list[dict[str, Any]], tools: list[ToolSpec], max_tokens: int | None,
                url: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request's standard fields and its extra body."""
        s = self.sampling_cfg
        body: dict[str, Any] = {"model": self.model.model,
                                "messages": api_history(messages, self.model.reasoning_in_history)}
        if tools:
            body["tools"] = [t.openai() for t in tools]
        if max_tokens is not None:
            body["max_completion_tokens" if _official(url) else "max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "seed", "stop"):
            value = getattr(s, name)
            if value is not None:
                body[name] = value
        if s.logprobs:
            body["logprobs"] = True
        extra = dict(s.extra_body)
        if s.top_k is not None:
            extra.setdefault("top_k", s.top_k)
        if self.model.return_token_ids:
            extra.setdefault("return_token_ids", True)
        return body, extra

    async def complete(self, ctx: EpisodeContext, messages: list[dict[str, Any]], tools: list[ToolSpec],
                       max_tokens: int | None) -> ModelTurn:
        import openai

        ep = self._endpoint(ctx)
        body, extra = self.request(messages, tools, max_tokens, ep.url)
        t0 = time.perf_counter()
        try:
            async with ep.limiter:
                response = await ep.client.chat.completions.create(**body, extra_body=extra or None)
        except openai.APIStatusError as e:
            text = f"{e.status_code}: {e.message}"
            raise ModelError(text, context_exceeded=any(w in text.lower() for w in _CONTEXT_WORDS)) from e
        except openai.APIError as e:
            raise ModelError(f"{type(e).__name__}: {e}") from e
        return parse_response(response.model_dump(), time.perf_counter() - t0, ctx)


def _usage(data: dict[str, Any] | None) -> Usage:
    data = data or {}
    details = data.get("completion_tokens_details") or {}
    prompt_details = data.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=int(data.get("prompt_tokens") or 0),
                 completion_tokens=int(data.get("completion_tokens") or 0),
                 reasoning_tokens=details.get("reasoning_tokens"), cached_tokens=prompt_details.get("cached_tokens"))


def parse_response(data: dict[str, Any], latency_s: float, ctx: EpisodeContext) -> ModelTurn:
    choices = data.get("choices") or []
    if not choices:
        raise ModelError(f"the response has no choices: {str(data)[:500]}")
    choice = choices[0]
    msg = choice.get("message") or {}
    message: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = []
    turn = ctx.state.setdefault("turn", 0)
    ctx.state["turn"] = turn + 1
    for i, c in enumerate(msg.get("tool_calls") or []):
        fn = c.get("function") or {}
        args = fn.get("arguments")
        calls.append({"id": c.get("id") or f"call_{turn}_{i}", "type": "function",
                      "function": {"name": fn.get("name") or "",
                                   "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    lp = choice.get("logprobs") or {}
    if lp.get("content"):
        logprobs = [float(t.get("logprob", 0.0)) for t in lp["content"]]
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    version = data.get("policy_version")
    return ModelTurn(message=message, finish_reason=choice.get("finish_reason"), usage=_usage(data.get("usage")),
                     latency_s=latency_s, prompt_token_ids=prompt_ids, completion_token_ids=choice.get("token_ids"),
                     completion_logprobs=logprobs, response_id=data.get("id"),
                     policy_version=version if isinstance(version, int) else None)
