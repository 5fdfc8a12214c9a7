"""Stopping the paired timing once its rounds decide the milestone (docs/judge.md, "Stopping the paired
timing early").

A profile's paired timing runs up to K = timing_batches rounds (a candidate batch between two eager batches,
sandbox/timing/paired.py), and a milestone is earned when the lower end of the median speedup's confidence
interval is above its threshold (sandbox/reward.py): the r-th slowest of the rounds, r from a binomial tail (1 for
five rounds at 95%: the slowest). After m rounds, with m a majority of K (m >= K // 2 + 1), if at least r_K rounds
are at or below a threshold, no rounds still to come can lift the K rounds' bound above it, and the m rounds' bound
is below it too: stopping there is exact, not a bet. The other way (every round so far above) is exact only when the
rounds left are too few to pull the K rounds' bound below, which with K = 5 at 95% is never: a kernel faster than a
threshold runs the full budget, and is scored on all of it. A candidate cannot steer a stop in its favour: what it
did in the rounds that ran is what the full timing would have scored.

The one approximation is the tolerance: rounds that agree within stop_tolerance stop the timing even with a
threshold among them (the milestone then rests on a speedup within that share of the threshold, a coin flip
that more rounds of the same spread would not settle), never with every round above a threshold not yet decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from sandbox.config import ProfileConfig, RewardConfig
from sandbox.results import TimingBound
from sandbox.reward import compile_threshold, eager_threshold, lower_rank
from sandbox.timing import baseline, paired, timing_bound
from sandbox.timing.baseline import BaselineTimes, is_launch_bound

Band = tuple[float, float]  # thresholds on the speedup-over-eager scale, lowest to highest


def milestone_bands(reward: RewardConfig, launch_bound: bool | None, ratio: float | None,
                    ratio_range: tuple[float, float] | None) -> list[Band]:
    """Where the milestone changes on the speedup-over-eager scale. faster_than_eager at the eager threshold
    Te; faster_than_compile needs speedup_vs_eager * ratio > Tc as well, that is speedup_vs_eager above
    max(Te, Tc / ratio), and the ratio is known only within its range (the baseline timings' quartiles): a
    band, [max(Te, Tc / ratio_hi), max(Te, Tc / ratio_lo)]."""
    te = eager_threshold(reward, launch_bound)
    bands = [(te, te)]
    tc = compile_threshold(reward, launch_bound)
    if tc is not None and ratio is not None:
        lo_r, hi_r = ratio_range if ratio_range is not None else (ratio, ratio)
        lo_r, hi_r = min(lo_r, ratio), max(hi_r, ratio)

        def on_eager_scale(r: float) -> float:
            return max(te, tc / r) if r > 0 else math.inf

        bands.append((on_eager_scale(hi_r), on_eager_scale(lo_r)))
    return bands


def decide(speedups: list[float | None], bands: list[Band], tolerance: float, budget: int | None = None,
           confidence: float = RewardConfig().speedup_confidence) -> str | None:
    """Why the rounds so far may end the timing, or None. A milestone is earned when the lower end of the median
    speedup's confidence interval (reward.speedup_bounds: the r-th slowest round) is above its threshold, the top of
    its band (torch.compile's through the ratio's lower end). "decided": for every threshold the rounds so far give
    the milestone that the full `budget` of rounds would give, whatever the rounds not run measure (None: no more
    rounds); "tight": the fastest round within `tolerance` of the slowest, and decided for every threshold below
    them all. The caller makes sure a majority of the budget has run."""
    if not speedups or any(s is None or not math.isfinite(s) for s in speedups):
        return None  # a round without a speedup: no milestone to decide, time on
    m = len(speedups)
    k = max(budget or m, m)
    r_m, r_k = lower_rank(m, confidence), lower_rank(k, confidence)

    def exact(t: float) -> bool:
        at_or_below = sum(1 for s in speedups if s <= t)  # type: ignore[operator]
        if at_or_below >= r_m:  # not earned now: nor with any more rounds once as many are at or below
            return at_or_below >= r_k
        return at_or_below + k - m < r_k  # earned now: and still so if every round not run came in below

    lo, hi = min(speedups), max(speedups)  # type: ignore[type-var]
    thresholds = [b_hi for _, b_hi in bands]
    if all(exact(t) for t in thresholds):
        return "decided"
    if tolerance > 0 and hi <= lo * (1 + tolerance) and all(exact(t) for t in thresholds if t < lo):
        return "tight"
    return None


def as_tight_as_the_full_budget(bound: TimingBound, k: int) -> bool:
    """The aggregate check, tightened for a pairing of m < k batches. Work a forger's calls leave running is done
    in its next batch, where the aggregate check sees it, except after the last batch: a forger that moves all
    of each batch's work into the next shows (m - 1)/m of its real time t in the aggregate, and passes it while
    t (m - 1)/m <= r + X (r reported, X the aggregate's allowance). So m batches let it look m/(m - 1) times
    faster than it is where k batches let it look k/(k - 1) times: a stop needs the aggregate to hold with
    (r + X) scaled by k (m - 1) / ((k - 1) m), and then fewer batches allow no more than the full budget does."""
    m = len(bound.batches)
    if m >= k or m < 2:
        return m >= k
    calls = sum(b.calls for b in bound.batches)
    r = sum(b.reported_mean_ms * b.calls for b in bound.batches) / calls
    allowed = bound.implied_ms - r - bound.aggregate_excess_ms  # X, as timing_bound.check computed it
    return bound.implied_ms <= (r + allowed) * k * (m - 1) / ((k - 1) * m)


def guaranteed_rounds(cfg: ProfileConfig) -> int:
    """Rounds every timing runs: min_rounds, at least a majority of timing_batches, at most all of them."""
    k = cfg.timing_batches
    return min(k, max(cfg.min_rounds, k // 2 + 1))


@dataclass
class StopRule:
    """Checked by paired.pair after each round, in the judge's process, from the batches so far."""

    min_rounds: int
    max_rounds: int
    bands: list[Band]
    tolerance: float
    baseline: BaselineTimes
    max_spread: float
    max_drift: float
    bound: Callable[[dict], TimingBound]  # the timing bound over a pairing's batches so far
    cfg: ProfileConfig
    drift: bool = True  # paired.drift_counts
    local: bool = False  # paired.spread_is_local

    def check(self, e: timing_bound.Run, c: timing_bound.Run) -> str | None:
        if len(c.batches) < self.min_rounds:
            return None
        if e.short() or c.short():
            return "short"  # this round is timed again from scratch anyway (timing_bound.Run.short)
        now = {"eager": {"median_ms": timing_bound.summarize(e.times)["median_ms"], "batches": e.batches,
                         "round_trip_ms": e.a},
               "candidate": {"batches": c.batches, "round_trip_ms": c.a}}
        # a stopped pairing is judged on exactly these batches: the bound must already hold on them (more
        # batches only give an honest candidate on a loaded machine more chances of a quiet one), and its
        # aggregate as tightly as over the full budget
        bound = self.bound(now)
        if not bound.ok or not as_tight_as_the_full_budget(bound, self.max_rounds):
            return None
        if self.local:
            # disturbed rounds are left out (paired.kept_rounds); the kept ones decide once they are a majority of
            # the budget, which is then a majority of whatever the full budget would have kept
            rounds = paired.rounds(e.batches, c.batches, self.max_spread)
            kept = paired.kept_rounds(rounds)
            if len(kept) + self.max_rounds - len(rounds) < self.min_rounds:
                return "noisy"  # too few rounds left to reach the undisturbed ones a speedup needs
            if len(kept) < self.min_rounds:
                return None
        elif paired.eager_spread(e.batches) > self.max_spread:
            return "noisy"  # the spread only grows with more batches: this pairing is noisy whatever follows
        else:
            kept = paired.rounds(e.batches, c.batches)
        if paired.noise(now, self.baseline, self.max_spread, self.max_drift, self.drift, self.local,
                        min_kept=self.min_rounds if self.local else None) is not None:
            return None  # eager slower than its baseline so far: later rounds may bring it back
        if paired.retimes_baseline(now["eager"]["median_ms"], self.baseline, self.cfg):
            return None  # the baseline will be measured again, and the thresholds may move with it
        return decide([r.speedup for r in kept], self.bands, self.tolerance, self.max_rounds,
                      self.cfg.reward.speedup_confidence)


def stop_rule(b: BaselineTimes, cfg: ProfileConfig, backend: str) -> StopRule | None:
    """The rule for a profile's first pairing against baseline `b` (None: early_stop off). Its bound is the
    one the first pairing is judged by (paired.first_bound), so a stopped pairing passes the same check."""
    if not cfg.early_stop:
        return None
    ratio, ratio_range = baseline.compile_ratio(b)
    bands = milestone_bands(cfg.reward, is_launch_bound(b.eager, cfg), ratio, ratio_range)
    return StopRule(min_rounds=guaranteed_rounds(cfg), max_rounds=cfg.timing_batches, bands=bands, tolerance=cfg.stop_tolerance, baseline=b,
                    max_spread=cfg.noise_max_spread, max_drift=cfg.baseline_max_drift,
                    bound=lambda run: paired.first_bound(run, b, backend), cfg=cfg,
                    drift=paired.drift_counts(b, cfg, backend), local=paired.spread_is_local(backend))
