"""A profile's verdict from its paired timing: the pairing's record (its rounds, noise, load), the speedups and their
confidence intervals, and the baseline measured again where the pairing says it was measured under load
(sandbox/timing/profile.py times; this scores). Split from profile.py to keep each under 400 lines."""

from __future__ import annotations

import math
import time

from sandbox.config import ProfileConfig
from sandbox.results import PairedTiming, ProfileResult, Reason, Timing
from sandbox.reward import compile_threshold, eager_threshold, speedup_bounds
from sandbox.timing import baseline, early_stop, paired, waits
from sandbox.timing.baseline import compile_noise, is_launch_bound


def scored(pr, pairing: dict) -> ProfileResult:
    """The profile's result from its pairing, its processes gone: the baseline measured again where eager drifted
    from it (paired.retimes_baseline), then the speedups and the message."""
    cfg, out, b = pr.cfg, pr.out, pr.b
    result = pr.result
    if paired.retimes_baseline(pairing["eager_ms"], b, cfg):
        # measured again now, this profile's processes gone (paired.retimes_baseline says when and why)
        if (failed := pr.baseline(refresh="drift")) is not None:
            return failed
        b = pr.b
        out["paired"] = paired_record(pairing, b)
    p, eager, cand = out["paired"], out["eager"], out["candidate"]
    out["launch_bound"] = is_launch_bound(b.eager, cfg)
    out["speedup_vs_eager"], out["speedup_vs_eager_range"] = paired.speedup(p.rounds)
    kept = [r.speedup for r in paired.kept_rounds(p.rounds) if r.speedup is not None]
    out["speedup_vs_eager_ci"] = ci = speedup_bounds(kept, cfg.reward.speedup_confidence)
    lb = out["launch_bound"]
    if ci is not None and ci[0] > eager_threshold(cfg.reward, lb) and compile_threshold(cfg.reward, lb) is not None \
            and b.compiled is not None and (why := compile_noise(b.compile_checks, cfg)) is not None:
        # a speed milestone is in reach and torch.compile's figure is not to be trusted: measured again now (the
        # profile's processes gone), and if it still is not, no milestone rests on it (issue 65, item 7)
        if (failed := pr.baseline(refresh="compile")) is not None:
            return failed
        b = pr.b
        out["paired"] = p = paired_record(pairing, b)
        if (again := compile_noise(b.compile_checks, cfg)) is not None:
            return result(False, Reason.timing_noisy, f"the machine was too noisy to time torch.compile's baseline, "
                          f"which a milestone would rest on: {why}; measured again: {again}. Nothing is scored from "
                          "this run: profile again")
    # kept where no milestone was in reach by this config's thresholds: a reward computed with lower ones must not find
    # faster_than_compile on a figure nobody verified (sandbox/reward.py withholds it)
    out["compile_noise"] = compile_noise(b.compile_checks, cfg) if b.compiled is not None else None
    compiled, ratio, ratio_range = baseline.compile_estimate(b, eager)
    out["compiled"] = compiled
    se, se_range = out["speedup_vs_eager"], out["speedup_vs_eager_range"]
    if ratio is not None and se is not None:
        out["speedup_vs_compile"] = se * ratio
        if se_range is not None and ratio_range is not None:
            out["speedup_vs_compile_range"] = (se_range[0] * ratio_range[0], se_range[1] * ratio_range[1])
        if ci is not None:
            lo_r, hi_r = ratio_range or (ratio, ratio)
            out["speedup_vs_compile_ci"] = (ci[0] * lo_r, ci[1] * hi_r)
    msg = (f"ModelNew {cand.median_ms:.4g} ms vs eager {eager.median_ms:.4g} ms timed beside it in "
           f"{len(p.rounds)} of {p.max_rounds} rounds" + (f" (stopped: {p.stopped})" if p.stopped != "max_rounds" else "")
           + (f" ({se:.2f}x" + (f", at least {ci[0]:.2f}x at {cfg.reward.speedup_confidence:.0%} confidence"
                                 if ci is not None else "") + ")" if se is not None else ""))
    if out.get("speedup_vs_compile") is not None:
        msg += (f", torch.compile {compiled.median_ms:.4g} ms by the baseline's ratio to eager "
                f"({out['speedup_vs_compile']:.2f}x)")
    if out["launch_bound"]:
        msg += (f"; launch-bound (eager below {cfg.launch_bound_ms:g} ms): the baselines measure launch overhead, "
                "so the torch.compile milestone does not count and faster-than-eager needs a margin")
    return result(True, None, msg)


def min_kept(cfg: ProfileConfig, backend: str) -> int | None:
    """The undisturbed rounds a pairing needs where disturbed ones are left out (paired.kept_rounds: CUDA): the
    rounds every timing runs, a majority of the budget."""
    return early_stop.guaranteed_rounds(cfg) if paired.spread_is_local(backend) else None


def pairing_of(run: dict, attempts: int, b, cfg: ProfileConfig, backend: str) -> dict:
    eb = run["eager"]["batches"]
    local = paired.spread_is_local(backend)
    why = paired.noise(run, b, cfg.noise_max_spread, cfg.baseline_max_drift, paired.drift_counts(b, cfg, backend),
                       local, cfg.candidate_max_spread, min_kept(cfg, backend))
    rule = run.get("rule")
    rounds = paired.rounds(eb, run["candidate"]["batches"], cfg.noise_max_spread if local else None)
    return dict(rounds=rounds, disturbed_rounds=len(rounds) - len(paired.kept_rounds(rounds)),
                load_factor=waits.pairing_factor(eb, run["candidate"]["batches"]), rounds_spread=paired.rounds_spread(rounds),
                waited=_waited(eb, run["candidate"]["batches"]),
                eager_spread=paired.eager_spread(eb, local),
                noisy=why is not None, noise=why, attempts=attempts, paired_again_for=run.get("paired_again_for", []),
                max_rounds=cfg.timing_batches,
                min_rounds=rule.min_rounds if rule else None, stopped=run.get("stopped"),
                stop_thresholds=[tuple(x if math.isfinite(x) else None for x in band) for band in rule.bands] if rule
                else [],
                eager_ms=Timing(**{k: v for k, v in run["eager"].items() if k != "end"}).median_ms)


def paired_record(pairing: dict, b) -> PairedTiming:
    """The paired rounds, and what the speedups take from the baseline `b`."""
    then = b.eager.median_ms
    return PairedTiming(**{k: v for k, v in pairing.items() if k not in ("eager_ms", "noise")}, baseline_eager_ms=then,
                        baseline_compiled_ms=b.compiled.median_ms if b.compiled else None,
                        compile_ratio=baseline.compile_ratio(b)[0],
                        eager_drift=pairing["eager_ms"] / max(then, 1e-9),
                        baseline_age_s=0.0 if not b.cached else (time.time() - b.created if b.created else None),
                        baseline_retimed=b.refreshed)


def _waited(eager_batches: list[dict], cand_batches: list[dict]) -> tuple[float, float] | None:
    e, c = (waits.mean([b.get("waited") for b in bs]) for bs in (eager_batches, cand_batches))
    return (e, c) if e is not None and c is not None else None
