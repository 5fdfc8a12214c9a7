"""The training set: the judge's self-check gate, the resumable build, its report, card and task ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from synth.filter import FilterConfig
from synth.manifest import read_rows

ROOT = Path(__file__).resolve().parent.parent

_TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return {body}


def get_inputs():
    return [torch.randn({n}, {n}), torch.randn({n}, {n})]


def get_init_inputs():
    return []
"""


def test_gate_keeps_only_what_the_judge_can_judge(tmp_path: Path):
    """A task the judge times in band passes; a nondeterministic reference and one too fast for the band do not,
    each with its reason, and nothing dropped reaches the output folder."""
    from synth.stages import selfcheck_stage

    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "good.py").write_text(_TASK.format(body="torch.relu(x @ y) @ y", n=384))
    (inp / "noisy.py").write_text(_TASK.format(body="torch.relu(x @ y) + torch.rand_like(x)", n=384))
    (inp / "fast.py").write_text(_TASK.format(body="x + y", n=2))
    cfg = FilterConfig(backend="cpu", band_ms=(0.05, 10_000.0), jobs=2)
    summary = selfcheck_stage(inp, tmp_path / "out", cfg, progress=False)
    rows = {r["id"]: r for r in read_rows(tmp_path / "out")}
    assert rows["good"]["status"] == "kept", rows["good"]
    assert rows["good"]["metrics"]["judge_eager_ms"] >= 0.05
    assert rows["noisy"]["status"] == "dropped" and rows["noisy"]["reason"] == "selfcheck_nondeterministic_reference"
    assert rows["fast"]["status"] == "dropped" and rows["fast"]["reason"] == "selfcheck_time_band", rows["fast"]
    assert rows["fast"]["metrics"]["judge_eager_ms"] < 0.05
    assert summary["kept"] == 1 and summary["pending"] == 0
    assert summary["reasons"] == {"selfcheck_nondeterministic_reference": 1, "selfcheck_time_band": 1}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.py")) == ["good.py"]


