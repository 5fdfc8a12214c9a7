"""Milestone rewards, computed only from the judge's own results."""

from __future__ import annotations

from sandbox.config import RewardConfig
from sandbox.results import (
    INTEGRITY_REASONS,
    CompileResult,
    ProfileResult,
    Reason,
    RewardResult,
    VerifyResult,
)


def eager_threshold(cfg: RewardConfig, launch_bound: bool | None) -> float:
    """faster_than_eager needs speedup_vs_eager above this. The one place the milestones' thresholds are
    computed: milestone_reward decides with them, and profile's early stop (sandbox/timing/early_stop.py)
    stops only once its rounds are on one side of them."""
    return 1.0 + (max(cfg.eager_margin, cfg.launch_bound_eager_margin) if launch_bound else cfg.eager_margin)


def compile_threshold(cfg: RewardConfig, launch_bound: bool | None) -> float | None:
    """faster_than_compile needs speedup_vs_compile above this (and faster_than_eager); None where it cannot be
    earned (a launch-bound task, unless launch_bound_counts)."""
    return 1.0 + cfg.compile_margin if not launch_bound or cfg.launch_bound_counts else None


def caught_cheating(result: VerifyResult | ProfileResult | CompileResult | None) -> Reason | None:
    """The integrity reason a result failed with, if it did (see INTEGRITY_REASONS)."""
    if result is None or result.ok or result.reason is None:
        return None
    return result.reason if result.reason in INTEGRITY_REASONS else None


def milestone_reward(compiled: CompileResult | None, verified: VerifyResult | None,
                     profiled: ProfileResult | None, config: RewardConfig | None = None) -> RewardResult:
    """failed < correct < faster than eager < faster than torch.compile (by the configured margins).

    A speedup counts only when verify passed; a profile of an incorrect kernel earns nothing. A profile
    that caught the candidate cheating (an integrity reason) makes the whole episode failed: otherwise a
    kernel honest only while verified would earn what an honest slow kernel earns. A profile that failed
    for an innocent reason (a timeout, the baseline's OOM) leaves the `correct` milestone; when that reason
    is timing_noisy (the machine too noisy to time a speedup) the reward carries it, so that callers who cache
    verdicts know this one is about the machine, not the files.
    """
    cfg = config or RewardConfig()
    is_compiled = bool(compiled and compiled.ok)
    verified_ok = bool(is_compiled and verified and verified.ok)
    timed = profiled is not None and profiled.ok
    se = profiled.speedup_vs_eager if timed else None
    sc = profiled.speedup_vs_compile if timed else None
    launch_bound = profiled.launch_bound if timed else None
    common = dict(compiled=is_compiled, speedup_vs_eager=se, speedup_vs_compile=sc, launch_bound=launch_bound)
    if not is_compiled:
        reason = compiled.reason if compiled is not None else None
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False, reason=reason, **common)
    if not verified_ok:
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False,
                            reason=verified.reason if verified is not None else None, **common)
    cheat = caught_cheating(profiled)
    if cheat is not None:
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False, reason=cheat,
                            compiled=is_compiled, launch_bound=None)
    if profiled is not None and not profiled.ok and profiled.reason == Reason.timing_noisy:
        # the judge could not time it, through no fault of the kernel: correct, and the reason says why no more
        return RewardResult(reward=cfg.correct, milestone="correct", correct=True, reason=Reason.timing_noisy,
                            **common)
    faster_than_eager = se is not None and se > eager_threshold(cfg, launch_bound)
    tc = compile_threshold(cfg, launch_bound)
    if faster_than_eager and tc is not None and sc is not None and sc > tc:
        return RewardResult(reward=cfg.faster_than_compile, milestone="faster_than_compile", correct=True, **common)
    if faster_than_eager:
        return RewardResult(reward=cfg.faster_than_eager, milestone="faster_than_eager", correct=True, **common)
    return RewardResult(reward=cfg.correct, milestone="correct", correct=True, **common)
