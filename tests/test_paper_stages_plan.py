"""bench.proofs.stages' planning, without running a stage: it refuses at once when a stage it is about to run
cannot import what it needs (before the SFT and the stages ahead of it spend minutes of a device call only to fail
there), and it runs the two final PPO runs a step at a time in turn, so both curves get as many points."""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("transformers", reason="the train extra is not installed")

from bench.proofs import stages as paper_stages  # noqa: E402


def _hide(monkeypatch, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, **k: None if n in names else real(n, *a, **k))


def test_missing_modules_names_only_what_the_stages_to_run_need(monkeypatch):
    _hide(monkeypatch, "trl")
    assert paper_stages.missing_modules(["warmup", "rollouts", "rft"]) == ["trl"]
    assert paper_stages.missing_modules(["warmup", "rollouts", "critic", "ppo"]) == []


def test_a_run_whose_rft_stage_cannot_import_trl_stops_before_any_stage(monkeypatch, tmp_path):
    _hide(monkeypatch, "trl")
    out = tmp_path / "stages"
    monkeypatch.setattr(sys, "argv", ["stages.py", "--out", str(out), "--device", "cpu", "--backend", "cpu",
                                      "--tasks", "1", "--stages", "warmup,rollouts,rft"])
    with pytest.raises(SystemExit) as e:
        paper_stages.main()
    assert "rft" in str(e.value.code) and "trl" in str(e.value.code)
    # nothing was made: no tasks, no tiny model, no demonstrations, no SFT
    assert not out.exists() or not any(out.iterdir())


class _Runs:
    """Scripted PPO runs: each step costs `cost[name]` seconds of a clock that `left` reads."""

    def __init__(self, budget: float, cost: dict[str, float], done: dict[str, int] | None = None,
                 stuck: str | None = None):
        self.budget, self.cost, self.stuck = budget, cost, stuck
        self.steps = dict(done or {n: 0 for n in cost})
        self.calls: list[tuple[str, int]] = []

    def left(self) -> float:
        return self.budget

    def run_to(self, name: str, k: int) -> None:
        self.calls.append((name, k))
        self.budget -= self.cost[name]
        if name != self.stuck:
            self.steps[name] = k


def test_the_two_runs_take_steps_in_turn_whatever_a_step_costs():
    # the first run's first step is the dear one (a fresh machine's first builds and baselines): before, it got
    # half the time and spent it on one step while the other made two
    r = _Runs(1000.0, {"ppo": 140.0, "fresh": 85.0})
    ran = paper_stages.alternate(["ppo", "fresh"], r.steps.get, 3, r.run_to, r.left)
    assert ran == r.calls == [("ppo", 1), ("fresh", 1), ("ppo", 2), ("fresh", 2), ("ppo", 3), ("fresh", 3)]


def test_no_step_starts_when_the_time_left_is_under_the_longest_step():
    r = _Runs(400.0, {"ppo": 140.0, "fresh": 85.0})
    ran = paper_stages.alternate(["ppo", "fresh"], r.steps.get, 4, r.run_to, r.left)
    # 400 - 140 - 85 = 175 left > 140: a second ppo step; then 35 left < 140: none
    assert ran == [("ppo", 1), ("fresh", 1), ("ppo", 2)]


def test_a_resumed_comparison_evens_the_runs_first():
    r = _Runs(1000.0, {"ppo": 10.0, "fresh": 10.0}, done={"ppo": 2, "fresh": 1})
    ran = paper_stages.alternate(["ppo", "fresh"], r.steps.get, 3, r.run_to, r.left)
    assert ran == [("fresh", 2), ("ppo", 3), ("fresh", 3)]


def test_a_run_that_makes_no_progress_ends_the_alternation():
    r = _Runs(1000.0, {"ppo": 10.0, "fresh": 10.0}, stuck="fresh")
    ran = paper_stages.alternate(["ppo", "fresh"], r.steps.get, 3, r.run_to, r.left)
    assert ran == [("ppo", 1)] and r.calls == [("ppo", 1), ("fresh", 1)]
