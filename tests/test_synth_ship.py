"""The shipped set's machinery, fast: the eval split's determinism, a killed run's manifest, a build's parameters
held across resumed runs, and a packaged folder listed, opened and loaded as a plain clone would (no pipeline run:
the build's last folder is written by hand)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from synth.manifest import StageError, StageOutput, read_rows

ROOT = Path(__file__).resolve().parent.parent


def test_eval_split_is_by_id_alone():
    from synth.splits import assign, split_of, unit

    ids = [f"fused_{i:05x}" for i in range(4000)]
    first = assign(ids)
    assert first == assign(list(reversed(ids)))  # order does not matter
    held = len(first["eval"]) / len(ids)
    assert 0.04 < held < 0.06, held  # 5% by default
    # a task's split does not depend on the others: a set grown over slices keeps every task where it was
    part = assign(ids[:500])
    assert set(part["eval"]) == set(first["eval"]) & set(ids[:500])
    assert all(split_of(i) == "eval" for i in first["eval"])
    # a larger fraction only adds tasks to eval, never takes one out
    assert set(first["eval"]) <= set(assign(ids, 0.2)["eval"])
    assert assign(ids, 0.0)["eval"] == [] and assign(ids, 1.0)["train"] == []
    # pinned: the scheme is part of the set's definition, so a change must be deliberate
    assert split_of("fused_00000") == "train" and round(unit("fused_00000"), 6) == 0.426969
    assert split_of("fused_00004") == "eval" and round(unit("fused_00004"), 6) == 0.004418
    with pytest.raises(ValueError):
        split_of("x", 1.5)


def test_a_killed_runs_half_written_row_is_cut(tmp_path: Path):
    with StageOutput(tmp_path, "filter", resume=False) as so:
        so.write({"id": "a", "status": "dropped", "reason": "nan_inf"})
        so.write({"id": "b", "status": "kept"}, "src")
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write('{"id": "c", "status": "ke')  # the process was killed here
    (tmp_path / ".c.py.tmp").write_text("half")
    assert [r["id"] for r in read_rows(tmp_path)] == ["a", "b"]
    with StageOutput(tmp_path, "filter", resume=True) as so:
        assert not so.done("c")
        so.write({"id": "c", "status": "dropped", "reason": "crash"})
    assert [r["id"] for r in read_rows(tmp_path)] == ["a", "b", "c"]
    assert not (tmp_path / ".c.py.tmp").exists()


def test_resumed_build_is_held_to_its_parameters(tmp_path: Path):
    from synth.buildinfo import open_build, read_info, record_run

    params = {"backend": "cuda", "count": 100, "seed": 0, "max_ops": 5, "band_ms": (1.0, 100.0), "threshold": None,
              "compile": True, "transformers": True, "composer": "programmatic", "eval_fraction": 0.05}
    open_build(tmp_path, params, resume=True)  # --resume on an empty folder starts the build
    record_run(tmp_path, "cpu", 0.0, 1.0, False, {"filter": 3})
    with pytest.raises(StageError, match="pass --resume"):
        open_build(tmp_path, params, resume=False)
    with pytest.raises(StageError, match=r"seed=0 \(now 1\)"):
        open_build(tmp_path, {**params, "seed": 1}, resume=True)
    info = open_build(tmp_path, {**params, "count": 300}, resume=True)  # a larger count adds candidates
    assert info["params"]["count"] == 300 and info["params"]["band_ms"] == [1.0, 100.0]
    assert open_build(tmp_path, {**params, "count": 50}, resume=True)["params"]["count"] == 300
    assert read_info(tmp_path)["runs"][0]["decided"] == {"filter": 3}


_TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * {k}


def get_inputs():
    return [torch.randn(8, 8)]


def get_init_inputs():
    return []
"""


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> Path:
    """A finished build of 12 tasks, packaged; then moved (the build deleted) as a clone would hold it."""
    from synth.package import package

    root = tmp_path_factory.mktemp("ship")
    build = root / "build"
    last = build / "5-selfcheck"
    last.mkdir(parents=True)
    with open(last / "manifest.jsonl", "w") as f:
        for k in range(12):
            tid = f"fused_{k:02d}"
            f.write(json.dumps({"id": tid, "file": f"{tid}.py", "status": "kept", "ops": ["torch.tanh", "torch.mul"],
                                "libraries": ["torch"], "metrics": {"judge_eager_ms": 2.0 + k},
                                "nearest": {"problem": "kernelbench/level1/22_Tanh", "score": 0.5}}) + "\n")
            (last / f"{tid}.py").write_text(_TASK.format(k=k + 2))
    (build / "build.json").write_text(json.dumps({"version": 1, "params": {
        "backend": "cuda", "band_ms": [1.0, 100.0], "threshold": None, "eval_fraction": 0.25},
        "runs": [{"host": "h", "device": "1 x H100", "complete": True, "decided": {}}]}))
    res = package(build, root / "first")
    assert res["rows"] == 12 and res["splits"]["train"] + res["splits"]["eval"] == 12
    assert res["splits"]["eval"] >= 1  # 25% of 12: the hash of these ids holds some out
    again = package(build, root / "second")
    for split in ("train", "eval"):  # the same set, the same bytes
        assert (root / "first" / f"{split}.jsonl.gz").read_bytes() == (root / "second" / f"{split}.jsonl.gz").read_bytes()
    assert again["splits"] == res["splits"]
    shipped = root / "clone" / "tasks" / "synth_set"
    shipped.parent.mkdir(parents=True)
    shutil.move(root / "first", shipped)
    shutil.rmtree(build)
    return shipped


