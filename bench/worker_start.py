"""How long the judge waits for its workers: workers started by exec against workers forked from a template
(sandbox.confinement.template), side by side in one run.

    python -m bench.worker_start [--backend cuda] [--calls 5] [--pause 3] [--out worker_start.json]

In this one judge process: the template's own start (once per judge process), then, alternating call by
call between workers started by exec and forked from the template: the time from asking for a worker to
its being ready (Worker.ready_wait: a `reference` worker, as verify uses, and a `timer`, which also
imports torch._dynamo), and verify's and profile's (cached baseline) totals with the phase `worker_wait`,
one call every --pause seconds.
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


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def ready_wait(role: str, device: str) -> float:
    from sandbox.confinement.processes import Session

    with Session(device) as s:
        w = s.spawn(role)
        assert w.request("exit", 120, "exit")["ok"]  # its first line said when it was ready
        return w.ready_wait


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="kernelbench/level1/19_ReLU")
    ap.add_argument("--solution", default=str(HERE / "solutions" / "relu"))
    ap.add_argument("--backend", default=None)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between calls (an agent's turn)")
    ap.add_argument("--out", default="worker_start.json")
    ap.add_argument("--modes", default="exec,fork", help="exec, fork or both (comma-separated), alternating")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-worker-start-"))
    os.environ["CUDA_AGENT_CACHE"] = str(scratch / "cache")

    from sandbox.api import compile_workspace, init_workspace, profile_workspace, verify_workspace
    from sandbox.backend import device_for
    from sandbox.confinement import template
    from sandbox.confinement.processes import worker_env

    ws, _ = init_workspace(args.task, scratch / "ws", args.backend, check=False)
    shutil.copytree(args.solution, ws.root, dirs_exist_ok=True)
    assert compile_workspace(ws).ok
    device = device_for(ws.backend)
    p = profile_workspace(ws)  # fills the baseline cache: every timed profile below has a cached baseline
    assert p.ok, p.message
    rows: dict[str, dict[str, list[float]]] = {}

    def record(mode: str, name: str, seconds: float) -> None:
        rows.setdefault(name, {}).setdefault(mode, []).append(seconds)
        print(f"{mode:5s} {name:45s} {seconds:7.3f} s", flush=True)

    # the two ways alternate call by call, so that the machine's load drifts evenly over both
    t = time.perf_counter()
    info = template.enable(worker_env()).channel.info()
    assert not info["problems"], info["problems"]
    record("fork", "template ready (once per judge process)", time.perf_counter() - t)
    modes = tuple(args.modes.split(","))
    phases: dict[str, list[dict[str, float]]] = {}

    def use(mode: str) -> None:
        os.environ[template.FORK_ENV] = "off" if mode == "exec" else "on"

    for _ in range(args.calls):
        for mode in modes:
            use(mode)
            for role in ("reference", "timer"):
                record(mode, f"request to ready worker ({role})", ready_wait(role, device))
    for _ in range(args.calls):
        for mode in modes:
            use(mode)
            time.sleep(args.pause)
            v = verify_workspace(ws)
            assert v.ok, v.message
            record(mode, "verify", v.duration_s)
            record(mode, "verify: worker_wait", v.phases["worker_wait"])
            phases.setdefault(f"verify {mode}", []).append(v.phases)
    for _ in range(args.calls):
        for mode in modes:
            use(mode)
            time.sleep(args.pause)
            p = profile_workspace(ws)
            if p.reason == "timing_unverified":  # a loaded CPU can fail the judge's clock: counted, not timed
                record(mode, "profile failed the timing bound (count)", 1.0)
                continue
            assert p.ok and p.baseline_cached, p.message
            record(mode, "profile, cached baseline", p.duration_s)
            record(mode, "profile: worker_wait", p.phases["worker_wait"])
            phases.setdefault(f"profile {mode}", []).append(p.phases)
            if p.timing_bound is not None and p.timing_bound.recalibrated:
                print("      (timing bound re-timed eager: a timer and a reference more)", flush=True)
    template.disable()
    summary = {name: {mode: {"median_s": median(v), "runs": v} for mode, v in by.items()} for name, by in rows.items()}
    meta = {"task": args.task, "device": p.device, "torch": p.torch_version, "calls": args.calls, "pause_s": args.pause}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": summary, "phases": phases}, indent=2))
    print("\n| median of | exec (s) | fork (s) |\n| --- | --- | --- |")
    for name, by in summary.items():
        count = name.endswith("(count)")
        cells = [(str(len(by[m]["runs"])) if count else f"{by[m]['median_s']:.3f}") if m in by else ""
                 for m in ("exec", "fork")]
        print(f"| {name} | {' | '.join(cells)} |")
    print(json.dumps(meta))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
