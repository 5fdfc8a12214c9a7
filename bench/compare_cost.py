"""What the judge's output comparison (sandbox/worker/compare.py) costs on a large output, and where it goes.

    python bench/compare_cost.py --out compare_cost.json            # CUDA: KernelBench 19_ReLU's output size
    python bench/compare_cost.py --numel 50000000 --device cpu

A spot check of KernelBench's 19_ReLU compares a 6 GiB output (4096 x 393216 float32) with the reference's; four
of them took 0.33-0.63 s of a 2 s profile on an H200 (docs/benchmarks.md). Printed: compare_tensor's wall time on
the whole output (synchronized, `--repeats` times), then each step of one chunk's fast path timed on its own
(`_finite_chunk`'s operations, one at a time, synchronized), so the expensive steps are named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=4096 * 393216)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--warm-small", action="store_true", help="compare a few elements first (kernels loaded)")
    args = ap.parse_args()

    import torch

    from sandbox.worker import compare

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    warm = {}
    if args.warm_small:  # the same comparison on a few elements first: what a first call pays whatever its size
        t0 = time.perf_counter()
        small = torch.randn(4096, device=dev)
        compare.compare_tensor("out", small, small + 1e-6, 1e-2, 1e-2)
        sync()
        warm["small_compare_s"] = time.perf_counter() - t0
    x = torch.randn(args.numel, device=dev)
    y = x + 1e-6 * torch.randn(args.numel, device=dev)
    sync()
    whole = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        r = compare.compare_tensor("out", x, y, 1e-2, 1e-2)
        sync()
        whole.append(time.perf_counter() - t0)
    assert r["ok"], r
    gb = args.numel * 4 * 2 / 1e9

    a, b = x[:compare._CHUNK], y[:compare._CHUNK]
    atol, rtol = 1e-2, 1e-2
    steps: dict[str, list[float]] = {}

    def timed(name: str, fn):
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            steps.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    diff = timed("sub_abs", lambda: torch.sub(a, b).abs_())
    ax = timed("abs", lambda: a.abs())
    thr = timed("mul_add", lambda: torch.mul(ax, rtol).add_(atol))
    bad = timed("gt", lambda: diff > thr)
    timed("amax_diff", lambda: diff.amax())
    timed("sum_bad", lambda: bad.sum())
    timed("norm_x_f64", lambda: torch.linalg.vector_norm(a, dtype=torch.float64))
    timed("norm_x_f32", lambda: torch.linalg.vector_norm(a))
    timed("norm_diff_f64", lambda: torch.linalg.vector_norm(diff, dtype=torch.float64))
    timed("clamp_div_amax", lambda: torch.div(diff, ax.clamp_min(torch.finfo(a.dtype).tiny)).amax())
    timed("finite_chunk", lambda: compare._finite_chunk(a, b, atol, rtol))
    timed("read_once_sum", lambda: a.sum())
    out = {"device": str(dev), "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "numel": args.numel, "chunk": compare._CHUNK, **warm, "compare_s": whole, "compare_gb_read": gb,
           "chunk_steps_ms": {k: statistics.median(v) for k, v in steps.items()}}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
