"""The final judgment of a workspace: compile, verify and profile run by the harness itself, then the
milestone reward. What the model said about its work plays no part."""

from __future__ import annotations

import time
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError

from harness.config import JudgeConfig
from harness.mcp_tools import ToolServer
from harness.trajectory import Judgment
from sandbox.results import CompileResult, ProfileResult, Reason, VerifyResult
from sandbox.reward import milestone_reward


class _Failed(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


async def _op(server: ToolServer, tool: str, args: dict[str, Any], model: type[BaseModel], deadline: float) -> Any:
    remaining = deadline - time.monotonic()
    if remaining <= 1:
        raise _Failed(f"the judge ran out of time before {tool}")
    outcome = await server.call(tool, args, remaining)
    if outcome.is_error or outcome.structured is None:
        raise _Failed(f"{tool} failed: {outcome.text[:2000]}")
    try:
        return model.model_validate(outcome.structured)
    except ValidationError as e:
        raise _Failed(f"{tool} returned a result the harness cannot read: {e}") from None


async def judge_workspace(server: ToolServer, workspace_id: str, backend: str, cfg: JudgeConfig) -> Judgment:
    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.timeout_s
    ws = {"workspace_id": workspace_id}
    c: CompileResult | None = None
    v: VerifyResult | None = None
    p: ProfileResult | None = None
    error = None
    try:
        c = await _op(server, "compile", ws, CompileResult, deadline)
        if c.ok:
            trials = {"trials": cfg.verify_trials} if cfg.verify_trials else {}
            v = await _op(server, "verify", {**ws, **trials}, VerifyResult, deadline)
        # always: profile is where a kernel honest only while verified gets caught, so skipping it
        # (or an agent never calling it) must not leave a cheat its `correct` reward
        if v is not None and v.ok:
            p = await _op(server, "profile", {**ws, "compile_mode": cfg.compile_mode}, ProfileResult, deadline)
    except _Failed as e:
        error = e.message
        # a judge step that could not run counts as that step failing, so the reward is never too high
        if c is None:
            c = CompileResult(ok=False, reason=Reason.internal_error, message=error, backend=backend, duration_s=0.0)
        elif c.ok and v is None:
            v = VerifyResult(ok=False, reason=Reason.internal_error, message=error, backend=backend, atol=0.0,
                             rtol=0.0, duration_s=0.0)
    reward = milestone_reward(c, v, p, cfg.reward)
    settings: dict[str, Any] = {"verify_trials": len(v.trials) if v is not None and v.ok else cfg.verify_trials,
                                "compile_mode": cfg.compile_mode, "profiled": p is not None,
                                "reward": cfg.reward.model_dump()}
    if v is not None:
        settings.update(atol=v.atol, rtol=v.rtol, verify_device=v.device)
    if p is not None:
        settings.update(device=p.device, torch_version=p.torch_version)
    return Judgment(compile=c, verify=v, profile=p, reward=reward, settings=settings, error=error,
                    duration_s=time.perf_counter() - t0)


def not_judged(reason: str, cfg: JudgeConfig) -> Judgment:
    """The judgment of an episode that never got a workspace."""
    return Judgment(reward=milestone_reward(None, None, None, cfg.reward), error=reason,
                    settings={"compile_mode": cfg.compile_mode, "reward": cfg.reward.model_dump()})


async def judge_with_limit(server: ToolServer, workspace_id: str, backend: str, cfg: JudgeConfig) -> Judgment:
    with anyio.move_on_after(cfg.timeout_s + 30):
        return await judge_workspace(server, workspace_id, backend, cfg)
    return not_judged(f"the judgment took longer than {cfg.timeout_s:.0f} s", cfg)
