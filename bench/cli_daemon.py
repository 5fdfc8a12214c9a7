"""The CLI's cold verify, before and after the user's template daemon (docs/judge.md), call after call.

    python -m bench.cli_daemon WORKSPACE [--rounds 3] [--calls 4] [--pause 0] [--out cli_daemon.json]

WORKSPACE: a compiled workspace (`cuda-agent init ... && cuda-agent compile ...`). Each round stops this
user's daemons, then runs `cuda-agent verify --json` as separate processes: once with CUDA_AGENT_FORK=off
(every worker by exec: the CLI as it was), then --calls times with the default settings, --pause seconds
apart, starting with no daemon (the first call starts one and runs by exec; later calls fork once it is
ready). Each call's wall time from the shell's side, the judge's own duration, and whether its workers
were forked (the `import_torch` phase is 0 only then).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cuda_agent(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cuda_agent", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def verify(ws: str, **extra: str) -> dict:
    env = {**os.environ, **extra}
    t = time.perf_counter()
    r = cuda_agent("verify", ws, "--json", env=env)
    wall = time.perf_counter() - t
    res = json.loads(r.stdout)
    phases = res.get("phases", {})
    return {"wall_s": round(wall, 3), "judge_s": round(res.get("duration_s", 0.0), 3), "ok": res.get("ok"),
            "forked": phases.get("import_torch") == 0, "worker_wait": round(phases.get("worker_wait", -1), 3),
            "load": float(Path("/proc/loadavg").read_text().split()[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workspace")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    rounds = []
    for i in range(args.rounds):
        cuda_agent("judge-daemon", "stop")
        row = {"exec": verify(args.workspace, CUDA_AGENT_FORK="off"), "calls": []}
        for _ in range(args.calls):
            row["calls"].append(verify(args.workspace))
            time.sleep(args.pause)
        rounds.append(row)
        calls = "  ".join(f"{c['wall_s']:.2f}{'F' if c['forked'] else 'E'}" for c in row["calls"])
        print(f"round {i + 1}: exec {row['exec']['wall_s']:.2f}  default {calls}  (F forked, E exec; load "
              f"{row['exec']['load']:.1f}-{max(c['load'] for c in row['calls']):.1f})", flush=True)
    cuda_agent("judge-daemon", "stop")
    forked = sorted(c["wall_s"] for r in rounds for c in r["calls"] if c["forked"])
    execd = sorted(r["exec"]["wall_s"] for r in rounds)
    if forked:
        print(f"median wall: exec {execd[len(execd) // 2]:.2f} s, forked {forked[len(forked) // 2]:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
