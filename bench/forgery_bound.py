"""How much faster than real can a forged timing look, and are honest solutions ever refused?

    python -m bench.forgery_bound --out forgery_bound.json [--repeats 3] [--honest 10] [--hog 2]

Builds tests/exploits/forgery/forge_modes.cpp (an honest, slow scalar ReLU that can rewrite the timer's
clock or its replies) with the symbol scan off, on two ReLU tasks (32x64: calls of microseconds;
1024x1024: about a millisecond), then profiles: each forgery at each divisor `repeats` times (a run
passes when profile is ok), and the honest solution `honest` times. With --hog N, N busy processes
run throughout (a loaded machine). Prints one row per case and writes all bound numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "exploits"))

TASKS = {"relu_32x64": (32, 64), "relu_1024x1024": (1024, 1024)}


def task_source(rows: int, cols: int) -> str:
    return ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n\n    def forward(self, x):\n        return torch.relu(x)\n\n\n"
            f"def get_inputs():\n    return [torch.randn({rows}, {cols})]\n\n\ndef get_init_inputs():\n    return []\n")


def _hog() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="forgery_bound.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--honest", type=int, default=10)
    ap.add_argument("--hog", type=int, default=0, help="busy processes running throughout")
    ap.add_argument("--modes", default="clock,pipe")
    ap.add_argument("--divisors", default="1.1,1.2,1.5,2,20")
    ap.add_argument("--tasks", default=",".join(TASKS))
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-forgery-"))
    os.environ["CUDA_AGENT_CACHE"] = str(scratch / "cache")
    os.environ["CUDA_AGENT_SYMBOL_SCAN"] = "0"

    from catalogue import model_new

    from sandbox.api import compile_workspace, profile_workspace
    from sandbox.config import ProfileConfig
    from sandbox.workspace import Workspace
    from tasks import Task

    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    cfg = ProfileConfig(top_kernels=0)
    rows = []
    built: Path | None = None
    try:
        for name in args.tasks.split(","):
            ws = Workspace.create(Task(id=f"bench/{name}", source=task_source(*TASKS[name])), scratch / name,
                                  backend="cpu")
            (ws.root / "kernels").mkdir(exist_ok=True)
            for f in ("forge_modes.cpp", "forge_payload.h"):
                shutil.copyfile(ROOT / "tests/exploits/forgery" / f, ws.root / "kernels" / f)
            if built is not None:
                shutil.copytree(built, ws.build_dir, dirs_exist_ok=True)
            (ws.root / "model_new.py").write_text(model_new("def forward(self, x):\n        return cuda_extension.relu(x)"))
            r = compile_workspace(ws)
            assert r.ok, r.log_tail
            built = ws.build_dir
            cases = [("honest", 1.0)] * args.honest + [(m, float(d)) for m in args.modes.split(",")
                                                       for d in args.divisors.split(",") for _ in range(args.repeats)]
            for mode, div in cases:
                head = "" if mode == "honest" else f"cuda_extension.forge({mode!r}, {div!r})"
                (ws.root / "model_new.py").write_text(
                    model_new("def forward(self, x):\n        return cuda_extension.relu(x)", head=head))
                p = profile_workspace(ws, cfg)
                b = p.timing_bound
                row = {"task": name, "mode": mode, "divisor": div, "passed": p.ok,
                       "reason": p.reason.value if p.reason else None,
                       "reported_ms": p.candidate.median_ms if p.candidate else None,
                       "eager_ms": p.eager.median_ms if p.eager else None,
                       "bound": b.model_dump() if b else None}
                rows.append(row)
                print(f"{name:16s} {mode:8s} /{div:<5g} {'PASS' if p.ok else 'refused':8s} "
                      f"reported {row['reported_ms'] or 0:.4g} ms  implied {b.implied_ms if b else 0:.4g} ms  "
                      f"a {b.round_trip_ms if b else 0:.3f} o {b.overhead_per_call_ms if b else 0:.4f}  "
                      f"excess {b.batch_excess_ms if b else 0:+.4f}  factor {b.max_forgery_factor if b else None}  "
                      f"recal {b.recalibrated if b else None}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    summary = {}
    for r in rows:
        key = f"{r['task']}:{r['mode']}"
        s = summary.setdefault(key, {"runs": 0, "passed": 0, "largest_passing_divisor": None})
        s["runs"] += 1
        if r["passed"]:
            s["passed"] += 1
            if r["mode"] != "honest":
                s["largest_passing_divisor"] = max(s["largest_passing_divisor"] or 0, r["divisor"])
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"hog": args.hog, "summary": summary, "rows": rows}, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
