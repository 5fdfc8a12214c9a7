"""The training set: the judge's self-check gate, the resumable build, its report, card and task ids."""

from __future__ import annotations

import json
import os
import shutil
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
    # the band first: far below it, one short measurement decided, and no verification was spent on it
    assert rows["fast"]["metrics"]["judge_timing"] == "quick" and "selfcheck_verify_s" not in rows["fast"]["metrics"]
    # far inside it too, and a task inside the band is verified whichever measurement decided it
    assert rows["good"]["metrics"]["judge_timing"] == "quick" and rows["good"]["metrics"]["selfcheck_verify_s"] > 0
    # where the timing's seconds went: one short measurement each, under the lock, after the reference's set-up
    for name in ("good", "fast"):
        m = rows[name]["metrics"]
        assert m["selfcheck_measurements"] == 1 and m["selfcheck_timing_s"] > 0 and m["selfcheck_setup_s"] > 0, m
        assert m["selfcheck_setup_s"] + m["selfcheck_lock_wait_s"] + m["selfcheck_timing_s"] <= m["selfcheck_time_s"]
    assert summary["kept"] == 1 and summary["pending"] == 0
    assert summary["reasons"] == {"selfcheck_nondeterministic_reference": 1, "selfcheck_time_band": 1}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.py")) == ["good.py"]


def test_only_a_reading_near_an_edge_of_the_band_takes_the_full_measurement(tmp_path: Path):
    """The short measurement decides a reading far outside the band or far inside both edges, and nothing near an
    edge; through the judge, a task far inside is decided by it, and one timed without a band is always timed in
    full."""
    from synth.gate import QUICK_MARGIN, judge_eager_ms, quick_decides

    band = (1.0, 100.0)
    for ms in (0.5, 0.66, 1.5, 10.0, 66.0, 151.0):
        assert quick_decides(ms, band), ms
    for ms in (0.67, 1.0, 1.49, 67.0, 100.0, 149.0):
        assert not quick_decides(ms, band), ms
    assert not any(quick_decides(ms, (1.0, 2.0)) for ms in (0.7, 1.0, 1.4, 2.0, 2.9))  # narrower than 1.5 squared

    task = tmp_path / "good.py"
    task.write_text(_TASK.format(body="torch.relu(x @ y) @ y", n=384))
    stats: dict = {}
    ms, how = judge_eager_ms(str(task), "cpu", stats=stats)
    assert how == "full" and ms > 0 and stats["measurements"] >= 1 and stats["timing_s"] > 0
    wide, how_wide = judge_eager_ms(str(task), "cpu", band=(ms / 20, ms * 20))
    assert how_wide == "quick" and ms / 20 * QUICK_MARGIN <= wide <= ms * 20 / QUICK_MARGIN, (ms, wide)


def test_a_task_the_gate_itself_fails_on_stays_undecided_and_a_broken_gate_stops(tmp_path: Path, monkeypatch):
    """An exception in the gate (not a verdict: the judge's processes, the machine) leaves the task for a resumed
    build instead of dropping it, and the stage says so; after Faults.LIMIT in a row it starts nothing more. The
    exception is raised by hand: on the H100 it was select() refusing descriptor 1024 after ~400 tasks."""
    import synth.gate as gate
    from synth.slots import Faults
    from synth.stages import selfcheck_stage

    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(20):
        (inp / f"t{i:02d}.py").write_text(_TASK.format(body="x + y", n=2))
    seen: list[str] = []
    broken = {"t03"}

    def timed(row: dict, folder, backend, band) -> dict:
        seen.append(row["id"])
        if row["id"] in broken or "*" in broken:
            raise ValueError("filedescriptor out of range in select()")
        return {"status": "timed", "reason": None, "detail": None, "metrics": {"judge_eager_ms": 2.0}}

    def verified(row: dict, folder, backend, metrics: dict, trials: int = 1) -> dict:
        assert metrics == {"judge_eager_ms": 2.0}  # the timing's metrics go on to the verdict
        return {"status": "kept", "reason": None, "detail": None, "metrics": {**metrics, "selfcheck_verify_s": 1.0}}

    monkeypatch.setattr(gate, "time_one", timed)
    monkeypatch.setattr(gate, "verify_one", verified)
    cfg = FilterConfig(backend="cpu", jobs=2)
    summary = selfcheck_stage(inp, tmp_path / "out", cfg, progress=False)
    assert summary["kept"] == 19 and summary["dropped"] == 0 and summary["pending"] == 1
    assert "t03" not in {r["id"] for r in read_rows(tmp_path / "out")}
    assert any("1 tasks left undecided by the gate's own errors" in n and "select()" in n for n in summary["notes"])

    # resumed: the undecided task is tried again, and decided now
    broken.clear()
    seen.clear()
    summary = selfcheck_stage(inp, tmp_path / "out", cfg, resume=True, progress=False)
    assert seen == ["t03"] and summary["pending"] == 0 and summary["kept"] == 20 and summary["notes"] == []

    # a gate that fails every task stops starting them after LIMIT in a row (and the slots already running)
    broken.add("*")
    seen.clear()
    summary = selfcheck_stage(inp, tmp_path / "out2", cfg, progress=False)
    assert Faults.LIMIT <= len(seen) <= Faults.LIMIT + cfg.jobs and summary["pending"] == 20
    assert "stopped after" in summary["notes"][0]


