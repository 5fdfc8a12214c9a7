"""How often an honest kernel at about eager's speed earns a speed milestone on a loaded CPU (issues 65 and 68).

The bundled example/swish_bias with its CPU solution: on a quiet 2-core machine its kernel runs at about eager's
speed, and issue 65 saw the same files earn 2, 3 and 1 within five minutes under load. This builds and verifies it
once, then profiles it `--n` times, one at a time, with the judge's default ProfileConfig and a baseline cache of its
own (the first profile measures the baseline, under the same load), and counts the milestone each profile earns.

`--load K` runs K processes beside it that spin in bursts (each busy 0.2-2 s, then idle 0.2-2 s, at random), a
stand-in for another client's task check or verify sharing the cores; they take none of the judge's locks. The
machine's own load (other jobs) comes on top and is reported (load average before and after).

On the GPU (`--backend cuda --task PATH --solution DIR`, e.g. KernelBench's 19_ReLU with bench/solutions/relu: a
memory-bound kernel at about eager's speed) the same count runs with `--gpu-load K` processes beside it that fill the
device in bursts (matmuls for 0.2-2 s, then idle), another tenant the judge does not schedule, on top of the CPU
spinners (a launch-bound task feels those). `--size B,D` rewrites the task's `batch_size`/`dim` (a copy under OUT).

It imports the judge from the working directory, so the same file measures another checkout:

    python -m bench.honest_milestones --out /tmp/hm_new --n 20 --load 2
    git worktree add /tmp/old 3daac8d && cp bench/honest_milestones.py /tmp/old/bench/ && \\
        (cd /tmp/old && python -m bench.honest_milestones --out /tmp/hm_old --n 20 --load 2)
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import shutil
import time
from pathlib import Path


def spin(seed: int) -> None:
    """Busy then idle in bursts of 0.2-2 s each, until killed."""
    rng = random.Random(seed)
    while True:
        end = time.monotonic() + rng.uniform(0.2, 2.0)
        while time.monotonic() < end:
            pass
        time.sleep(rng.uniform(0.2, 2.0))


def gpu_spin(seed: int) -> None:
    """Matmuls on the GPU in bursts of 0.2-2 s, idle 0.2-2 s between, until killed."""
    import torch

    rng = random.Random(seed)
    a = torch.randn(4096, 4096, device="cuda")
    while True:
        end = time.monotonic() + rng.uniform(0.2, 2.0)
        while time.monotonic() < end:
            a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        time.sleep(rng.uniform(0.2, 2.0))


def sized_task(task: Path, size: str, out: Path) -> Path:
    """A copy of a KernelBench task file with its `batch_size` and `dim` set to B,D."""
    import re

    b, d = (int(x) for x in size.split(","))
    src = task.read_text()
    src = re.sub(r"^batch_size\s*=.*$", f"batch_size = {b}", src, flags=re.M)
    src = re.sub(r"^dim\s*=.*$", f"dim = {d}", src, flags=re.M)
    dst = out / f"{task.stem}_{b}x{d}.py"
    dst.write_text(src)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=20, help="profiles")
    ap.add_argument("--load", type=int, default=2, help="spinning processes beside the profiles")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--task", default="example/swish_bias", help="a task id or file")
    ap.add_argument("--solution", type=Path, default=None,
                    help="the solution's files (default: the bundled example's CPU solution)")
    ap.add_argument("--size", default=None, help="B,D: the task's batch_size and dim rewritten (a copy)")
    ap.add_argument("--gpu-load", type=int, default=0, help="processes filling the GPU in bursts")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # a baseline cache and lock folder of its own: the first profile measures the baseline under this load
    os.environ["CUDA_AGENT_CACHE"] = str(args.out / "cache")

    import sandbox
    from sandbox.api import (
        compile_workspace,
        init_workspace,
        milestone_reward,
        profile_workspace,
        verify_workspace,
    )
    from sandbox.config import ProfileConfig
    from tasks.loader import EXAMPLES_DIR

    ws_root = args.out / "ws"
    shutil.rmtree(ws_root, ignore_errors=True)
    task = args.task
    if args.size:
        task = str(sized_task(Path(task), args.size, args.out))
    solution = args.solution or EXAMPLES_DIR / "solutions" / "swish_bias" / "cpu"
    ws, _ = init_workspace(task, ws_root, backend=args.backend)
    shutil.copytree(solution, ws.root, dirs_exist_ok=True)
    c = compile_workspace(ws)
    assert c.ok, c.log_tail
    v = verify_workspace(ws)
    assert v.ok, v.message
    # spawned: a forked child of a process that has touched CUDA cannot use it
    ctx = mp.get_context("spawn")
    load = [ctx.Process(target=spin, args=(i,), daemon=True) for i in range(args.load)]
    load += [ctx.Process(target=gpu_spin, args=(i,), daemon=True) for i in range(args.gpu_load)]
    for p in load:
        p.start()
    rows, t0, before = [], time.time(), os.getloadavg()
    try:
        for i in range(args.n):
            p = profile_workspace(ws, ProfileConfig())
            r = milestone_reward(c, v, p)
            pt = p.paired
            row = {"i": i, "reward": r.reward, "milestone": r.milestone, "reason": p.reason,
                   "speedup_vs_eager": p.speedup_vs_eager, "speedup_vs_compile": p.speedup_vs_compile,
                   "range": p.speedup_vs_eager_range, "ci": getattr(p, "speedup_vs_eager_ci", None),
                   "load_factor": getattr(pt, "load_factor", None) if pt else None,
                   "waited": getattr(pt, "waited", None) if pt else None,
                   "baseline_retimed": pt.baseline_retimed if pt else None, "duration_s": p.duration_s,
                   "message": p.message[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in load:
            p.kill()
    counts = collections.Counter(r["reward"] for r in rows)
    summary = {"judge": str(Path(sandbox.__file__).resolve().parent.parent), "n": args.n, "load": args.load,
               "gpu_load": args.gpu_load, "backend": args.backend, "task": task,
               "rewards": {str(k): counts[k] for k in sorted(counts)},
               "speed_milestones": sum(1 for r in rows if r["reward"] >= 2),
               "timing_noisy": sum(1 for r in rows if r["reason"] == "timing_noisy"),
               "loadavg_before": before, "loadavg_after": os.getloadavg(), "wall_s": time.time() - t0}
    (args.out / "honest_milestones.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
