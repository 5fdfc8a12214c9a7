"""Milestone rewards, computed only from the judge's own results."""

from __future__ import annotations

from sandbox.config import RewardConfig
from sandbox.results import CompileResult, ProfileResult, RewardResult, VerifyResult


def milestone_reward(compiled: CompileResult | None, verified: VerifyResult | None,
                     profiled: ProfileResult | None, config: RewardConfig | None = None) -> RewardResult:
    """failed < correct < faster than eager < faster than torch.compile (by the configured margins).

    A speedup counts only when verify passed; a profile of an incorrect kernel earns nothing.
    """
    cfg = config or RewardConfig()
    is_compiled = bool(compiled and compiled.ok)
    correct = bool(is_compiled and verified and verified.ok)
    se = profiled.speedup_vs_eager if profiled and profiled.ok else None
    sc = profiled.speedup_vs_compile if profiled and profiled.ok else None
    common = dict(compiled=is_compiled, correct=correct, speedup_vs_eager=se, speedup_vs_compile=sc)
    if not correct:
        return RewardResult(reward=cfg.failed, milestone="failed", **common)
    if sc is not None and sc > 1.0 + cfg.compile_margin and se is not None and se > 1.0 + cfg.eager_margin:
        return RewardResult(reward=cfg.faster_than_compile, milestone="faster_than_compile", **common)
    if se is not None and se > 1.0 + cfg.eager_margin:
        return RewardResult(reward=cfg.faster_than_eager, milestone="faster_than_eager", **common)
    return RewardResult(reward=cfg.correct, milestone="correct", **common)
