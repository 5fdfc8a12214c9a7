"""What ending a timed run's kernel-audit profiler costs on a GPU, and what reading its table costs two ways.

The judge runs every timed call of a pairing under a CUDA-activity torch.profiler session (the kernel audit,
sandbox/worker/kernel_audit.py) and, at the end, stops it and reads its table inside the exclusive section. On an
H100 under eight judgments the two sides' ends took 27 s of 48 s of timing over 16 profiles. This prints, per
model and call count, alone and with N copies of itself at once (the load of N judgments on one host):

  exit_s      the profiler's __exit__ (synchronize, CUPTI's buffers flushed, the raw results built)
  averaged_s  the rows through key_averages() (a Python event per record and their tree, then grouping)
  raw_s       the rows counted from the raw results (kernel_audit.table on a CUDA session)
  same        whether the two tables agree on every device row (name, launches, device time within 1%)

    python bench/profiler_end.py --calls 1000 4000 --copies 1 8 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def _models():
    import torch

    def relu(x):
        return torch.relu(x)

    def chain(x):  # several kernels a call, as a fused-nothing eager forward has
        return torch.tanh(torch.relu(x) * 2.0 + 1.0).sum(dim=-1)

    return {"relu[4096,4096]": (relu, (4096, 4096)), "chain4[1024,1024]": (chain, (1024, 1024))}


def _agree(raw, averaged) -> bool:
    avg = {name: (count, total) for name, count, total in averaged}
    for name, count, total in raw:
        if name not in avg:
            return False
        c, t = avg[name]
        if c != count or abs(t - total) > 0.01 * max(t, total, 1.0):
            return False
    # every row of key_averages with device time is in the raw table
    names = {n for n, _, _ in raw}
    return all(n in names for n, _, t in averaged if t > 0)


def measure(calls: int, barrier=None) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sandbox.worker import kernel_audit

    out = []
    for label, (fn, shape) in _models().items():
        x = torch.randn(*shape, device="cuda")
        for _ in range(20):
            fn(x)
        torch.cuda.synchronize()
        if barrier is not None:
            barrier.wait()
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                fn(x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        prof.__exit__(None, None, None)
        t2 = time.perf_counter()
        raw = kernel_audit.table(prof)
        t3 = time.perf_counter()
        averaged = kernel_audit._averaged(prof)
        t4 = time.perf_counter()
        out.append({"model": label, "calls": calls, "run_s": t1 - t0, "exit_s": t2 - t1, "raw_s": t3 - t2,
                    "averaged_s": t4 - t3, "rows": len(raw), "same": _agree(raw, averaged)})
    return out


def _child(calls, barrier, q):
    q.put(measure(calls, barrier))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--copies", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    report = []
    for copies in args.copies:
        for calls in args.calls:
            barrier, q = ctx.Barrier(copies), ctx.Queue()
            procs = [ctx.Process(target=_child, args=(calls, barrier, q)) for _ in range(copies)]
            for p in procs:
                p.start()
            rows = [r for _ in procs for r in q.get(timeout=600)]
            for p in procs:
                p.join()
            for model in dict.fromkeys(r["model"] for r in rows):
                mine = [r for r in rows if r["model"] == model]
                line = {"copies": copies, "calls": calls, "model": model, "same": all(r["same"] for r in mine),
                        "rows": mine[0]["rows"]}
                for k in ("run_s", "exit_s", "averaged_s", "raw_s"):
                    line[k] = round(statistics.median(r[k] for r in mine), 4)
                    line[k.replace("_s", "_max_s")] = round(max(r[k] for r in mine), 4)
                print(json.dumps(line), flush=True)
                report.append(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
