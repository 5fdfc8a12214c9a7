"""Round-trip latency of the sandbox on a KernelBench level-1 task (default: 19_ReLU).

    python -m bench.latency --out latency.json

Measures, in one run: compile cold with an empty cache, compile cold with the shared
infrastructure cached (a new episode), rebuild after editing one kernel, a no-op compile, verify,
profile (first, with torch.compile of the baseline) and profile with a cached baseline, and what
the timing bound's extra requests cost within it (sandbox/timing/timing_bound.py) and, on CUDA, what the
kernel audit's canary calibration costs in the timer's setup (sandbox/worker/kernel_audit.py).
Run it twice, with and without --no-confine, to see what the candidates' Landlock confinement costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def bound_cost(p) -> float:
    """Seconds the judge's timing bound adds to a profile: three empty round trips, a prepare and a batch
    request per batch (each about one round trip), and the second pairing when the first check failed (the
    eager batches of the first pairing are the speedup's, not the bound's)."""
    b = p.timing_bound
    requests = 3 + 2 * len(b.batches)
    again = sum(t.median_ms * sum(x.calls for x in t.batches) for t in (p.eager, p.candidate))
    return (requests * b.round_trip_ms + (again if b.recalibrated else 0.0)) / 1e3


def compile_steps(args, ws, fresh, record, cold_s: float) -> None:
    from sandbox.api import compile_workspace

    record("compile, cold (empty cache)", cold_s)
    for i in range(1, args.repeats + 1):
        w = fresh(i)
        t = time.perf_counter()
        assert compile_workspace(w).ok
        record("compile, cold (new workspace)", time.perf_counter() - t)
    cu = next(p for p in (ws.root / "kernels").iterdir() if p.suffix in (".cu", ".cpp") and "binding" not in p.name)
    for i in range(args.repeats):
        cu.write_text(cu.read_text() + f"\n// edit {i}\n")
        t = time.perf_counter()
        r = compile_workspace(ws)
        assert r.ok and r.rebuilt == [f"kernels/{cu.name}"], r.log_tail
        record("rebuild after editing one kernel", time.perf_counter() - t)
        print("  ninja steps:", r.steps, flush=True)
    t = time.perf_counter()
    assert compile_workspace(ws).up_to_date
    record("compile, nothing changed", time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="kernelbench/level1/19_ReLU")
    ap.add_argument("--solution", default=str(HERE / "solutions" / "relu"))
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="latency.json")
    ap.add_argument("--pause", type=float, default=10.0,
                    help="seconds between warm calls (an agent's turn), in which the pool refills")
    ap.add_argument("--no-confine", action="store_true",
                    help="no confinement and no resource limits of candidate processes (CUDA_AGENT_CONFINE=off, "
                    "CUDA_AGENT_LIMITS=off), for comparison")
    ap.add_argument("--judge-only", action="store_true",
                    help="compile once, untimed, and time only verify and profile (what confinement can change)")
    args = ap.parse_args()
    if args.no_confine:
        os.environ["CUDA_AGENT_CONFINE"] = "off"
        os.environ["CUDA_AGENT_LIMITS"] = "off"
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-"))
    os.environ["CUDA_AGENT_CACHE"] = str(scratch / "cache")

    from sandbox.api import compile_workspace, init_workspace, profile_workspace, verify_workspace

    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)
        print(f"{name:40s} {seconds:7.2f} s", flush=True)

    def fresh(i: int):
        ws, _ = init_workspace(args.task, scratch / f"ws{i}", args.backend, check=False)
        shutil.copytree(args.solution, ws.root, dirs_exist_ok=True)
        return ws

    ws = fresh(0)
    t = time.perf_counter()
    r = compile_workspace(ws)
    assert r.ok, r.log_tail
    if not args.judge_only:
        compile_steps(args, ws, fresh, record, time.perf_counter() - t)
    from sandbox.confinement.processes import enable_warm_pool


    for label in ("cold processes (CLI)", "warm pool (API users)"):
        if label.startswith("warm"):
            enable_warm_pool(2)
            assert verify_workspace(ws).ok  # the first call starts the pool
            time.sleep(8)  # let the pool's processes finish importing torch
        for _ in range(args.repeats):
            t = time.perf_counter()
            v = verify_workspace(ws)
            assert v.ok, v.message
            record(f"verify (5 input sets), {label}", time.perf_counter() - t)
            print("  verify phases:", {k: round(x, 2) for k, x in v.phases.items()}, flush=True)
            if label.startswith("warm"):
                time.sleep(args.pause)
        if label.startswith("cold"):
            t = time.perf_counter()
            p = profile_workspace(ws)
            assert p.ok, p.message
            record("profile, first (baseline + torch.compile)", time.perf_counter() - t)
        for _ in range(args.repeats):
            t = time.perf_counter()
            p = profile_workspace(ws)
            assert p.ok and p.baseline_cached, p.message
            record(f"profile, cached baseline, {label}", time.perf_counter() - t)
            record("timing bound: probes and per-batch requests", bound_cost(p))
            if "audit_setup_s" in p.checks:  # CUDA: the kernel audit's calibration before candidate code
                record("kernel audit: input-drawing kernels and canary calibration", p.checks["audit_setup_s"])
            if label.startswith("warm"):
                time.sleep(args.pause)
    summary = {k: {"median_s": sorted(v)[len(v) // 2], "runs": v} for k, v in rows.items()}
    meta = {"task": args.task, "device": p.device, "torch": p.torch_version, "backend": p.backend,
            "candidate_ms": p.candidate.median_ms, "eager_ms": p.eager.median_ms,
            "compiled_ms": p.compiled.median_ms if p.compiled else None, "sandbox_notes": p.sandbox_notes,
            "timing_bound": p.timing_bound.model_dump() if p.timing_bound else None}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": summary}, indent=2))
    print("\n| step | median (s) | runs |\n| --- | --- | --- |")
    for k, v in summary.items():
        print(f"| {k} | {v['median_s']:.2f} | {len(v['runs'])} |")
    print(json.dumps(meta))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