def _fake_build(root: Path) -> Path:
    """A finished build's last folder, written by hand: the card and ids need no pipeline run."""
    code = (ROOT / "tasks" / "examples").glob("*.py")
    src = next(iter(sorted(code))).read_text()
    last = root / "5-selfcheck"
    last.mkdir(parents=True)
    rows = [{"id": "fused_a", "file": "fused_a.py", "status": "kept", "ops": ["torch.nn.GELU", "torch.matmul"],
             "libraries": ["torch"], "metrics": {"eager_ms": 9.0, "judge_eager_ms": 4.0},
             "nearest": {"problem": "kernelbench/level1/26_GELU_", "score": 0.3}},
            {"id": "fused_b", "file": "fused_b.py", "status": "kept",
             "ops": ["transformers.activations.NewGELUActivation", "torch.add", "torch.tanh"],
             "libraries": ["torch", "transformers"], "metrics": {"judge_eager_ms": 40.0},
             "nearest": {"problem": "kernelbench/level1/88_MinGPTNewGelu", "score": 0.6}},
            {"id": "fused_c", "status": "dropped", "reason": "selfcheck_time_band", "ops": []}]
    with open(last / "manifest.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            if r["status"] == "kept":
                (last / r["file"]).write_text(src)
    (root / "timings.json").write_text(json.dumps({"selfcheck": {"seconds": 30.0, "decided": 3, "runs": 2}}))
    return root


def test_card_report_and_synth_task_ids(tmp_path: Path, monkeypatch):
    from synth.dataset import write_dataset
    from tasks import TaskError
    from tasks.loader import list_tasks, load_task

    build = _fake_build(tmp_path / "b")
    monkeypatch.setitem(sys.modules, "datasets", None)  # the device: no datasets package
    exp = write_dataset(build, "cuda", (1.0, 100.0), 0.8)
    folder = build / "dataset"
    assert exp["rows"] == 2 and not exp["arrow"] and "synth card" in exp["note"]
    assert not (folder / "dataset_info.json").exists()
    rep = json.loads((folder / "report.json").read_text())
    assert rep["tasks"] == 2 and rep["eager_ms"]["all_in_band"] is True
    assert rep["eager_ms"]["quantiles"]["p0"] == 4.0 and rep["eager_ms"]["quantiles"]["p100"] == 40.0
    assert rep["fusion_depth"] == {"2": 1, "3": 1}
    assert rep["operators"]["by_library"]["transformers"] == {"distinct": 1, "uses": 1}
    assert rep["operators"]["by_library"]["torch"] == {"distinct": 4, "uses": 4}
    assert rep["nearest_kernelbench"]["quantiles"]["p100"] == 0.6
    assert rep["stages"][0]["stage"] == "selfcheck" and rep["stages"][0]["tasks_per_min"] == 6.0
    assert rep["stages"][0]["reasons"] == {"selfcheck_time_band": 1}

    card = (folder / "README.md").read_text()
    header = card.split("---\n")[1]
    for field in ("license: apache-2.0", "task_categories:", "size_categories:\n- n<1K", "configs:",
                  "path: tasks.jsonl"):
        assert field in header, field
    for section in ("## How it was made", "## Decontamination", "## Self-check", "## License", "## Statistics"):
        assert section in card, section
    assert "0.8 or more" in card and "1-100 ms" in card

    # the project's ids: synth:FOLDER/TASK_ID, from the JSON lines (no datasets needed)
    t = load_task(f"synth:{folder}/fused_b")
    assert t.id == f"synth:{folder}/fused_b" and t.source == (build / "5-selfcheck" / "fused_b.py").read_text()
    assert [x.name for x in list_tasks(str(folder))] == ["fused_a", "fused_b"]
    assert load_task(f"synth:{build / '5-selfcheck'}/fused_a").path is not None
    with pytest.raises(TaskError, match="unknown synthesized task"):
        load_task(f"synth:{folder}/fused_c")

    # converted later where datasets is installed: load_from_disk round trip
    # the datasets module this process had (if any) back: deleting the entry instead would import the package a
    # second time beside its cached submodules, and later fingerprints in the same process fail
    monkeypatch.undo()
    datasets = pytest.importorskip("datasets")
    exp = write_dataset(build, "cuda", (1.0, 100.0), 0.8)
    assert exp["arrow"] and (folder / "README.md").is_file()
    ds = datasets.load_from_disk(str(folder))
    assert ds["task_id"] == ["fused_a", "fused_b"] and ds["fusion_depth"] == [2, 3]
    assert ds["eager_ms"] == [4.0, 40.0] and ds["score"] == [0.3, 0.6]
    assert ds[1]["code"] == t.source and ds[1]["nearest_kernelbench"] == "kernelbench/level1/88_MinGPTNewGelu"
    jsonl = datasets.load_dataset("json", data_files=str(folder / "tasks.jsonl"), split="train")
    assert jsonl["task_id"] == ["fused_a", "fused_b"]


@pytest.mark.slow
def test_build_interrupted_then_resumed(tmp_path: Path, small_kernelbench: Path):
    """A build cut by its time limit, then resumed: every task decided once, the set gated, carded, loadable."""
    datasets = pytest.importorskip("datasets")
    from sandbox.api import init_workspace
    from sandbox.correctness.selfcheck import self_verify
    from tasks.loader import load_task

    out = tmp_path / "build"
    cmd = [sys.executable, "-m", "cuda_agent", "synth", "build", "--out", str(out), "--count", "4", "--seed", "3",
           "--max-ops", "3", "--jobs", "2", "--kernelbench", str(small_kernelbench), "--json"]
    first = subprocess.run(cmd + ["--time-limit", "20"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["complete"] is False
    assert not (out / "dataset").exists()
    p = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    assert summary["complete"] is True
    assert [s["stage"] for s in summary["stages"]] == ["crawl", "compose", "filter", "decontaminate", "selfcheck"]
    timings = json.loads((out / "timings.json").read_text())
    for folder in ("2-compose", "3-filter", "4-decontaminate", "5-selfcheck"):
        ids = [r["id"] for r in read_rows(out / folder)]
        assert len(ids) == len(set(ids)), folder  # no task recorded twice
        assert timings[folder.split("-", 1)[1]]["decided"] == len(ids), folder  # nor decided twice
    gate = summary["stages"][4]
    assert gate["seen"] == summary["stages"][3]["kept"]
    kept = gate["kept"]
    assert kept >= 1, summary
    ds = datasets.load_from_disk(summary["export"]["dataset"])
    assert len(ds) == kept == summary["report"]["tasks"]
    assert summary["report"]["eager_ms"]["all_in_band"]
    for i, row in enumerate(ds):  # every task is usable as it is
        task = load_task(f"synth:{summary['export']['dataset']}/{row['task_id']}")
        assert task.source == row["code"] and row["fusion_depth"] == len(row["ops"])
        assert init_workspace(task, tmp_path / f"ws{i}", backend="cpu")[1].ok
    assert self_verify(load_task(f"synth:{summary['export']['dataset']}/{ds[0]['task_id']}"), "cpu").ok
    # resuming a finished build decides nothing again
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert again.returncode == 0 and json.loads(again.stdout)["report"]["tasks"] == kept
    assert json.loads((out / "timings.json").read_text())["filter"]["decided"] == timings["filter"]["decided"]
