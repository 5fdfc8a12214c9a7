"""The harness's final judging on the CPU: a solution honest only while verified is profiled by the judge
even though the (replay) policy never called profile, and its episode ends failed with the reason, in the
episode record, the eval report and the exported training rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.export import sft_rows
from harness.trajectory import latest_records

pytest.importorskip("matplotlib", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
EXPLOITS = REPO / "tests" / "exploits"
sys.path.insert(0, str(EXPLOITS))
from catalogue import EXPLOITS as CATALOGUE  # noqa: E402
from catalogue import task_source  # noqa: E402


def test_final_judging_profiles_and_fails_the_counter_replay(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "relu01.py").write_text(task_source("relu01"))
    sol = tmp_path / "solutions" / "relu01"
    shutil.copytree(EXPLOITS / "kernels", sol / "kernels")
    (sol / "model_new.py").write_text(next(e[3] for e in CATALOGUE if e[0] == "counter_replay"))
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "harness", "eval", "--solutions", str(sol.parent), "--tasks", str(suite),
           "--out", str(out), "--backend", "cpu", "--verify-trials", "2", "--no-plots", "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-4000:]

    rec = latest_records(out / "episodes.jsonl")["suite/relu01#0"]
    j = rec.judgment
    assert j.verify.ok and j.profile is not None and j.profile.reason == "spot_check_failed"
    assert not any(c.name == "profile" for t in rec.turns for c in t.tool_calls)  # the policy never profiled
    assert (j.reward.reward, j.reward.milestone, j.reward.reason) == (-1.0, "failed", "spot_check_failed")
    assert j.settings["profiled"] is True

    report = json.loads((out / "report.json").read_text())
    row = report["problems"][0]
    assert (row["correct"], row["milestone"], row["reason"]) == (False, "failed", "spot_check_failed")
    assert report["overall"]["pass_rate"] == 0
    assert "failed (spot_check_failed)" in (out / "report.md").read_text()

    assert sft_rows([rec])[0]["reason"] == "spot_check_failed" and sft_rows([rec])[0]["reward"] == -1.0
