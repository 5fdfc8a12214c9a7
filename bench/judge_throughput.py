"""Judgments per minute on one device for a realistic mix, and where the time goes.

    python -m bench.judge_throughput --out /tmp/jt --workers 8              # GPU (cuda when visible)
    python -m bench.judge_throughput --out /tmp/jt --backend cpu --workers 2 --rows 256

The mix, per pass, over the eight elementwise tasks of bench.proofs.family: each task's correct
solution, a wrong one (the next task's expression: value_mismatch), one that does not compile, one
that crashes (a null dereference: illegal address on CUDA, a segfault on the CPU) and `--timeouts`
that never return (verify's trial timeout is `--timeout-s` for every job, so they cost seconds, not a
minute). Pass 1 starts from an empty judge cache (every baseline measured, torch.compile's too), pass
2 judges the same mix again with the baselines cached: the RL steady state. Every judgment is the
trainers' path (compile, verify, profile when verify passed: sandbox.api.evaluate, whose judge_workspace times
the candidate in its verify's process); `--separate` calls verify_workspace and profile_workspace one after the
other instead, each starting its own candidate process (the MCP tools' path, and evaluate's before).

The sources are the trainers' responses: on CUDA every task's binding is the same text, so the judge's
object cache compiles it once (docs/judge.md), and pass 2 repeats pass 1's sources. `--distinct-sources`
gives every job's files a comment of their own, so nothing is reused: the case where no two responses share
a translation unit. `--no-object-cache` and `--no-precompiled-header` turn those off.

Printed per pass: judgments per minute overall, for correct and for failing solutions (wall time of
the pass, `--workers` at a time), and the share of the judges' summed time spent building, waiting for
the device lock, starting workers, and in the rest of verify and profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.proofs import family as pl  # noqa: E402

# the kernels' expression, replaced: what each failing kind writes instead of the task's own
BROKEN = {"compile_error": "undefined_function_of_the_agent(v)", "crash": "v + *(volatile float*)nullptr"}
# A kernel that never returns. It spins on a volatile read of its own input (never NaN: the inputs are normal
# draws), which no compiler may drop. A spin on a volatile local is not enough on CUDA: NVVM keeps the local in a
# register and the loop goes with it, so until 2026-12-01 this job's kernel returned at once and failed
# value_mismatch, and the mix held no hang at all. The input is `x` in the CUDA kernel and `xp` in the CPU loop.
HANG = {"cuda": "[&] { while (*(volatile const float*)(x + i) == v) {} return v; }()",
        "cpu": "[&] { while (*(volatile const float*)(xp + i) == v) {} return v; }()"}
# the reasons each failing kind must end with: another reason is a judgment that failed for the wrong cause
EXPECTED_REASONS = {"wrong": {"value_mismatch"}, "compile_error": {"compile_error"},
                    "crash": {"cuda_error", "crash"}, "timeout": {"timeout"}}


def jobs_for(names: list[str], timeouts: int, copies: int = 1, only: str | None = None,
             backend: str = "cuda") -> list[tuple[str, str, str]]:
    """(task, kind, C++ expression) for one pass: the mix `copies` times (each copy its own workspaces and
    builds), or only the jobs of one kind."""
    out = [(n, "correct", pl.OPS[n][1]) for n in names]
    out += [(n, "wrong", pl.OPS[names[(i + 1) % len(names)]][1]) for i, n in enumerate(names)]
    out += [(names[0], "compile_error", BROKEN["compile_error"]), (names[1], "crash", BROKEN["crash"])]
    out += [(names[2 + i % (len(names) - 2)], "timeout", HANG[backend]) for i in range(timeouts)]
    if only is not None:
        out = [j for j in out if j[1] == only]
    return out * max(1, copies)


def judge_one(task, kind: str, expr: str, ws_dir: Path, backend: str, timeout_s: float, pch: bool = True,
              objects: bool = True, mark: str | None = None, separate: bool = False) -> dict:
    from sandbox.api import (
        compile_workspace,
        init_workspace,
        milestone_reward,
        profile_workspace,
        verify_workspace,
    )
    from sandbox.config import CompileConfig, VerifyConfig

    ws, _ = init_workspace(task, ws_dir, backend=backend, check=False)
    for path, body in pl.expert_files(expr, backend).items():
        if mark is not None and path.startswith("kernels/"):  # a translation unit no other job compiles
            body = f"// {mark}\n" + body
        ws.write_text(path, body)
    t0, started_at = time.perf_counter(), time.time()
    # what sandbox.api.evaluate does, with a shorter trial timeout
    c = compile_workspace(ws, CompileConfig(precompiled_header=pch, object_cache=objects))
    vcfg = VerifyConfig(trial_timeout_s=timeout_s)
    if separate or not c.ok:
        v = verify_workspace(ws, vcfg) if c.ok else None
        p = profile_workspace(ws) if v and v.ok else None
    else:
        from sandbox.api import judge_workspace

        v, p = judge_workspace(ws, vcfg)
    r = milestone_reward(c, v, p)
    phases = v.phases if v else {}
    # from asking for a worker to its being ready (a pooled worker's own start-up was paid before it was asked for)
    ready = phases.get("worker_wait", 0.0) + ((p.phases or {}).get("worker_wait", 0.0) if p else 0.0)
    return {"task": task.name, "kind": kind, "milestone": r.milestone, "reason": str(r.reason) if r.reason else None,
            "started_at": started_at, "wall_s": time.perf_counter() - t0, "build_s": c.duration_s if c else 0.0, "build_cpu_s": c.cpu_s if c else None, "reused": c.reused,
            "build_steps": c.steps if c else {}, "full_bindings": c.full_bindings if c else [],
            "verify_s": v.duration_s if v else 0.0, "verify_queued_s": phases.get("queued", 0.0),
            "worker_ready_s": ready, "worker_wait_max_s": max(phases.get("worker_wait", 0.0),
                                                              ((p.phases or {}).get("worker_wait", 0.0) if p else 0.0)),
            "profile_s": p.duration_s if p else 0.0,
            "profile_queued_s": p.queued_s if p else 0.0, "baseline_cached": p.baseline_cached if p else None,
            "speedup_vs_eager": p.speedup_vs_eager if p else None,
            # what the exclusive section did: a re-run pairing (noise under load) doubles it
            "exclusive_s": p.exclusive_s if p else None,
            "pairing": {"attempts": p.paired.attempts, "rounds": len(p.paired.rounds), "stopped": p.paired.stopped,
                        "eager_spread": round(p.paired.eager_spread, 3), "noise": p.paired.noisy,
                        # eager beside the candidate against the baseline timed in a fresh process: where a kept
                        # task process times eager differently, this moves
                        "eager_drift": round(p.paired.eager_drift, 4),
                        "eager_ms": round(p.eager.median_ms, 5) if p.eager else None,
                        "candidate_ms": round(p.candidate.median_ms, 5) if p.candidate else None,
                        # each round of the last pairing (eager before, candidate, eager after, ms a call), and
                        # where the batches' wall times were read (sandbox/timing/judge_clock.py)
                        "rounds_ms": [[round(x.eager_before_ms, 5), round(x.candidate_ms, 5),
                                       round(x.eager_after_ms, 5)] for x in p.paired.rounds],
                        "judge_clock": (p.checks or {}).get("judge_clock"),
                        "disturbed_rounds": p.paired.disturbed_rounds}
            if p and p.paired else None,
            # where a verify's and a profile's time went under load (the candidate's set-up steps included)
            "verify_phases": {k: round(v, 3) for k, v in phases.items()},
            "profile_phases": {k: round(v, 3) for k, v in ((p.phases or {}) if p else {}).items()},
            # the candidate's end inside the last pairing (end_*_s) and eager's profiler exit (eager_end_profiler_s)
            "profile_ends": {k: round(v, 4) for k, v in ((p.checks or {}) if p else {}).items()
                             if k.endswith("_s") and isinstance(v, int | float)}}


def summarize(rows: list[dict], wall_s: float) -> dict:
    total = sum(r["wall_s"] for r in rows) or 1.0
    queued = sum(r["verify_queued_s"] + r["profile_queued_s"] for r in rows)
    build = sum(r["build_s"] for r in rows)
    ready = sum(r["worker_ready_s"] for r in rows)
    per_min = 60.0 / wall_s if wall_s > 0 else 0.0
    correct = [r for r in rows if r["kind"] == "correct"]
    return {"judgments": len(rows), "wall_s": round(wall_s, 1), "per_minute": round(len(rows) * per_min, 1),
            "correct_per_minute": round(len(correct) * per_min, 1),
            "failing_per_minute": round((len(rows) - len(correct)) * per_min, 1),
            "share": {"build": round(build / total, 3), "device_lock": round(queued / total, 3),
                      "worker_start": round(ready / total, 3),
                      "rest_of_verify_and_profile": round(max(0.0, total - build - queued - ready) / total, 3)},
            "verdicts_wrong": [f"{r['task']}/{r['kind']}: {r['milestone']} {r['reason']}" for r in rows
                               if (r["milestone"] == "failed") == (r["kind"] == "correct")],
            # failed, as it should, but not for its own cause (a hang read as a mismatch, a crash as a timeout)
            "reasons_unexpected": [f"{r['task']}/{r['kind']}: {r['reason']}" for r in rows
                                   if r["kind"] in EXPECTED_REASONS and r["milestone"] == "failed"
                                   and r["reason"] not in EXPECTED_REASONS[r["kind"]]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", default=None, help="cuda or cpu (default: cuda if visible)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096, help="rows of the [rows, 4096] input of every task")
    ap.add_argument("--timeouts", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=10.0, help="verify's trial timeout for every job")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--copies", type=int, default=1, help="the mix this many times per pass (a longer, steadier pass)")
    ap.add_argument("--only", default=None, choices=["correct", "wrong", "compile_error", "crash", "timeout"],
                    help="judge only this kind (the rate of one stream: e.g. correct solutions per minute)")
    ap.add_argument("--gpus", default=None, help="GPUs to spread the judgments over, e.g. 0,1 (default: every "
                    "visible GPU)")
    ap.add_argument("--cache", type=Path, default=None, help="the judge cache (default: OUT/cache, so pass 1 really "
                    "starts cold); another run's, to start with its baselines cached")
    ap.add_argument("--no-precompiled-header", action="store_true", help="builds parse binding_registry.h "
                    "themselves (CompileConfig.precompiled_header=False): what the precompiled header saves")
    ap.add_argument("--no-object-cache", action="store_true", help="compile every source, also one compiled "
                    "before (CompileConfig.object_cache=False)")
    ap.add_argument("--distinct-sources", action="store_true", help="a comment unique to each job in every source: "
                    "no two jobs share a translation unit, so the object cache reuses nothing (the worst case)")
    ap.add_argument("--separate", action="store_true", help="verify, then profile in processes of its own (two "
                    "candidate processes a judgment), instead of one judgment (sandbox.api.judge_workspace)")
    ap.add_argument("--deadline-s", type=float, default=None, help="end a pass this long after it starts, keeping the "
                    "judgments that finished (the rate over the time to the last of them); for device calls with a limit")
    ap.add_argument("--no-expect", action="store_true", help="do not tell the judge how many judgments run at once "
                    "(sandbox.api.expect_judgments): its pool then starts at the second judgment and grows on demand")
    args = ap.parse_args()
    os.environ["CUDA_AGENT_CACHE"] = str(args.cache or args.out / "cache")

    from harness.specs import select_tasks
    from sandbox.backend import GpuRing, resolve_backend

    backend = resolve_backend(args.backend)
    ring = GpuRing(backend, args.gpus.split(",") if args.gpus else None)

    def judged(*a) -> dict:
        with ring.next():
            return judge_one(*a)

    if not args.no_expect:
        from sandbox.api import expect_judgments

        expect_judgments(args.workers, backend, ring.gpus or None)
    names = list(pl.OPS)
    pl.write_tasks(args.out / "tasks", args.rows, names)
    tasks = {t.name: t for t in select_tasks([str(args.out / "tasks")])}
    report = {"backend": backend, "workers": args.workers, "rows": args.rows, "gpus": ring.gpus or None,
              "copies": args.copies, "only": args.only, "precompiled_header": not args.no_precompiled_header,
              "object_cache": not args.no_object_cache, "distinct_sources": args.distinct_sources,
              "expect": not args.no_expect, "separate": args.separate, "device_readers": os.environ.get("CUDA_AGENT_DEVICE_READERS"),
              "passes": []}
    run_id = uuid.uuid4().hex  # distinct sources stay distinct from every earlier run's on the same cache
    for n in range(args.passes):
        jobs = jobs_for(names, args.timeouts, args.copies, args.only, backend)
        t0, pass_at, cpu0 = time.perf_counter(), time.time(), host_cpu()
        with ThreadPoolExecutor(args.workers) as pool:
            futs = [pool.submit(judged, tasks[t], kind, expr, args.out / f"p{n}" / f"ws{i:03d}", backend,
                                args.timeout_s, not args.no_precompiled_header, not args.no_object_cache,
                                f"run {run_id} pass {n} job {i}" if args.distinct_sources else None, args.separate)
                    for i, (t, kind, expr) in enumerate(jobs)]
            # a line per judgment as it ends: a run cut off by a device call's time limit still shows its rate
            done, last = 0, t0
            try:
                for f in as_completed(futs, timeout=args.deadline_s):
                    done += 1
                    r, el = f.result(), time.perf_counter() - t0
                    last = time.perf_counter()
                    print(f"  pass {n} [{done}/{len(futs)}] {el:6.1f} s {r.get('kind', '')}: "
                          f"{r.get('milestone') or r.get('reason')}  ({done / el * 60:.1f}/min so far)  build "
                          f"{r.get('build_s', 0):.1f} verify {r.get('verify_s', 0):.1f} (queued "
                          f"{r.get('verify_queued_s', 0):.1f}) profile {r.get('profile_s', 0):.1f} (queued "
                          f"{r.get('profile_queued_s', 0):.1f}) worker waits {r.get('worker_ready_s', 0):.2f}"
                          + (f" exclusive {r['exclusive_s']:.2f}" if r.get("exclusive_s") is not None else "")
                          + (f" pairings {r['pairing']['attempts']}" if r.get("pairing") else ""), flush=True)
            except TimeoutError:  # --deadline-s: the judgments that ended, over the time to the last of them
                for f in futs:
                    f.cancel()
                cut = True
            else:
                cut = False
            rows = [f.result() for f in futs if f.done() and not f.cancelled()]
            if cut:
                _report(args, report, rows, last - t0, pass_at, cut=True, cpu0=cpu0)
                os._exit(0)  # the judgments still running are abandoned with their processes
        _report(args, report, rows, time.perf_counter() - t0, pass_at, cpu0=cpu0)


def host_cpu() -> tuple[float, float, float, float] | None:
    """(busy, all) core-seconds the host's CPUs have spent since boot, from /proc/stat (None where it cannot be read),
    then this process's own CPU-seconds (the judging threads) and its reaped children's (the builds' ninja, workers
    started by exec): two readings around a pass tell whether the judging was bound by the cores, and by whose work."""
    import resource

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    total = sum(fields[:8])  # guest time is counted inside user already
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (total - idle) / tick, total / tick, me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _report(args: argparse.Namespace, report: dict, rows: list[dict], wall_s: float, pass_at: float,
            cut: bool = False, cpu0: tuple[float, float, float, float] | None = None) -> None:
    """A pass's summary, printed and added to OUT/throughput.json (written after each pass, so a later cut keeps it)."""
    summary = summarize(rows, wall_s)
    cpu1 = host_cpu()
    if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
        busy = cpu1[0] - cpu0[0]
        builds = sum(r.get("build_cpu_s") or 0.0 for r in rows)
        summary["host_cpu"] = {"busy_share": round(busy / (cpu1[1] - cpu0[1]), 3), "cores": os.cpu_count(),
                               "core_s_per_judgment": round(busy / max(1, len(rows)), 2),
                               # the builds' own (their processes' CPU, from wait4) and everything else's
                               "build_core_s_per_judgment": round(builds / max(1, len(rows)), 2),
                               "rest_core_s_per_judgment": round((busy - builds) / max(1, len(rows)), 2),
                               # of the rest: this process (the judging threads), and everything neither it nor a
                               # child it reaped ran (the workers forked by the template, the template, the system)
                               "judge_core_s_per_judgment": round((cpu1[2] - cpu0[2]) / max(1, len(rows)), 2),
                               "workers_core_s_per_judgment": round((busy - (cpu1[2] - cpu0[2]) - (cpu1[3] - cpu0[3]))
                                                                    / max(1, len(rows)), 2)}
    summary["cut"] = cut  # ended by --deadline-s: rows are the judgments that finished by then
    cached = {r["baseline_cached"] for r in rows if r["baseline_cached"] is not None}
    summary["baselines"] = {frozenset({True}): "cached", frozenset({False}): "fresh"}.get(frozenset(cached), "mixed")
    summary["reused_objects"] = sum(len(r["reused"]) for r in rows)
    summary["started_at"] = pass_at  # each row's started_at against it: the pass's timeline
    # the task processes kept so far in this process, and why any went
    from sandbox.confinement import kept

    summary["task_processes"] = {**kept.KEEPER.counts, "retired_for": dict(kept.KEEPER.retired),
                                 "last_park": kept.KEEPER.last_park}
    report["passes"].append({"summary": summary, "rows": rows})
    print(json.dumps(summary), flush=True)
    (args.out / "throughput.json").write_text(json.dumps(report, indent=1))  # each pass: a cut-off run keeps it


if __name__ == "__main__":
    main()
