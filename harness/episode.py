"""One episode: open a workspace, let the policy work through the tools (ReAct), judge, record.

The loop ends when the model answers without a tool call, runs out of turns or context, keeps
getting cut off, or the episode's time is up. Whatever happened, the workspace is then judged by
the harness itself and the record says how the episode ended.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from harness.config import AgentConfig, JudgeConfig
from harness.judge import judge_with_limit, not_judged
from harness.mcp_tools import EpisodeTools, ToolServer, ToolServerError
from harness.policy import EpisodeContext, ModelError, Policy, tool_calls_of
from harness.prompts import TRUNCATED_NOTE, system_prompt, task_prompt
from harness.specs import level_of
from harness.trajectory import EpisodeRecord, TaskRef, ToolCallRecord, TurnRecord, Usage, episode_key
from tasks import Task

# characters per token for estimates where the server reported no usage; low, to stay on the safe side
CHARS_PER_TOKEN = 3.0
MIN_RESPONSE_TOKENS = 256


@dataclass
class LoopState:
    messages: list[dict[str, Any]]
    turns: list[TurnRecord] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    ended: str = "max_turns"
    detail: str = ""
    # context accounting: tokens of the last call (prompt + response) and characters added since
    context_tokens: int = 0
    chars_since: int = 0
    call_ids: set[str] = field(default_factory=set)


def _chars(message: dict[str, Any]) -> int:
    return len(json.dumps({k: v for k, v in message.items() if k != "thinking_blocks"}))


def _append(state: LoopState, message: dict[str, Any]) -> None:
    state.messages.append(message)
    state.chars_since += _chars(message)


def _prompt_estimate(state: LoopState, tools_chars: int) -> int:
    if state.context_tokens:
        return state.context_tokens + int(state.chars_since / CHARS_PER_TOKEN)
    return int((sum(_chars(m) for m in state.messages) + tools_chars) / CHARS_PER_TOKEN)


def _unique_ids(state: LoopState, message: dict[str, Any], turn: int) -> None:
    # some servers reuse ids like "call_0" every turn; replies must name their call unambiguously
    for i, call in enumerate(tool_calls_of(message)):
        cid = call.get("id") or f"call_{turn}_{i}"
        if cid in state.call_ids:
            cid = f"{cid}_{turn}_{i}"
        call["id"] = cid
        state.call_ids.add(cid)


async def agent_loop(policy: Policy, ctx: EpisodeContext, tools: EpisodeTools, cfg: AgentConfig,
                     max_tokens: int | None, state: LoopState, t_start: float) -> None:
    """Runs turns until the episode ends; fills `state` as it goes, so a timeout keeps what was done."""
    tools_chars = sum(len(json.dumps(s.openai())) for s in tools.specs)
    truncations = 0
    for turn_index in range(cfg.max_turns):
        estimate = _prompt_estimate(state, tools_chars)
        room = cfg.context_budget_tokens - estimate
        if room < MIN_RESPONSE_TOKENS:
            state.ended, state.detail = "context_budget", f"about {estimate} tokens in context, budget " \
                                                          f"{cfg.context_budget_tokens}"
            return
        limit = min(max_tokens, room) if max_tokens else room
        started = time.perf_counter() - t_start
        try:
            reply = await policy.complete(ctx, state.messages, tools.specs, limit)
        except ModelError as e:
            state.ended = "context_budget" if e.context_exceeded else "model_error"
            state.detail = str(e)[:2000]
            return
        message = reply.message
        _unique_ids(state, message, turn_index)
        state.messages.append(message)
        state.usage.prompt_tokens += reply.usage.prompt_tokens
        state.usage.completion_tokens += reply.usage.completion_tokens
        if reply.usage.prompt_tokens:
            state.context_tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
            state.chars_since = 0
        else:
            state.chars_since += _chars(message)
        record = TurnRecord(index=turn_index, message_index=len(state.messages) - 1, started_s=started,
                            model_s=reply.latency_s, finish_reason=reply.finish_reason, usage=reply.usage,
                            prompt_token_ids=reply.prompt_token_ids, completion_token_ids=reply.completion_token_ids,
                            completion_logprobs=reply.completion_logprobs, response_id=reply.response_id,
                            policy_version=reply.policy_version)
        state.turns.append(record)
        calls = tool_calls_of(message)
        truncated = reply.finish_reason == "length"
        truncations = truncations + 1 if truncated else 0
        t_tools = time.perf_counter()
        for call in calls:
            fn = call.get("function") or {}
            raw = fn.get("arguments")
            raw_s = raw if isinstance(raw, str) else json.dumps(raw or {})
            out = await tools.call(fn.get("name") or "", raw_s)
            record.tool_calls.append(ToolCallRecord(
                id=call["id"], name=fn.get("name") or "", arguments_raw=raw_s, mcp_name=out.mcp_name,
                server=out.server, arguments=out.arguments, is_error=out.is_error, error_kind=out.error_kind,
                result_text=out.text, structured=out.structured, duration_s=out.duration_s))
            _append(state, {"role": "tool", "tool_call_id": call["id"], "content": out.text,
                            "is_error": out.is_error})
        record.tools_s = time.perf_counter() - t_tools
        if truncated:
            if truncations >= cfg.max_consecutive_truncations:
                state.ended = "truncated"
                state.detail = f"{truncations} responses in a row were cut off at the token limit"
                return
            if not calls:
                _append(state, {"role": "user", "content": TRUNCATED_NOTE.format(limit=limit)})
            continue
        if not calls:
            state.ended = "model_stopped"
            return
    state.ended = "max_turns"


def close_open_calls(state: LoopState, why: str) -> None:
    """Give every tool call of the last turn a result, so the conversation stays well formed when the
    episode was stopped in the middle of a turn."""
    if not state.turns:
        return
    turn = state.turns[-1]
    answered = {c.id for c in turn.tool_calls}
    for call in tool_calls_of(state.messages[turn.message_index]):
        if call["id"] in answered:
            continue
        fn = call.get("function") or {}
        raw = fn.get("arguments")
        text = f"error: {why}"
        turn.tool_calls.append(ToolCallRecord(id=call["id"], name=fn.get("name") or "",
                                              arguments_raw=raw if isinstance(raw, str) else json.dumps(raw or {}),
                                              is_error=True, error_kind="cancelled", result_text=text))
        state.messages.append({"role": "tool", "tool_call_id": call["id"], "content": text, "is_error": True})


def workspace_name(task: Task) -> str:
    return re.sub(r"[^\w.-]", "_", task.name)[:64] or "task"


@dataclass
class EpisodeSetup:
    """What an episode needs besides its task: who answers, where the tools are, the settings."""

    policy: Policy
    agent: AgentConfig
    judge: JudgeConfig
    max_tokens: int | None = None


async def run_episode(task: Task, sample: int, server: ToolServer, setup: EpisodeSetup) -> EpisodeRecord:
    cfg = setup.agent
    started_at = time.time()
    t_start = time.perf_counter()
    state = LoopState(messages=[])
    ws_id: str | None = None
    backend = cfg.backend
    judgment = None
    tool_specs: list[dict[str, Any]] = []
    ctx = EpisodeContext(task=task, sample=sample, backend=backend or "", workspace_id=None)
    agent_s = 0.0
    try:
        args: dict[str, Any] = {"source": task.source, "name": workspace_name(task)}
        if backend:
            args["backend"] = backend
        opened = await server.call("open_task", args, cfg.tool_timeout_s)
        if opened.is_error or not opened.structured:
            state.ended, state.detail = "no_workspace", opened.text[:2000]
            judgment = not_judged(opened.text[:2000], setup.judge)
        else:
            ws_id = opened.structured["workspace_id"]
            backend = opened.structured.get("backend") or backend or "cuda"
            ctx.workspace_id, ctx.backend = ws_id, backend
            tools = EpisodeTools([server], {"workspace_id": ws_id}, set(cfg.hidden_tools), cfg.tool_timeout_s,
                                 cfg.max_tool_result_chars)
            tool_specs = [s.openai() for s in tools.specs]
            state.messages += [{"role": "system", "content": cfg.system_prompt or system_prompt()},
                               {"role": "user", "content": task_prompt(task, backend)}]
            t_agent = time.perf_counter()
            try:
                with anyio.move_on_after(cfg.episode_timeout_s) as scope:
                    await agent_loop(setup.policy, ctx, tools, cfg, setup.max_tokens, state, t_start)
                if scope.cancelled_caught:
                    state.ended, state.detail = "timeout", f"the episode's {cfg.episode_timeout_s:.0f} s ran out"
                    close_open_calls(state, "the episode's time ran out before this call finished")
            finally:
                agent_s = time.perf_counter() - t_agent
                await setup.policy.end_episode(ctx)
    except ToolServerError as e:
        state.ended, state.detail = "tool_server_error", str(e)
        close_open_calls(state, "the tool server went away")
    except Exception as e:  # a harness bug in one episode must not take the run down
        state.ended, state.detail = "error", f"{type(e).__name__}: {e}"[:2000]
        close_open_calls(state, "the harness failed while running this call")
    if ws_id is not None and state.ended != "tool_server_error":
        try:
            judgment = await judge_with_limit(server, ws_id, backend or "cuda", setup.judge)
            if not cfg.keep_workspaces:
                await server.call("close_workspace", {"workspace_id": ws_id}, 120)
        except ToolServerError as e:
            state.ended, state.detail = "tool_server_error", str(e)
            judgment = None
    if judgment is None:
        judgment = not_judged(state.detail or state.ended, setup.judge)
    return EpisodeRecord(
        episode_id=uuid.uuid4().hex, key=episode_key(task.id, sample),
        task=TaskRef(id=task.id, sha256=task.sha256, level=level_of(task.id),
                     path=str(task.path) if task.path else None),
        sample=sample, policy=setup.policy.describe(), sampling=setup.policy.sampling(),
        agent=cfg.model_dump(mode="json"), tool_server={"alias": server.alias, "where": server.where,
                                                        "gpu": server.gpu},
        workspace_id=ws_id, backend=backend, tools=tool_specs, messages=state.messages, turns=state.turns,
        usage=state.usage, ended=state.ended, end_detail=state.detail, judgment=judgment, started_at=started_at,
        agent_s=agent_s, duration_s=time.perf_counter() - t_start)