def test_the_gate_times_a_chunk_of_tasks_before_it_verifies_them(tmp_path: Path, monkeypatch):
    """Timings (exclusive on the device) and verifications (shared) are not interleaved: each chunk's tasks are all
    timed, then those in the band verified, so no timing waits for verifications in flight to drain. Only tasks in
    the band are verified, and the chunks follow one another."""
    import threading

    import synth.gate as gate
    from synth.stages import selfcheck_stage

    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(6):
        (inp / f"t{i}.py").write_text(_TASK.format(body="x + y", n=2))
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def timed(row: dict, folder, backend, band) -> dict:
        with lock:
            events.append(("time", row["id"]))
        if row["id"] == "t1":
            return {"status": "dropped", "reason": "selfcheck_time_band", "detail": "fast", "metrics": {}}
        return {"status": "timed", "reason": None, "detail": None, "metrics": {}}

    def verified(row: dict, folder, backend, metrics: dict, trials: int = 1) -> dict:
        with lock:
            events.append(("verify", row["id"]))
        return {"status": "kept", "reason": None, "detail": None, "metrics": {}}

    monkeypatch.setattr(gate, "time_one", timed)
    monkeypatch.setattr(gate, "verify_one", verified)
    monkeypatch.setattr(gate, "CHUNK_SLOTS", 2)  # chunks of 4 with two slots: t0-t3, then t4-t5
    summary = selfcheck_stage(inp, tmp_path / "out", FilterConfig(backend="cpu", jobs=2), progress=False)
    assert summary["kept"] == 5 and summary["dropped"] == 1
    kinds = [k for k, _ in events]
    assert kinds == ["time"] * 4 + ["verify"] * 3 + ["time"] * 2 + ["verify"] * 2, events
    assert {t for k, t in events[:4]} == {"t0", "t1", "t2", "t3"} and ("verify", "t1") not in events


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
    from tasks.synthset import read_split

    build = _fake_build(tmp_path / "b")
    monkeypatch.setitem(sys.modules, "datasets", None)  # the device: no datasets package
    exp = write_dataset(build, "cuda", (1.0, 100.0), 0.8, eval_fraction=0.0)
    folder = build / "dataset"
    assert exp["rows"] == 2 and exp["splits"] == {"train": 2, "eval": 0}
    assert not exp["arrow"] and "synth card" in exp["note"]
    assert not (folder / "dataset_dict.json").exists()
    rep = json.loads((folder / "report.json").read_text())
    assert rep["tasks"] == 2 and rep["eager_ms"]["all_in_band"] is True
    assert rep["splits"]["train"] == 2 and rep["splits"]["eval"] == 0 and rep["splits"]["eval_fraction"] == 0.0
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
                  "split: train\n    path: train.jsonl.gz", "split: eval\n    path: eval.jsonl.gz"):
        assert field in header, field
    for section in ("## Splits", "## How it was made", "## Decontamination", "## Self-check", "## License",
                    "## Statistics"):
        assert section in card, section
    assert "0.8 or more" in card and "1-100 ms" in card and "CPU-built sample" not in card

    # the project's ids: synth:FOLDER/SPLIT/TASK_ID, from the JSON lines (no datasets needed)
    t = load_task(f"synth:{folder}/fused_b")
    assert t.id == f"synth:{folder}/train/fused_b" and t.source == (build / "5-selfcheck" / "fused_b.py").read_text()
    assert load_task(f"synth:{folder}/train/fused_b") == t
    assert [x.name for x in list_tasks(str(folder))] == ["fused_a", "fused_b"]
    assert list_tasks(f"synth:{folder}/eval") == []
    assert load_task(f"synth:{build / '5-selfcheck'}/fused_a").path is not None
    with pytest.raises(TaskError, match="unknown synthesized task"):
        load_task(f"synth:{folder}/fused_c")
    with pytest.raises(TaskError, match="unknown synthesized task"):
        load_task(f"synth:{folder}/eval/fused_a")

    # converted later where datasets is installed: load_from_disk round trip, both splits
    # the datasets module this process had (if any) back: deleting the entry instead would import the package a
    # second time beside its cached submodules, and later fingerprints in the same process fail
    monkeypatch.undo()
    datasets = pytest.importorskip("datasets")
    exp = write_dataset(build, "cpu", (1.0, 100.0), 0.8, eval_fraction=0.5)
    assert exp["arrow"] and "CPU-built sample (2 tasks)" in (folder / "README.md").read_text()
    dd = datasets.load_from_disk(str(folder))
    assert sorted(dd) == ["eval", "train"] and len(dd["train"]) + len(dd["eval"]) == 2
    both = {r["task_id"]: r for s in ("train", "eval") for r in dd[s]}
    assert [both[k]["fusion_depth"] for k in ("fused_a", "fused_b")] == [2, 3]
    assert both["fused_b"]["code"] == t.source and both["fused_b"]["eager_ms"] == 40.0
    assert both["fused_b"]["nearest_kernelbench"] == "kernelbench/level1/88_MinGPTNewGelu"
    for split in ("train", "eval"):
        assert [r["task_id"] for r in dd[split]] == [r["task_id"] for r in read_split(folder, split)]
        assert all(r["split"] == split for r in dd[split])
    jsonl = datasets.load_dataset("json", data_files={s: str(folder / f"{s}.jsonl.gz") for s in ("train", "eval")})
    assert sorted(list(jsonl["train"]["task_id"]) + list(jsonl["eval"]["task_id"])) == ["fused_a", "fused_b"]