def test_package_refuses_a_folder_of_other_files_and_an_unfinished_build(tmp_path: Path):
    from synth.package import package

    (tmp_path / "b" / "5-selfcheck").mkdir(parents=True)
    (tmp_path / "b" / "5-selfcheck" / "manifest.jsonl").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StageError, match="other files"):
        package(tmp_path / "b", tmp_path / "other")
    (tmp_path / "b" / "build.json").write_text(json.dumps({"params": {}, "runs": [{"complete": False}]}))
    with pytest.raises(StageError, match="not complete"):
        package(tmp_path / "b", tmp_path / "new")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_shipped_set_lists_and_opens_without_datasets(packaged: Path, monkeypatch):
    from harness.specs import select_tasks
    from tasks import TaskError
    from tasks.loader import list_tasks, load_task
    from tasks.synthset import read_split

    monkeypatch.setenv("CUDA_AGENT_SYNTH_SET", str(packaged))
    monkeypatch.setenv("CUDA_AGENT_KERNELBENCH", str(packaged / "no-such-suite"))  # no ../shared needed
    monkeypatch.setitem(sys.modules, "datasets", None)  # a plain clone: no datasets package
    everything = list_tasks("synth")
    train, held = list_tasks("synth:train"), list_tasks("synth:eval")
    assert len(everything) == 12 and len(train) + len(held) == 12 and held
    assert [t.id for t in everything] == [t.id for t in train + held]
    assert all(t.id.startswith("synth:eval/fused_") for t in held)
    assert {t.name for t in held} == {r["task_id"] for r in read_split(packaged, "eval")}
    one = held[0]
    assert load_task(f"synth:eval/{one.name}") == one == load_task(f"synth:{one.name}")  # canonical id either way
    with pytest.raises(TaskError, match="unknown synthesized task"):
        load_task(f"synth:train/{one.name}")
    with pytest.raises(TaskError, match="names a set or a split"):
        load_task("synth:eval")
    # training and evaluation pick a split through the ordinary task specs
    assert select_tasks("synth:eval") == held
    assert select_tasks(["synth:train", f"synth:eval/{one.name}"]) == train + [one]
    # a folder named explicitly gives the same tasks under ids that name it
    named = list_tasks(f"synth:{packaged}/eval")
    assert [t.source for t in named] == [t.source for t in held] and named[0].id == f"synth:{packaged}/{one.id[6:]}"
    monkeypatch.setenv("CUDA_AGENT_SYNTH_SET", str(packaged.parent / "absent"))
    with pytest.raises(TaskError, match="synth package"):
        list_tasks("synth")


def test_cli_lists_and_inits_a_shipped_task(packaged: Path, tmp_path: Path):
    env = {"CUDA_AGENT_SYNTH_SET": str(packaged), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = [sys.executable, "-m", "cuda_agent"]
    p = subprocess.run(run + ["tasks", "synth:eval"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    ids = p.stdout.split()
    assert ids and all(i.startswith("synth:eval/") for i in ids) and p.stderr.strip().endswith("tasks")
    p = subprocess.run(run + ["init", ids[0], str(tmp_path / "ws"), "--backend", "cpu", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["ok"] is True


def test_packaged_folder_loads_with_datasets(packaged: Path):
    datasets = pytest.importorskip("datasets")
    from tasks.synthset import read_split

    dd = datasets.load_from_disk(str(packaged))
    for split in ("train", "eval"):
        rows = read_split(packaged, split)
        assert dd[split]["task_id"][:] == [r["task_id"] for r in rows]
        assert dd[split]["code"][:] == [r["code"] for r in rows]
    rep = json.loads((packaged / "report.json").read_text())
    assert rep["splits"]["eval_fraction"] == 0.25 and rep["build"]["runs"][0]["device"] == "1 x H100"
    assert "host" not in rep["build"]["runs"][0]  # host names stay in the build folder
    card = (packaged / "README.md").read_text()
    assert "## Splits" in card and "CPU-built sample" not in card
    assert sorted(p.name for p in packaged.iterdir()) == ["README.md", "dataset_dict.json", "eval", "eval.jsonl.gz",
                                                          "report.json", "train", "train.jsonl.gz"]


def test_packaged_folder_reads_as_an_ops6k_copy(packaged: Path, monkeypatch):
    pytest.importorskip("datasets")
    from tasks.ops6k import load_ops6k

    monkeypatch.setenv("CUDA_AGENT_OPS6K", str(packaged))
    load_ops6k.cache_clear()
    try:
        tasks, skipped = load_ops6k(None)
        assert len(tasks) == 12 and skipped == 0 and all(t.id.startswith("ops6k/fused_") for t in tasks)
    finally:
        load_ops6k.cache_clear()
