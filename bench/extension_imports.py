"""What honest extensions import: build each solution given, list the undefined dynamic symbols of its
cuda_extension.so, and what the symbol scan says of them. The allow-list of sandbox/scan/symbol_scan.py
must pass every honest extension; CUDA ones can only be built where torch has its CUDA headers (the GPU host).

    python -m bench.extension_imports --backend cuda --out /tmp/imports.json \\
        example/swish_bias=tasks/examples/solutions/swish_bias/cuda \\
        tests/fixtures/kernelbench/level1/19_ReLU.py=bench/solutions/relu
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox.api import compile_workspace, init_workspace  # noqa: E402
from sandbox.build.compile import extension_path  # noqa: E402
from sandbox.config import CompileConfig  # noqa: E402
from sandbox.scan import symbol_scan  # noqa: E402
from tasks import load_task  # noqa: E402


def one(task: str, solution: Path, backend: str, work: Path) -> dict:
    ws, _ = init_workspace(load_task(task), work, backend, check=False)
    shutil.copytree(solution, ws.root, dirs_exist_ok=True)
    r = compile_workspace(ws, CompileConfig(object_cache=False))
    so = extension_path(ws)
    out = {"task": task, "solution": str(solution), "compile_ok": r.ok, "reason": r.reason, "message": r.message[:3000]}
    if so.is_file():
        out["imports"] = sorted(symbol_scan.imported_symbols(so))
        out["scan"] = symbol_scan.scan(so)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", help="TASK=SOLUTION_DIR")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pair in enumerate(args.pairs):
            task, _, sol = pair.partition("=")
            r = one(task, Path(sol), args.backend, Path(tmp) / f"ws{i}")
            results.append(r)
            print(f"{task}: compile_ok={r['compile_ok']} imports={len(r.get('imports', []))} "
                  f"scan={'clean' if not r.get('scan') else r['scan'][:400]}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
