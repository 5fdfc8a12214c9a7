"""Where a new binding's compile goes, and what the host compiler's flags and the precompiled header change.

    python bench/build_flags.py --out build_flags.json               # CUDA toolchain when visible, else CPU
    python bench/build_flags.py --backend cpu --repeats 2

Issue 33 (item 5) asks for a new source's build in 4 s on the H100 host, where the binding's .cpp took 9.5-12 s.
This compiles the bundled example's binding (example/swish_bias, the toolchain's backend) directly with the
judge's host flags (sandbox.build.ninja_file.host_flags), changing one thing at a time:

- `O3-pch` -O3 against binding_registry.h precompiled with the same flags (the judge's build on the CPU backend,
  and on CUDA before the glue went to -O1: sandbox.build.ninja_file.host_opt);
- `O3-nopch` the same parsing the header itself;
- `O2-pch`, `O1-pch`, `O0-pch` a lower optimisation level, each against a header precompiled at that level (GCC
  refuses a precompiled header made with other -O flags and silently parses the plain one); `O1-pch` is the
  judge's build on CUDA;
- `O3-pch-bare` -O3 against the header as it was before issue 33: pybind11 and the casters only, without the
  allocation ops and the CUDA stream headers that bindings include next (after the full header those includes
  are no-ops);
- `O3-pch-iface`, `O1-pch-iface` against the header precompiled with pybind11's headers interface-only, the
  judge's build with GCC (sandbox/build/pybind_interface.py): the binding leaves pybind11's members to the
  infrastructure object.

Each variant is compiled `--repeats` times one at a time, then `--parallel` copies at once (the load of an RL
step's builds). Printed and written: seconds per variant (median, and the parallel batch's longest), whether the
precompiled header was used (g++ -H prints `!` for it), and GCC's -ftime-report phases of one compile.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXTRA = re.compile(r"#include <ATen/ops/empty\.h>.*?#endif\n", re.S)  # what issue 33 added to the header


def flags_at(flags: list[str], opt: str) -> list[str]:
    return [opt if f.startswith("-O") else f for f in flags]


def make_pch(cxx: str, flags: list[str], folder: Path, infra: Path, bare: bool, iface: bool = False) -> float:
    from sandbox.build import pybind_interface

    folder.mkdir(parents=True)
    text = (infra / "binding_registry.h").read_text()
    if bare:
        text = EXTRA.sub("", text)
    header = folder / "binding_registry.h"
    header.write_text(text)
    if iface:
        headers = pybind_interface.pybind_headers(cxx, [*flags, f"-I{folder}"], header, 300)
        header.write_text(pybind_interface.interface_header(text, headers, header))
    t = time.perf_counter()
    subprocess.run([cxx, *flags, f"-I{folder}", "-x", "c++-header", str(folder / "binding_registry.h"), "-o",
                    str(folder / "binding_registry.h.gch")], check=True, capture_output=True)
    return time.perf_counter() - t


def compile_once(cxx: str, flags: list[str], src: Path, out: Path, extra: list[str] | None = None) -> float:
    t = time.perf_counter()
    subprocess.run([cxx, *flags, *(extra or []), "-c", str(src), "-o", str(out)], check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    args = ap.parse_args()

    from sandbox.backend import resolve_backend
    from sandbox.build.ninja_file import host_flags
    from sandbox.build.toolchain import get_toolchain
    from sandbox.workspace import INFRA_DIR
    from tasks.loader import EXAMPLES_DIR

    backend = resolve_backend(args.backend)
    tc = get_toolchain(backend)
    sol = EXAMPLES_DIR / "solutions" / "swish_bias" / backend / "kernels"
    src = sol / ("swish_bias_binding.cpp" if backend == "cuda" else "swish_bias.cpp")
    tmp = Path(tempfile.mkdtemp(prefix="build-flags-"))
    ws_inc = tmp / "ws"
    ws_inc.mkdir()
    shutil.copy(INFRA_DIR / "binding_registry.h", ws_inc / "binding_registry.h")  # the workspace's own copy
    shutil.copy(src, tmp / src.name)
    variants = {"O3-pch": ("-O3", "pch", False), "O3-pch-bare": ("-O3", "pch", True), "O3-nopch": ("-O3", None, False),
                "O2-pch": ("-O2", "pch", False), "O1-pch": ("-O1", "pch", False),
                "O0-pch": ("-O0", "pch", False), "O3-pch-iface": ("-O3", "pch", False, True),
                "O1-pch-iface": ("-O1", "pch", False, True)}
    report: dict = {"backend": backend, "cxx": tc.cxx, "source": src.name, "variants": {}}
    print(f"{backend}: {tc.cxx}, {src.name}, {args.repeats} one at a time, {args.parallel} at once", flush=True)
    for name, (opt, pch, bare, *iface) in variants.items():
        if args.variants and name not in args.variants.split(","):
            continue
        base = flags_at(host_flags(tc, []), opt)
        incs = [f"-I{ws_inc}"]
        row: dict = {"opt": opt, "pch": bool(pch), "bare_header": bare, "pybind_interface": bool(iface)}
        if pch:
            folder = tmp / f"pch-{name}"
            row["pch_build_s"] = round(make_pch(tc.cxx, base, folder, INFRA_DIR, bare, bool(iface)), 2)
            incs = [f"-I{folder}", *incs]
        # the include order the judge uses: the precompiled header's folder before the workspace's
        flags = [f for f in base if not f.startswith("-I")] + incs + [f for f in base if f.startswith("-I")]
        h = subprocess.run([tc.cxx, *flags, "-H", "-fsyntax-only", str(tmp / src.name)], capture_output=True, text=True)
        first = next((ln for ln in h.stderr.splitlines() if ln.startswith(("!", "."))), "")
        row["pch_used"] = first.startswith("!")
        one = [compile_once(tc.cxx, flags, tmp / src.name, tmp / f"{name}-{i}.o") for i in range(args.repeats)]
        with ThreadPoolExecutor(args.parallel) as pool:
            t = time.perf_counter()
            many = list(pool.map(compile_once, [tc.cxx] * args.parallel, [flags] * args.parallel,
                                 [tmp / src.name] * args.parallel,
                                 [tmp / f"{name}-p{i}.o" for i in range(args.parallel)]))
            row["parallel_wall_s"] = round(time.perf_counter() - t, 2)
        rep = subprocess.run([tc.cxx, *flags, "-ftime-report", "-c", str(tmp / src.name), "-o", str(tmp / "r.o")],
                             capture_output=True, text=True)
        row["phases"] = {}
        for ln in rep.stderr.splitlines():  # " phase parsing : 9.30 ( 48%) 2.29 ( 65%) 13.74 ( 52%) 606M ( 64%)"
            if ln.strip().startswith("phase ") and len(ln.split(":")[1].split()) > 6:
                row["phases"][ln.split(":")[0].strip().removeprefix("phase ")] = float(ln.split(":")[1].split()[0])
        row.update(one_s=[round(x, 2) for x in one], median_s=round(statistics.median(one), 2),
                   parallel_s=[round(x, 2) for x in many], parallel_max_s=round(max(many), 2))
        report["variants"][name] = row
        print(f"{name:9} pch_used={row['pch_used']!s:5} median {row['median_s']:6.2f} s  one at a time {row['one_s']}  "
              f"{args.parallel} at once: longest {row['parallel_max_s']:.2f} s  user s by phase {row['phases']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
