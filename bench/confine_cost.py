"""What confining candidate processes costs: Landlock, the resource limits and the seccomp filter.

Runs the same verify and profile calls with everything on and with everything off
(CUDA_AGENT_CONFINE=off, CUDA_AGENT_LIMITS=off), interleaved so that load on the machine hits both
alike, in cold processes (the CLI's path). Reports medians, and the seconds the candidate's worker
itself spent confining (stage 1 at start, stage 2 and the limits before the extension loads).

A baseline timed again compiles the reference with torch.compile. Confined, the baseline timer uses the
judge's persistent Inductor/Triton cache: it is timed with that cache emptied first (a machine that has
never compiled anything), then with only Inductor's graphs and kernels and Triton's kernels removed
(a new task: the C++ precompiled header under the cache's tmp/ and Triton's driver and launcher
modules stay warm), then right after (the same task timed again). Unconfined, it always compiles
from a cold scratch directory. The Inductor cache's hits and misses and the seconds of
torch.compile's first call are recorded with each baseline.

    python -m bench.confine_cost                                    # CPU: the examples' swish_bias
    python -m bench.confine_cost --backend cuda --task kernelbench/level1/19_ReLU \\
        --solution bench/solutions/relu                             # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = {"confined": {}, "unconfined": {"CUDA_AGENT_CONFINE": "off", "CUDA_AGENT_LIMITS": "off"}}


def main() -> None:
    from tasks.loader import EXAMPLES_DIR

    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default=str(EXAMPLES_DIR / "swish_bias.py"))
    ap.add_argument("--solution", default=str(EXAMPLES_DIR / "solutions" / "swish_bias" / "cpu"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="confine_cost.json")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-confine-bench-"))
    os.environ["CUDA_AGENT_CACHE"] = str(scratch / "cache")

    from sandbox.api import compile_workspace, init_workspace, profile_workspace, verify_workspace
    from sandbox.config import ProfileConfig

    ws, _ = init_workspace(args.task, scratch / "ws", args.backend, check=False)
    shutil.copytree(args.solution, ws.root, dirs_exist_ok=True)
    assert compile_workspace(ws).ok
    rows: dict[str, list[float]] = {}
    notes: dict[str, list[str]] = {}

    compile_cache: dict[str, list[dict]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)
        print(f"{name:60s} {seconds:7.3f} s", flush=True)

    def retimed(name: str) -> None:
        t = time.perf_counter()
        p = profile_workspace(ws, ProfileConfig(use_cache=False))
        assert p.ok, p.message
        record(name, time.perf_counter() - t)
        newest = max((scratch / "cache" / "baselines").glob("*.json"), key=lambda f: f.stat().st_mtime)
        cc = json.loads(newest.read_text()).get("compile_cache") or {}
        compile_cache.setdefault(name, []).append(cc)
        if cc.get("compile_s") is not None:
            record(f"  of which torch.compile's first call{name.split('torch.compile)')[1]}", cc["compile_s"])
        print(f"{'':60s} inductor cache: {cc}", flush=True)

    for _ in range(args.repeats):
        for mode, env in MODES.items():
            for k in ("CUDA_AGENT_CONFINE", "CUDA_AGENT_LIMITS"):
                os.environ.pop(k, None)
            os.environ.update(env)
            t = time.perf_counter()
            v = verify_workspace(ws)
            assert v.ok, v.message
            record(f"verify, {mode}", time.perf_counter() - t)
            record(f"  candidate worker confining itself, {mode}", v.phases.get("candidate_confine", 0.0))
            notes[mode] = v.sandbox_notes
            if mode == "confined":
                shutil.rmtree(scratch / "cache" / "compile", ignore_errors=True)
                retimed("profile, baseline timed again (torch.compile), confined, compile cache emptied")
                # Inductor's graphs and kernels gone, its precompiled header (under compile/tmp) kept: a task
                # this machine has not compiled yet
                shutil.rmtree(scratch / "cache" / "compile" / "inductor", ignore_errors=True)
                # and Triton's compiled kernels (CUDA), keeping its driver and launcher modules
                for d in (scratch / "cache" / "compile" / "triton").glob("*"):
                    if any(d.glob("*.cubin")):
                        shutil.rmtree(d, ignore_errors=True)
                retimed("profile, baseline timed again (torch.compile), confined, new task (header warm)")
                retimed("profile, baseline timed again (torch.compile), confined, compile cache warm")
            else:
                retimed(f"profile, baseline timed again (torch.compile), {mode}")
            t = time.perf_counter()
            p = profile_workspace(ws)
            assert p.ok, p.message
            record(f"profile, cached baseline, {mode}", time.perf_counter() - t)
    summary = {k: {"median_s": statistics.median(v), "runs": v} for k, v in rows.items()}
    Path(args.out).write_text(json.dumps({"task": args.task, "backend": args.backend, "notes": notes,
                                          "results": summary, "compile_cache": compile_cache}, indent=2))
    print("\n| step | median (s) | runs |\n| --- | --- | --- |")
    for k, v in summary.items():
        print(f"| {k.strip()} | {v['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in v['runs'])} |")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
