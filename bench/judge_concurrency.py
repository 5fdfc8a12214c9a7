"""Concurrent judging on one device: do correct kernels still pass when many judgments run at once?

Judges the eight elementwise tasks of bench/ppo_learns.py twice each, once with the task's own expert
solution (must pass) and once with the next task's (must fail value_mismatch), `--workers` at a time
through the same evaluate() the trainers call, and prints each verdict with the seconds its profile and
verify waited for the device lock. Before sandbox/timing/device_lock.py, 12 at once on an H100 failed four of
the eight correct ones with async_work (bench/results/judge_concurrency_h100.txt); with the lock but
CUDA builds outside it, one of sixteen failed timing_unverified (its timing ran beside eleven nvcc builds).
`--repeats` judges each correct solution again in fresh workspaces; the summary lists each kernel's
speedups over eager, whose spread is the noise a speed milestone has to clear.

    python bench/judge_concurrency.py --out /tmp/jc --workers 12 --repeats 2  # GPU: about 3 minutes
    python bench/judge_concurrency.py --out /tmp/jc --backend cpu --workers 8 --rows 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ppo_learns as pl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", default=None, help="cuda or cpu (default: cuda if visible)")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1,
                    help="judge each correct solution this many times (fresh workspaces): the spread of one kernel's "
                         "speedup between judgments is the noise a speed milestone must clear")
    args = ap.parse_args()

    from harness.specs import select_tasks
    from sandbox.api import evaluate, init_workspace
    from sandbox.backend import resolve_backend
    from training.ppo.warmup import parse_solution

    backend = resolve_backend(args.backend)
    names = list(pl.OPS)
    pl.write_tasks(args.out / "tasks", args.rows, names)
    tasks = {t.name: t for t in select_tasks([str(args.out / "tasks")])}
    jobs = [(tasks[n], n, True) for _ in range(args.repeats) for n in names]
    jobs += [(tasks[n], names[(i + 1) % len(names)], False) for i, n in enumerate(names)]

    def one(i: int) -> dict:
        task, op, right = jobs[i]
        ws, _ = init_workspace(task, args.out / f"ws{i:02d}", backend=backend, check=False)
        for path, body in parse_solution(pl.expert_response(op, backend)).items():
            ws.write_text(path, body)
        c, v, p, r = evaluate(ws)
        return {"task": task.name, "expression_of": op, "should_pass": right, "milestone": r.milestone,
                "reason": str(r.reason) if r.reason else None, "verify_queued_s": (v.phases.get("queued") if v else None),
                "profile_queued_s": p.queued_s if p else None, "profile_message": p.message[:300] if p else None,
                "eager_ms": p.eager.median_ms if p and p.eager else None,
                "candidate_ms": p.candidate.median_ms if p and p.candidate else None,
                "speedup_vs_eager": p.speedup_vs_eager if p else None,
                "speedup_vs_eager_range": p.speedup_vs_eager_range if p else None,
                "launch_bound": p.launch_bound if p else None}

    t0 = time.perf_counter()
    rows: list[dict] = []
    with ThreadPoolExecutor(args.workers) as pool:  # each verdict printed as it comes: a cut run keeps them
        for fut in as_completed([pool.submit(one, i) for i in range(len(jobs))]):
            rows.append(fut.result())
            print(json.dumps({**rows[-1], "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
    wrong = [r for r in rows if (r["milestone"] != "failed") != r["should_pass"]]
    summary = {"backend": backend, "workers": args.workers, "judgments": len(rows), "wall_s": time.perf_counter() - t0,
               "wrong_verdicts": len(wrong), "reasons_of_wrong": sorted({str(r["reason"]) for r in wrong}),
               "speedups_vs_eager": {n: [round(r["speedup_vs_eager"], 3) for r in rows
                                         if r["task"] == n and r["should_pass"] and r["speedup_vs_eager"]]
                                     for n in names},
               "milestones": {m: sum(r["milestone"] == m for r in rows if r["should_pass"])
                              for m in ("failed", "correct", "faster_than_eager", "faster_than_compile")}}
    (args.out / "summary.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
