"""`eval --solutions` on a GPU: hand-written CUDA solutions for KernelBench level-1 problems (workspace
form: .cu + _binding.cpp + model_new.py) and one KernelBench-style load_inline file, judged on the
real device, with the report's metrics, device and timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.trajectory import latest_records

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "tests" / "fixtures" / "harness" / "solutions"


@pytest.mark.gpu
def test_eval_cuda_solutions_on_kernelbench_level1(tmp_path, real_kernelbench):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "harness", "eval", "--solutions", str(SOLUTIONS),
           "--tasks", "kernelbench:level1:19-21,23", "--backend", "cuda", "--out", str(out), "-q",
           # these problems move 6 GB tensors: two verifies sharing one GPU could run out of memory
           "--concurrency", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3000,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    rows = {p["task_id"].rsplit("/", 1)[-1]: p for p in report["problems"]}
    assert set(rows) == {"19_ReLU", "20_LeakyReLU", "21_Sigmoid", "23_Softmax"}
    records = latest_records(out / "episodes.jsonl")
    for name, row in rows.items():
        rec = records[f"kernelbench/level1/{name}#0"]
        j = rec.judgment
        detail = j.compile.message if not j.compile.ok else (j.verify.message if j.verify else j.error)
        assert row["correct"], f"{name}: {row['reason']}: {detail}"
        assert row["speedup_vs_eager"] and row["speedup_vs_eager"] > 0.1, row
        assert row["candidate_ms"] > 0 and row["eager_ms"] > 0
    assert report["overall"]["pass_rate"] == 1.0 and report["levels"]["level1"]["problems"] == 4
    assert report["judge"]["backends"] == {"cuda": 4}
    device = report["judge"]["device"] or ""
    assert device and not device.startswith("cpu"), device
    # the load_inline file was converted and judged like any workspace
    leaky = records["kernelbench/level1/20_LeakyReLU#0"]
    paths = [c.arguments["path"] for t in leaky.turns for c in t.tool_calls]
    assert "kernels/leaky_relu.cu" in paths and "kernels/leaky_relu_binding.cpp" in paths
    assert (out / "plots" / "fast_p.png").is_file()
