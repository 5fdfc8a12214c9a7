"""bench/paper_stages.py refuses at once when a stage it is about to run cannot import what it needs, before the
SFT and the stages ahead of it spend minutes (on the GPU, a device call) only to fail there."""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("transformers", reason="the train extra is not installed")

from bench import paper_stages  # noqa: E402


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
    monkeypatch.setattr(sys, "argv", ["paper_stages.py", "--out", str(out), "--device", "cpu", "--backend", "cpu",
                                      "--tasks", "1", "--stages", "warmup,rollouts,rft"])
    with pytest.raises(SystemExit) as e:
        paper_stages.main()
    assert "rft" in str(e.value.code) and "trl" in str(e.value.code)
    # nothing was made: no tasks, no tiny model, no demonstrations, no SFT
    assert not out.exists() or not any(out.iterdir())
