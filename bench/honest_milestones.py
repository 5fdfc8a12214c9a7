"""How often an honest kernel at about eager's speed earns a speed milestone on a loaded CPU (issues 65 and 68).

The bundled example/swish_bias with its CPU solution: on a quiet 2-core machine its kernel runs at about eager's
speed, and issue 65 saw the same files earn 2, 3 and 1 within five minutes under load. This builds and verifies it
once, then profiles it `--n` times, one at a time, with the judge's default ProfileConfig and a baseline cache of its
own (the first profile measures the baseline, under the same load), and counts the milestone each profile earns.

`--load K` runs K processes beside it that spin in bursts (each busy 0.2-2 s, then idle 0.2-2 s, at random), a
stand-in for another client's task check or verify sharing the cores; they take none of the judge's locks. The
machine's own load (other jobs) comes on top and is reported (load average before and after).

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=20, help="profiles")
    ap.add_argument("--load", type=int, default=2, help="spinning processes beside the profiles")
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
    ws, _ = init_workspace("example/swish_bias", ws_root, backend="cpu")
    shutil.copytree(EXAMPLES_DIR / "solutions" / "swish_bias" / "cpu", ws.root, dirs_exist_ok=True)
    c = compile_workspace(ws)
    assert c.ok, c.log_tail
    v = verify_workspace(ws)
    assert v.ok, v.message
    load = [mp.Process(target=spin, args=(i,), daemon=True) for i in range(args.load)]
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
               "rewards": {str(k): counts[k] for k in sorted(counts)},
               "speed_milestones": sum(1 for r in rows if r["reward"] >= 2),
               "timing_noisy": sum(1 for r in rows if r["reason"] == "timing_noisy"),
               "loadavg_before": before, "loadavg_after": os.getloadavg(), "wall_s": time.time() - t0}
    (args.out / "honest_milestones.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
