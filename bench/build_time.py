"""What a new workspace's build costs, with and without the precompiled binding header, side by side.

    python bench/build_time.py --out build_time.json                 # CUDA when visible, else CPU
    python bench/build_time.py --backend cpu --repeats 5

Every RL response is a new workspace: its sources compiled from nothing, the binding included. Each repeat
builds two fresh copies of the bundled example's solution (example/swish_bias), one compiled against
binding_registry.h precompiled once per toolchain (CompileConfig.precompiled_header, the default) and one
parsing the header itself, alternating which goes first. The shared infrastructure (binding.o and the
precompiled header) is built before the first timed build: it is paid once per toolchain, not per response.
Printed: each build's wall time and ninja's steps (CompileResult.steps), then the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from sandbox.api import compile_workspace, init_workspace
    from sandbox.backend import resolve_backend
    from sandbox.build.compile import INFRA_TIMEOUT_S, infra_header, infra_object
    from sandbox.build.toolchain import get_toolchain
    from sandbox.config import CompileConfig
    from tasks.loader import EXAMPLES_DIR

    backend = resolve_backend(args.backend)
    tc = get_toolchain(backend)
    infra_object(tc, INFRA_TIMEOUT_S)
    pch = infra_header(tc, INFRA_TIMEOUT_S)
    print(f"backend {backend}, compiler {tc.cxx}, precompiled header: {pch or 'not used here (untrusted cache)'}")
    solution = EXAMPLES_DIR / "solutions" / "swish_bias" / backend
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for with_pch in ((True, False) if i % 2 == 0 else (False, True)):
                root = Path(tmp) / f"ws{i}-{int(with_pch)}"
                ws, _ = init_workspace("example/swish_bias", root, backend=backend)
                shutil.copytree(solution, ws.root, dirs_exist_ok=True)
                r = compile_workspace(ws, CompileConfig(precompiled_header=with_pch))
                assert r.ok, r.log_tail
                rows.append({"repeat": i, "precompiled_header": with_pch, "seconds": r.duration_s, "steps": r.steps})
                print(f"  {'pch   ' if with_pch else 'no pch'} {r.duration_s:6.2f} s  {r.steps}", flush=True)
    summary = {}
    for with_pch in (False, True):
        mine = [x for x in rows if x["precompiled_header"] == with_pch]
        summary["with" if with_pch else "without"] = {
            "median_s": statistics.median(x["seconds"] for x in mine),
            "steps_median_s": {k: statistics.median(x["steps"].get(k, 0.0) for x in mine) for k in mine[0]["steps"]},
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"backend": backend, "device_pch": str(pch), "rows": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
