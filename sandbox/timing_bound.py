"""The judge's own bound on reported timings, measured from the parent's side of the pipe.

The timer process runs candidate code, so everything it reports (per-call times, statistics, the
clocks themselves) can be rewritten by that code. The parent process measures the wall time of each
`time` request: the request ends with the spot-checked outputs, so the timed calls really ran inside
it. Its wall time is at least warm-up + timed calls + per-call overheads (input refill, dispatch,
the pipe). The overhead per call is calibrated on the same task's eager baseline, measured the same
way, so inputs and machine match. A candidate whose reported calls leave more of the wall time
unexplained than an honest run does is refused (timing_unverified); the external per-call estimate is
reported either way.
"""

from __future__ import annotations

from sandbox.results import Timing

# how much unexplained time a candidate's request may have beyond the calibrated overheads: a share of
# its wall time (noise on shared cores), and a floor in ms (process scheduling, pipe latency)
SLACK_FRACTION = 0.35
SLACK_MS = 25.0


def predicted_ms(median_ms: float, mean_ms: float, trials: int, cfg: dict, overhead_per_call_ms: float) -> float:
    """Wall time a request must take if the reported times are true: warm-up, then 3 estimate calls and
    one to size the outputs, then the trials."""
    warm = max(cfg["warmup_ms"], cfg["min_warmup_calls"] * median_ms)
    return warm + 4 * median_ms + trials * (mean_ms + overhead_per_call_ms)


def calibrate(eager: Timing, cfg: dict) -> float:
    """Per-call overhead of an honest run (the eager baseline): what its reported calls do not explain."""
    if eager.wall_ms is None:
        return 0.0
    n = max(eager.trials, 1)
    rest = eager.wall_ms - predicted_ms(eager.median_ms, eager.mean_ms, n, cfg, 0.0)
    return max(rest, 0.0) / n


def check(wall_ms: float, timing: Timing, cfg: dict, overhead_per_call_ms: float) -> dict:
    """The bound's numbers for the profile result; 'ok' False when the reported times cannot be true."""
    n = max(timing.trials, 1)
    expected = predicted_ms(timing.median_ms, timing.mean_ms, n, cfg, overhead_per_call_ms)
    unexplained = wall_ms - expected
    allowed = SLACK_MS + SLACK_FRACTION * wall_ms
    # the per-call time the wall clock allows, if every unexplained ms belonged to the timed calls
    external = timing.mean_ms + max(unexplained, 0.0) / n
    return {"wall_ms": wall_ms, "expected_wall_ms": expected, "unexplained_ms": unexplained,
            "allowed_unexplained_ms": allowed, "overhead_per_call_ms": overhead_per_call_ms,
            "external_per_call_ms": external, "ok": unexplained <= allowed}
