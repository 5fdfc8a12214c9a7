"""What the judge's own process costs around a judgment: its imports, an MCP helper's round trip, a CLI call.

    python -m bench.judge_start --workspace WS [--repeats 5] [--pause 3] [--out judge_start.json]

WS is a compiled workspace (`cuda-agent init ...`, the solution copied in, `cuda-agent compile WS`). Each
repeat, in fresh processes of this checkout:

- import: `import sandbox.api, mcp_server.runner` in a new interpreter (seconds, and whether torch came along);
- helper: `python -m mcp_server.runner` as the MCP server starts one, a verify request on stdin at once,
  timed from the start to the reply; `overhead_s` is that minus the judge's own `duration_s`;
- prewarmed helper: the same started with CUDA_AGENT_PREWARM (as the server's pool does), the request sent
  --pause seconds later, timed from sending it to the reply;
- cli: `cuda-agent verify WS --json`, the whole command, and its overhead over `duration_s`.

There is no server template here: workers come from the user's template daemon where one is ready
(docs/judge.md; CUDA_AGENT_TEMPLATE_IDLE_S=0 turns it off) and are started by exec otherwise, so the judge's
`duration_s` may include the workers' torch import; the overheads never do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
IMPORT = ("import json, sys, time; t = time.perf_counter(); import sandbox.api, mcp_server.runner; "
          "print(json.dumps({'import_s': time.perf_counter() - t, 'torch': 'torch' in sys.modules}))")


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def time_import() -> dict[str, Any]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, env=env(), check=True)
    return {**json.loads(out.stdout), "process_s": time.perf_counter() - t}


def time_helper(ws: str, prewarm: str | None, pause: float) -> dict[str, Any]:
    extra = {"CUDA_AGENT_PREWARM": prewarm} if prewarm else {}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mcp_server.runner"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env(extra), cwd=REPO,
                            start_new_session=True)
    if prewarm:
        time.sleep(pause)  # the agent's turn
        t = time.perf_counter()
    reply, _ = proc.communicate(json.dumps({"op": "verify", "workdir": ws}).encode())
    took = time.perf_counter() - t
    r = json.loads(reply)
    assert r["ok"] and r["result"]["ok"], r
    judge = r["result"]["duration_s"]
    return {"total_s": took, "judge_s": judge, "overhead_s": took - judge}


def time_cli(ws: str) -> dict[str, Any]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cuda_agent", "verify", ws, "--json"], capture_output=True,
                         text=True, env=env(), cwd=REPO)
    took = time.perf_counter() - t
    r = json.loads(out.stdout)
    assert out.returncode == 0 and r["ok"], out.stdout[-2000:] + out.stderr[-2000:]
    return {"total_s": took, "judge_s": r["duration_s"], "overhead_s": took - r["duration_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace", required=True, help="a compiled workspace")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds a prewarmed helper waits for its request")
    ap.add_argument("--prewarm-device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default="judge_start.json")
    args = ap.parse_args()
    ws = str(Path(args.workspace).resolve())
    runs: dict[str, list[dict[str, Any]]] = {"import": [], "helper": [], "prewarmed helper": [], "cli verify": []}
    for i in range(args.repeats):
        runs["import"].append(time_import())
        runs["helper"].append(time_helper(ws, None, args.pause))
        runs["prewarmed helper"].append(time_helper(ws, args.prewarm_device, args.pause))
        runs["cli verify"].append(time_cli(ws))
        print(i, json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    summary = {k: {f: median(r[f] for r in v) for f in v[0] if f != "torch"} for k, v in runs.items()}
    summary["import"]["torch_imported"] = any(r["torch"] for r in runs["import"])
    Path(args.out).write_text(json.dumps({"workspace": ws, "repeats": args.repeats, "pause_s": args.pause,
                                          "medians": summary, "runs": runs}, indent=2))
    print("\n| step | median (s) | of which beyond the judge's duration_s |\n| --- | --- | --- |")
    print(f"| import sandbox.api, mcp_server.runner (torch: {summary['import']['torch_imported']}) | "
          f"{summary['import']['import_s']:.2f} | |")
    for k in ("helper", "prewarmed helper", "cli verify"):
        print(f"| {k} | {summary[k]['total_s']:.2f} | {summary[k]['overhead_s']:.2f} |")


if __name__ == "__main__":
    main()
