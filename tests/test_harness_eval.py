"""`eval --solutions` on the CPU: a workspace-form solution, a KernelBench-style load_inline file and a
task without a solution, scored by the same judge through the command line, with the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.trajectory import latest_records

pytest.importorskip("matplotlib", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "harness"


@pytest.mark.full  # two builds and torch.compile baselines in a subprocess; eval's report: test_harness_report.py, the judge on honest solutions: tests/exploits
def test_eval_scores_existing_solutions(tmp_path, small_task_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("folder_form", "inline_form", "unsolved"):
        shutil.copy(small_task_path, suite / f"{name}.py")
    sols = tmp_path / "solutions"
    sols.mkdir()
    shutil.copytree(REPO / "tasks" / "examples" / "solutions" / "swish_bias", sols / "folder_form")  # cpu/ and cuda/
    shutil.copy(FIXTURES / "inline_cpu" / "swish_bias_inline.py", sols / "inline_form.py")
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "harness", "eval", "--solutions", str(sols), "--tasks", str(suite), "--out", str(out),
           "--backend", "cpu", "--concurrency", "3", "--verify-trials", "2", "--thresholds", "0,0.5,1", "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, r.stderr[-4000:]
    overall = json.loads(r.stdout)
    assert overall["problems"] == 3 and overall["correct"] == 2

    report = json.loads((out / "report.json").read_text())
    rows = {p["task_id"]: p for p in report["problems"]}
    assert rows["suite/folder_form"]["correct"] and rows["suite/inline_form"]["correct"]
    assert rows["suite/unsolved"]["reason"] == "compile_error"
    # a profile on a loaded 2-core machine may find eager's rounds too far apart to score (timing_noisy): the
    # solution is still correct, with no speedup, and then does not count in fast_p
    scored = [t for t in ("suite/folder_form", "suite/inline_form") if rows[t]["profile_reason"] != "timing_noisy"]
    for t in ("suite/folder_form", "suite/inline_form"):  # untimed says why; a timed row has no reason
        assert (rows[t]["speedup_vs_eager"] is None) == (rows[t]["profile_reason"] is not None), rows[t]
    for task in scored:
        assert rows[task]["speedup_vs_eager"] > 0 and rows[task]["candidate_ms"] > 0
    if len(scored) == 2:
        assert report["overall"]["fast_p_eager"]["0"] == report["overall"]["pass_rate"]
    assert set(report["overall"]["fast_p_compile"]) == {"0", "0.5", "1"}
    assert report["policy"]["provider"] == "replay"
    assert report["judge"]["torch_version"] and report["judge"]["compile_mode"] == "default"
    assert (out / "report.md").read_text().startswith("# Evaluation report")
    assert (out / "plots" / "fast_p.png").is_file() and (out / "plots" / "speedups.png").is_file()

    records = latest_records(out / "episodes.jsonl")
    inline = records["suite/inline_form#0"]
    written = [c.arguments["path"] for t in inline.turns for c in t.tool_calls]
    # converted to workspace form: the judge sees kernels/ and a model_new.py without load_inline
    assert written == ["kernels/swish_bias_inline_binding.cpp", "model_new.py"]
    assert "load-inline" in inline.messages[2]["content"]
    # replayed solutions are not compiled or verified twice: only the judge runs them
    assert len(inline.turns) == 2 and inline.judgment.verify.ok
    assert "No solution" in records["suite/unsolved#0"].messages[-1]["content"]
