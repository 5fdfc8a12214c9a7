"""What a new workspace's build costs: bindings compiled thin (the default), against the pybind11 header, and without
the precompiled header, side by side.

    python -m bench.build_time --out build_time.json                 # CUDA when visible, else CPU
    python -m bench.build_time --backend cpu --repeats 5

Every RL response is a new workspace: its sources compiled from nothing, the binding included. Each repeat
builds a fresh copy of the bundled example's solution (example/swish_bias) once per variant, in a rotating order:
`thin` (CompileConfig defaults: each .cpp first against binding_registry.h's thin stand-in for pybind11), `full`
(thin_bindings=False: against the precompiled pybind11 header) and `no-pch` (thin_bindings=False,
precompiled_header=False). Nothing is reused: the object cache is off. The shared infrastructure (binding.o and the
precompiled headers) is built before the first timed build: it is paid once per toolchain, not per response.
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
    from sandbox.build.compile import INFRA_TIMEOUT_S, infra_header, infra_object, thin_header
    from sandbox.build.toolchain import get_toolchain
    from sandbox.config import CompileConfig
    from tasks.loader import EXAMPLES_DIR

    backend = resolve_backend(args.backend)
    tc = get_toolchain(backend)
    infra_object(tc, INFRA_TIMEOUT_S)
    pch, thin = infra_header(tc, INFRA_TIMEOUT_S), thin_header(tc, INFRA_TIMEOUT_S)
    print(f"backend {backend}, compiler {tc.cxx}, precompiled headers: {pch or 'not used here (untrusted cache)'}, "
          f"{thin}")
    variants = {"thin": CompileConfig(object_cache=False),
                "full": CompileConfig(object_cache=False, thin_bindings=False),
                "no-pch": CompileConfig(object_cache=False, thin_bindings=False, precompiled_header=False)}
    solution = EXAMPLES_DIR / "solutions" / "swish_bias" / backend
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            names = list(variants)
            for name in names[i % 3:] + names[:i % 3]:
                root = Path(tmp) / f"ws{i}-{name}"
                ws, _ = init_workspace("example/swish_bias", root, backend=backend)
                shutil.copytree(solution, ws.root, dirs_exist_ok=True)
                r = compile_workspace(ws, variants[name])
                assert r.ok, r.log_tail
                rows.append({"repeat": i, "variant": name, "seconds": r.duration_s, "steps": r.steps,
                             "full_bindings": r.full_bindings})
                print(f"  {name:6} {r.duration_s:6.2f} s  {r.steps} full header: {r.full_bindings}", flush=True)
    summary = {}
    for name in variants:
        mine = [x for x in rows if x["variant"] == name]
        summary[name] = {
            "median_s": statistics.median(x["seconds"] for x in mine),
            "steps_median_s": {k: statistics.median(x["steps"].get(k, 0.0) for x in mine) for k in mine[0]["steps"]},
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"backend": backend, "device_pch": str(pch), "rows": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
