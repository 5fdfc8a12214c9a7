"""Every KernelBench reference through the real judge, against itself.

    python -m bench.kernelbench_selfcheck --spec kernelbench --jobs 4 --out selfcheck.json

Prints a table of the tasks that cannot pass (and why) and writes every result as JSON.
Tasks that run out of memory while others share the GPU are retried alone at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox.backend import resolve_backend  # noqa: E402
from sandbox.correctness.selfcheck import self_verify  # noqa: E402
from tasks import list_tasks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="kernelbench")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="selfcheck.json")
    args = ap.parse_args()
    backend = resolve_backend(args.backend)
    tasks = list_tasks(args.spec)
    t0 = time.time()
    results: dict[str, dict] = {}

    def one(task):
        r = self_verify(task, backend, trials=args.trials, timeout_s=args.timeout)
        results[task.id] = {"ok": r.ok, "reason": r.reason, "message": r.message[:600], "duration_s": r.duration_s}
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.duration_s:6.1f}s {task.id} {'' if r.ok else r.reason}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, tasks))
    retry = [t for t in tasks if results[t.id]["reason"] in ("oom", "timeout", "crash", "cuda_error")]
    if retry and args.jobs > 1:
        print(f"retrying {len(retry)} alone", flush=True)
        for t in retry:
            one(t)
    Path(args.out).write_text(json.dumps(results, indent=2))
    bad = {k: v for k, v in results.items() if not v["ok"]}
    print(f"\n{len(tasks) - len(bad)}/{len(tasks)} references pass against themselves ({time.time() - t0:.0f} s)")
    print("| task | reason | message |\n| --- | --- | --- |")
    for k, v in sorted(bad.items()):
        msg = v["message"].replace("\n", " ").replace("|", "/")[:200]
        print(f"| {k} | {v['reason']} | {msg} |")


if __name__ == "__main__":
    main()
