"""bench.fidelity: the comparison with KernelBench's table on made-up numbers, and a real CPU smoke run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fidelity", REPO / "bench" / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


def _write_table(folder: Path, rows: dict[tuple[str, str], tuple[float, float]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("baseline_time_torch.json", "baseline_time_torch_compile_inductor_default.json")):
        data: dict = {}
        for (level, problem), times in rows.items():
            data.setdefault(level, {})[problem] = {"mean": times[i], "std": 0.01, "min": times[i], "max": times[i],
                                                   "num_trials": 100, "hardware": "NVIDIA H100 80GB HBM3",
                                                   "device": "cuda:0"}
        (folder / name).write_text(json.dumps(data))


def _row(level, problem, eager, compile_, **kw):
    return {"level": level, "problem": problem, "eager_ms": eager, "compile_ms": compile_,
            "torch_version": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3", **kw}


def test_compare_shares_medians_and_outliers(tmp_path):
    _write_table(tmp_path / "table", {("level1", "1_A.py"): (1.0, 1.0), ("level1", "2_B.py"): (2.0, 1.0),
                                      ("level1", "3_C.py"): (4.0, 2.0), ("level2", "1_D.py"): (0.05, 0.2),
                                      ("level2", "2_E.py"): (3.0, 3.0)})
    results = tmp_path / "results.jsonl"
    lines = [_row("level1", "1_A.py", 9.0, 9.0),  # superseded by the later line for the same task
             _row("level1", "1_A.py", 1.1, 1.0),  # +10%, 0%
             _row("level1", "2_B.py", 2.5, 1.2),  # +25%, +20%
             _row("level1", "3_C.py", 2.0, 1.0),  # -50%, -50%: outliers, compile gain the same as theirs
             _row("level2", "1_D.py", 0.02, 0.2),  # launch-bound, -60% eager
             {"level": "level2", "problem": "2_E.py", "error": "the reference ran out of memory"},
             _row("level3", "9_Z.py", 1.0, 1.0)]  # not in the table
    results.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"level\": \"lev")  # a write cut short
    rep = fidelity.compare(fidelity.load_results(results), fidelity.load_table(tmp_path / "table"))
    eager = rep["summary"]["eager"]
    assert eager["n"] == 4 and eager["within_15"] == 0.25 and eager["within_30"] == 0.5
    assert eager["levels"]["level1"]["median_ratio"] == pytest.approx(1.1)
    assert rep["summary"]["compile"]["levels"]["level1"]["within_15"] == pytest.approx(1 / 3)
    bad = {(o["task"], o["mode"]): o for o in rep["outliers"]}
    assert set(bad) == {("level1/3_C.py", "eager"), ("level1/3_C.py", "compile"), ("level2/1_D.py", "eager")}
    assert "torch 2.11.0+cu130 here vs 2.5.0+cu124" in bad[("level1/3_C.py", "eager")]["reason"]
    assert "launch-bound" in bad[("level2/1_D.py", "eager")]["reason"]
    assert "gain over eager" not in bad[("level1/3_C.py", "compile")]["reason"]
    assert rep["failed"][0]["task"] == "level2/2_E.py" and rep["not_in_table"] == ["level3/9_Z.py"]
    text = fidelity.render(rep)
    assert "| eager | all | 4 | 25% | 50% |" in text and "level1/3_C.py" in text


TINY = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.{op}(x) * 2


def get_inputs():
    return [torch.randn(16, 32)]


def get_init_inputs():
    return []
"""


@pytest.mark.full  # a benchmark's smoke run; its comparison: test_compare_shares_medians_and_outliers
@pytest.mark.slow
def test_cpu_smoke_run_is_resumable(tmp_path):
    root = tmp_path / "kb"
    (root / "level1").mkdir(parents=True)
    for name, op in (("1_Tanh.py", "tanh"), ("2_Relu.py", "relu"), ("3_Sigmoid.py", "sigmoid")):
        (root / "level1" / name).write_text(TINY.replace("{op}", op))
    _write_table(root / "timing" / "H100_Modal", {("level1", "1_Tanh.py"): (0.5, 0.4), ("level1", "2_Relu.py"):
                                                  (0.5, 0.4), ("level1", "3_Sigmoid.py"): (0.5, 0.4)})
    results = tmp_path / "fid.jsonl"
    cmd = [sys.executable, "-m", "bench.fidelity", "--device", "cpu", "--sample", "2", "--levels",
           "level1", "--root", str(root), "--results", str(results), "--target-ms", "20", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=os.environ.copy(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert len(rows) == 2 and all(x["eager_ms"] > 0 and x["compile_ms"] > 0 for x in rows), rows
    assert json.loads(r.stdout)["summary"]["eager"]["n"] == 2
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert again.returncode == 0 and "0 tasks to time" in again.stderr
    assert len(results.read_text().splitlines()) == 2
