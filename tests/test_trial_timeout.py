"""Hangs cost seconds, not minutes, on tasks that take milliseconds: verify's candidate timeout follows the
reference's time on each input set (sandbox/correctness/trial_timeout.py), within a floor and the trial timeout."""

from __future__ import annotations

import pytest

from conftest import set_variant
from sandbox.api import verify_workspace
from sandbox.config import VerifyConfig
from sandbox.correctness.trial_timeout import TrialClock, relative_timeout


@pytest.mark.parametrize("reference_s, expected", [
    (0.002, (10.0, "floor")),  # 100 x 2 ms is 0.2 s: a cold first call gets the floor
    (0.5, (50.0, "relative")),  # 100 x the reference
    (2.0, (120.0, "cap")),  # 200 s is past the trial timeout: the trial timeout bounds it
    (None, (120.0, "cap")),  # no reference time yet
])
def test_the_rule_is_max_of_floor_and_factor_times_the_reference_capped_by_the_trial_timeout(reference_s, expected):
    assert relative_timeout(reference_s, cap_s=120.0, floor_s=10.0, factor=100.0) == expected


def test_a_factor_of_zero_turns_the_rule_off_and_a_low_cap_still_bounds_the_floor():
    assert relative_timeout(0.001, cap_s=120.0, floor_s=10.0, factor=0.0) == (120.0, "cap")
    assert relative_timeout(0.001, cap_s=3.0, floor_s=10.0, factor=100.0) == (3.0, "cap")  # --trial-timeout 3


def test_the_slowest_input_set_so_far_sets_it_and_the_result_says_which_rule():
    clock = TrialClock(VerifyConfig())
    assert clock.reference_took({"elapsed_s": 0.3}) == 30.0 and clock.rule == "relative"
    assert clock.reference_took({"elapsed_s": 0.01}) == 30.0  # a faster set does not shorten it
    assert clock.reference_took({}) == 30.0  # a reply without a time keeps it
    rec = clock.record()
    assert (rec.seconds, rec.rule, rec.reference_s, rec.cap_s) == (30.0, "relative", 0.3, 120.0)
    assert "100x the reference's 0.3 s" in clock.explain()


def test_a_hang_on_a_tiny_task_fails_after_the_floor_not_the_trial_timeout(cpu_ws):
    set_variant(cpu_ws.root, "spin_forever")
    r = verify_workspace(cpu_ws, VerifyConfig(trials=1, trial_timeout_floor_s=2.0))  # trial_timeout_s: 120 s
    assert not r.ok and r.reason == "timeout", r.message
    assert r.trial_timeout is not None and r.trial_timeout.rule == "floor" and r.trial_timeout.seconds == 2.0
    assert r.trial_timeout.cap_s == 120.0
    assert "within 2 s" in r.message and "the floor of 2 s" in r.message, r.message
    # the trials, past the set-up (process starts, imports: seconds on a loaded machine): about the floor
    assert r.duration_s - r.phases["setup"] < 30, r.phases


def test_an_honest_kernel_is_given_factor_times_the_reference(cpu_ws):
    set_variant(cpu_ws.root, "correct")
    cfg = VerifyConfig(trials=2, trial_timeout_floor_s=0.001, trial_timeout_factor=5000.0)
    r = verify_workspace(cpu_ws, cfg)
    assert r.ok, r.message
    t = r.trial_timeout
    assert t.rule == "relative" and t.seconds == pytest.approx(5000.0 * t.reference_s), t
