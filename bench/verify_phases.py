"""Where verify's time goes on one task: prints VerifyResult.phases for a few calls.

    python bench/verify_phases.py [--task kernelbench/level1/19_ReLU] [--calls 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="kernelbench/level1/19_ReLU")
    ap.add_argument("--solution", default=str(HERE / "solutions" / "relu"))
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    from sandbox.api import compile_workspace, init_workspace, verify_workspace

    scratch = Path(tempfile.mkdtemp())
    ws, _ = init_workspace(args.task, scratch / "ws", check=False)
    shutil.copytree(args.solution, ws.root, dirs_exist_ok=True)
    assert compile_workspace(ws).ok
    for _ in range(args.calls):
        v = verify_workspace(ws)
        print(f"verify {v.duration_s:.2f} s ok={v.ok}", {k: round(x, 3) for k, x in v.phases.items()}, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
