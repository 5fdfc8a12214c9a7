"""The set the project ships (tasks/synth_set, issue 37): what its card promises holds for its rows.

Not the packaging code (tests/test_synth_ship.py builds a small set for that) but the shipped data itself, so a
repackaging from another build, a hand edit or a lost split is caught: at least 1,000 tasks, each in the eager
band and under the decontamination threshold, both splits held out by the id hash, every task a valid
KernelBench-format file, and the build record saying every kept task was gated on an H100.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "tasks" / "synth_set"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    from tasks.synthset import set_rows

    if not SHIPPED.is_dir():
        pytest.fail("tasks/synth_set is missing: the set ships with the project")
    return set_rows(SHIPPED)


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((SHIPPED / "report.json").read_text())


def test_the_shipped_set_holds_a_thousand_decided_tasks_in_its_band(rows: list[dict], report: dict):
    ids = [r["task_id"] for r in rows]
    assert len(ids) >= 1000 and len(set(ids)) == len(ids) == report["tasks"]
    lo, hi = report["eager_ms"]["band"]
    assert (lo, hi) == (1.0, 100.0)
    assert all(lo <= r["eager_ms"] <= hi for r in rows)
    assert all(r["score"] < report["threshold"] for r in rows)  # decontaminated by computation
    assert all(r["nearest_kernelbench"].startswith("kernelbench/level") for r in rows)
    assert all(2 <= r["fusion_depth"] <= 5 and r["backend"] == "cuda" for r in rows)
    assert {lib for r in rows for lib in r["libraries"]} >= {"torch", "transformers"}


def test_the_eval_split_is_the_id_hash_s_and_disjoint_from_train(rows: list[dict], report: dict):
    from synth.splits import split_of

    fraction = report["splits"]["eval_fraction"]
    held = [r for r in rows if r["split"] == "eval"]
    assert all(r["split"] == split_of(r["task_id"], fraction) for r in rows)
    assert 0.03 <= len(held) / len(rows) <= 0.08
    assert report["splits"]["eval"] == len(held) and report["splits"]["train"] == len(rows) - len(held)


def test_every_kept_task_was_gated_on_an_h100(report: dict):
    """Runs on other devices may have decided tasks, but only where their note says the kept ones were gated
    again (the band is the H100's); a build that is not complete is never shipped."""
    runs = report["build"]["runs"]
    assert runs[-1]["complete"]
    for run in runs:
        if run["decided"].get("selfcheck") and "H100" not in run["device"]:
            assert "gates them again on an H100" in run.get("note", ""), run


def test_every_shipped_task_is_a_kernelbench_format_file(rows: list[dict], tmp_path: Path):
    """Each task's code imports, defines Model, get_inputs and get_init_inputs, and builds on the meta device
    (what `cuda-agent init` checks), all in one process."""
    listing = tmp_path / "tasks.json"
    listing.write_text(json.dumps([[r["task_id"], r["code"]] for r in rows]))
    script = r"""
import json, sys, torch
from pathlib import Path
from sandbox.worker.inputs import load_module, make_init_inputs, make_inputs
bad = []
for tid, code in json.load(open(sys.argv[1])):
    path = Path(sys.argv[2]) / f"{tid}.py"
    path.write_text(code)
    try:
        mod = load_module(str(path), "t_" + tid)
        assert all(hasattr(mod, n) for n in ("Model", "get_inputs", "get_init_inputs"))
        meta = torch.device("meta")
        init = make_init_inputs(mod, 0, meta)
        assert make_inputs(mod, 0, meta)
        with meta:
            mod.Model(*init)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{tid}: {type(e).__name__}: {e}"[:300])
print(json.dumps(bad))
"""
    out = subprocess.run([sys.executable, "-c", script, str(listing), str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_shipped_task_opens_by_its_id(rows: list[dict], tmp_path: Path):
    from tasks.loader import list_tasks, load_task

    held = list_tasks("synth:eval")
    assert len(held) == sum(r["split"] == "eval" for r in rows)
    one = load_task(held[0].id)
    assert "class Model" in one.source and one.id == held[0].id
