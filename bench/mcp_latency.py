"""What an agent waits for: compile, verify, profile and a rebuild after an edit as MCP tool calls.

    python -m bench.mcp_latency --out mcp_latency.json [--pause 3] [--worker-start fork|exec|both]

Starts the real server (`cuda-agent serve`, stdio) once per setting (prewarm or not; workers forked from
the server's template or started by exec, CUDA_AGENT_FORK), opens a KernelBench task
through the SDK's client, writes the solution with write_file and times each tool call from the
client's side, pausing between calls as an agent's turn would. Both settings share one baseline
cache, filled by an untimed profile first, so every timed profile is a cached-baseline one.

Each call also records the judge's own `duration_s` from its result; the difference (`overhead_s`) is
what the server's path costs: the helper process, its imports, the request and the reply. A profile
that the machine was too noisy to score (`timing_noisy`, common on a loaded CPU) still measures that
path, so it is recorded (marked) rather than ending the run; a profile that found eager drifted from
the cached baseline and timed the baseline again is recorded in a row of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


async def call(client: Client, tool: str, args: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    r = await client.call_tool(tool, args)
    took = time.perf_counter() - t
    if r.is_error:
        raise RuntimeError(f"{tool}: {r.content[0].text}")
    return r.structured_content or {}, took


def profiled(p: dict[str, Any]) -> bool:
    """A profile that measured (ok), or one the machine was too noisy to score: both went the whole way."""
    return p["ok"] or p.get("reason") == "timing_noisy"


async def session(args: argparse.Namespace, prewarm: bool, start: str, root: Path, env: dict[str, str],
                  rows: dict[str, list[float]], judge: dict[str, list[float]], fill_baseline: bool) -> None:
    flag = "--prewarm" if prewarm else "--no-prewarm"
    label = ("prewarm" if prewarm else "no prewarm") + f", {start}"
    env = {**env, "CUDA_AGENT_FORK": "on" if start == "fork" else "off"}
    params = StdioServerParameters(command=sys.executable, args=["-m", "cuda_agent", "serve", flag, "--root",
                                                                 str(root / label.replace(" ", "_").replace(",", ""))],
                                   env=env, cwd=str(REPO))

    def record(name: str, seconds: float, extra: str = "", result: dict[str, Any] | None = None) -> None:
        rows.setdefault(f"{name}, {label}", []).append(seconds)
        took = (result or {}).get("duration_s")
        if took is not None:
            judge.setdefault(f"{name}, {label}", []).append(took)
            extra = f"judge {took:.2f} s, overhead {seconds - took:.2f} s " + extra
        print(f"{name + ', ' + label:45s} {seconds:7.2f} s {extra}", flush=True)

    async with Client(params) as client:
        spec = ({"source": Path(args.task_file).read_text(), "name": Path(args.task_file).stem} if args.task_file
                else {"task": args.task})  # a file: where the KernelBench suite is not installed (a bare device)
        opened, took = await call(client, "open_task", spec)
        record("open_task", took)
        ws = opened["workspace_id"]
        folder = Path(args.solution)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                await call(client, "write_file", {"workspace_id": ws, "path": path.relative_to(folder).as_posix(),
                                                  "content": path.read_text()})
        c, took = await call(client, "compile", {"workspace_id": ws})
        assert c["ok"], c
        record("compile", took, result=c)
        if fill_baseline:  # fills the baseline cache for all sessions; not timed
            p, took = await call(client, "profile", {"workspace_id": ws})
            assert profiled(p), p
            print(f"first profile (baseline + torch.compile) {took:.2f} s", flush=True)
        for _ in range(args.repeats):
            await anyio.sleep(args.pause)
            v, took = await call(client, "verify", {"workspace_id": ws})
            assert v["ok"], v
            record("verify", took, str({k: round(x, 2) for k, x in v["phases"].items()}), v)
        for _ in range(args.repeats):
            await anyio.sleep(args.pause)
            p, took = await call(client, "profile", {"workspace_id": ws})
            assert profiled(p), p
            noisy = "" if p["ok"] else "(timing_noisy) "
            # eager drifted from the cached baseline: the profile timed the baseline again (its own row)
            name = "profile, cached baseline" if p["baseline_cached"] else "profile, baseline re-timed"
            record(name, took, noisy + str({k: round(x, 2) for k, x in p.get("phases", {}).items()}), p)
        # an agent's edit of one kernel, then its rebuild
        kernel = next(p for p in sorted(folder.rglob("*")) if p.suffix in (".cu", ".cpp") and "binding" not in p.name)
        for i in range(args.repeats):
            await anyio.sleep(args.pause)
            await call(client, "write_file", {"workspace_id": ws, "path": kernel.relative_to(folder).as_posix(),
                                              "content": kernel.read_text() + f"\n// edit {i}\n"})
            c, took = await call(client, "compile", {"workspace_id": ws})
            assert c["ok"] and not c.get("up_to_date"), c
            record("rebuild after an edit", took, result=c)


async def amain(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="cuda-agent-mcp-bench-"))
    env = {**os.environ, "CUDA_AGENT_CACHE": str(scratch / "cache")}
    rows: dict[str, list[float]] = {}
    judge: dict[str, list[float]] = {}
    starts = ("exec", "fork") if args.worker_start == "both" else (args.worker_start,)
    first = True
    for start in starts:
        for prewarm in (False, True):
            await session(args, prewarm, start, scratch, env, rows, judge, fill_baseline=first)
            first = False
    summary: dict[str, dict[str, Any]] = {}
    for k, v in rows.items():
        summary[k] = {"median_s": median(v), "runs": v}
        if len(judge.get(k, [])) == len(v):
            over = [a - b for a, b in zip(v, judge[k], strict=True)]
            summary[k].update(judge_s=judge[k], overhead_s=over, median_overhead_s=median(over))
    Path(args.out).write_text(json.dumps({"task": args.task, "pause_s": args.pause, "worker_start": starts,
                                          "results": summary}, indent=2))
    print("\n| tool call | median (s) | overhead beyond the judge's duration_s, median (s) | runs |\n"
          "| --- | --- | --- | --- |")
    for k, v in summary.items():
        over = f"{v['median_overhead_s']:.2f}" if "median_overhead_s" in v else ""
        print(f"| {k} | {v['median_s']:.2f} | {over} | {len(v['runs'])} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="kernelbench/level1/19_ReLU")
    ap.add_argument("--task-file", default=None, help="instead of --task: a task file, opened by its source")
    ap.add_argument("--solution", default=str(HERE / "solutions" / "relu"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pause", type=float, default=10.0, help="seconds between calls (an agent's turn)")
    ap.add_argument("--worker-start", choices=("fork", "exec", "both"), default="both",
                    help="workers forked from the server's template, started by exec, or both in turn")
    ap.add_argument("--out", default="mcp_latency.json")
    anyio.run(amain, ap.parse_args())


if __name__ == "__main__":
    main()