def _build(out: Path, kernelbench: Path, cache: Path, *extra: str) -> dict:
    """One `synth build` process, as one device call: its own cache folder stands for a fresh machine's."""
    cmd = [sys.executable, "-m", "cuda_agent", "synth", "build", "--out", str(out), "--count", "3", "--seed", "3",
           "--max-ops", "3", "--jobs", "2", "--no-compile", "--band", "0,1000000", "--eval-fraction", "0.5",
           "--kernelbench", str(kernelbench), "--json", *extra]
    env = {**os.environ, "CUDA_AGENT_CACHE": str(cache)}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def _verdicts(build: Path) -> dict[str, dict[str, tuple]]:
    return {folder: {r["id"]: (r["status"], r.get("reason")) for r in read_rows(build / folder)}
            for folder in ("1-crawl", "2-compose", "3-filter", "4-decontaminate", "5-selfcheck")}


def _set_rows(folder: Path) -> list[dict]:
    """The set's rows without the one measured column (eager_ms: a clock, not a verdict)."""
    from tasks.synthset import set_rows

    return [{k: v for k, v in r.items() if k != "eager_ms"} for r in set_rows(folder)]


@pytest.mark.full  # the build run twice, sliced; the whole build: the tests above
@pytest.mark.slow
def test_build_sliced_over_fresh_machines_gives_the_same_set(tmp_path: Path, small_kernelbench: Path):
    """One build run whole; the same build cut by a one-second limit into slices, each resumed from a COPY of the
    folder in a new place (the old one deleted, so nothing can point into it) with an empty cache: the same tasks,
    the same verdicts in every stage, the same set and splits; every task decided once; loadable and usable."""
    datasets = pytest.importorskip("datasets")
    from sandbox.api import init_workspace
    from tasks.loader import list_tasks

    whole = _build(tmp_path / "whole", small_kernelbench, tmp_path / "cache-whole")
    assert whole["complete"] is True

    here, slices = tmp_path / "slice0", []
    while True:
        slices.append(_build(here, small_kernelbench, tmp_path / f"cache{len(slices)}", "--resume",
                             "--time-limit", "1"))
        if slices[-1]["complete"]:
            break
        assert len(slices) < 15, slices[-1]
        moved = tmp_path / f"slice{len(slices)}"
        shutil.copytree(here, moved)
        shutil.rmtree(here)
        here = moved
    assert len(slices) >= 3, [s["stages"][-1]["stage"] for s in slices]  # really cut, more than once
    assert any(st.get("pending") for s in slices for st in s["stages"])  # and inside a stage, between its tasks

    assert _verdicts(here) == _verdicts(tmp_path / "whole")
    assert _set_rows(here / "dataset") == _set_rows(tmp_path / "whole" / "dataset")
    assert slices[-1]["export"]["splits"] == whole["export"]["splits"]
    timings = json.loads((here / "timings.json").read_text())
    for folder in ("2-compose", "3-filter", "4-decontaminate", "5-selfcheck"):
        ids = [r["id"] for r in read_rows(here / folder)]
        assert len(ids) == len(set(ids)), folder  # no task recorded twice
        assert timings[folder.split("-", 1)[1]]["decided"] == len(ids), folder  # nor decided twice
    info = json.loads((here / "build.json").read_text())
    assert len(info["runs"]) == len(slices) and info["runs"][-1]["complete"] and info["params"]["seed"] == 3

    kept = whole["stages"][4]["kept"]
    assert kept >= 1, whole
    dd = datasets.load_from_disk(str(here / "dataset"))
    assert len(dd["train"]) + len(dd["eval"]) == kept == slices[-1]["report"]["tasks"]
    tasks = list_tasks(f"synth:{here / 'dataset'}")
    assert len(tasks) == kept
    assert init_workspace(tasks[0], tmp_path / "ws", backend="cpu")[1].ok

    # resuming a finished build decides nothing again; another seed is refused
    again = _build(here, small_kernelbench, tmp_path / "cache-again", "--resume")
    assert again["complete"] and again["report"]["tasks"] == kept
    assert json.loads((here / "timings.json").read_text())["filter"]["decided"] == timings["filter"]["decided"]
    cmd = [sys.executable, "-m", "cuda_agent", "synth", "build", "--out", str(here), "--seed", "4", "--resume"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "seed=3 (now 4)" in p.stderr
