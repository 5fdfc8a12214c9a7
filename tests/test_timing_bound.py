"""The judge's timing bound as arithmetic: calibration, the per-batch and aggregate checks, batch sizing."""

from __future__ import annotations

import math

from sandbox.config import ProfileConfig
from sandbox.timing.baseline import timing_cfg
from sandbox.timing.timing_bound import batch_calls, calibrate, check

A = 0.2  # ms, an empty round trip


def batch(calls: int, real_ms: float, overhead_ms: float, reported_ms: float, spike_ms: float = 0.0) -> dict:
    return {"calls": calls, "wall_ms": A + calls * (real_ms + overhead_ms) + spike_ms, "reported_mean_ms": reported_ms}


def test_calibration_recovers_the_harness_overhead_from_the_quietest_batch():
    eager = [batch(1000, 0.01, 0.004, 0.01, spike) for spike in (3.0, 0.0, 1.5)]
    assert abs(calibrate(eager, A) - 0.004) < 1e-9


def test_honest_passes_even_when_all_but_one_batch_is_hit_by_a_spike():
    b = [batch(500, 0.02, 0.004, 0.02, 5.0)] * 4 + [batch(500, 0.02, 0.004, 0.02)]
    got = check(b, A, 0.004, "cpu")
    assert got["ok"] and got["batch_excess_ms"] < 0
    assert got["max_forgery_factor"] is not None and 1.1 < got["max_forgery_factor"] < 2


def test_divided_reports_are_refused_and_the_boundary_matches_the_stated_factor():
    honest = [batch(500, 0.02, 0.004, 0.02)] * 5
    factor = check(honest, A, 0.004, "cpu")["max_forgery_factor"]
    for divisor, ok in ((20.0, False), (2.0, False), (factor * 1.02, False), (factor * 0.98, True)):
        forged = [batch(500, 0.02, 0.004, 0.02 / divisor)] * 5
        assert check(forged, A, 0.004, "cpu")["ok"] is ok, divisor


def test_work_deferred_out_of_one_batch_fails_the_aggregate():
    # batch 0 returns at once (its calls' work finished later, in batch 1); reports claim 4x faster
    b = [batch(500, 0.0, 0.004, 0.005), batch(500, 0.04, 0.004, 0.005)] + [batch(500, 0.02, 0.004, 0.005)] * 3
    got = check(b, A, 0.004, "cpu")
    assert got["batch_excess_ms"] <= 0  # the emptied batch alone looks consistent
    assert not got["ok"] and got["aggregate_excess_ms"] > 0


def test_batches_hold_enough_work_for_the_round_trip_to_be_noise():
    cfg = timing_cfg(ProfileConfig())
    assert batch_calls(0.001, cfg) == cfg["max_batch_calls"]
    assert batch_calls(0.5, cfg) * 0.5 >= cfg["min_batch_ms"]
    assert batch_calls(1000.0, cfg) >= 1


def test_the_budget_counts_each_calls_input_draw_on_large_inputs_only():
    """target_ms is the device's time: a 2 ms call whose large inputs take 3 ms to draw gets half the calls it got by
    its own time, while a small kernel (where min_batch_ms sets the count) and a call with cheap draws keep theirs."""
    cfg = timing_cfg(ProfileConfig())
    k = cfg["timing_batches"]
    assert batch_calls(2.0, cfg) == math.ceil(cfg["max_trials"] / k) == 20
    assert batch_calls(2.0, cfg, draw_ms=3.0) == math.ceil(cfg["target_ms"] / k / 5.0) == 10
    assert batch_calls(2.0, cfg, draw_ms=0.05) == 20
    assert batch_calls(0.02, cfg, draw_ms=0.8) == batch_calls(0.02, cfg) == math.ceil(cfg["min_batch_ms"] / 0.02)
    assert batch_calls(400.0, cfg, draw_ms=400.0) >= math.ceil(cfg["min_trials"] / k)
