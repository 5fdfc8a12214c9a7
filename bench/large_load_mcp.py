"""bench.large_load's `mcp` mode: N MCP clients over streamable HTTP, each opening a task and calling compile, verify,
profile, against one real `cuda-agent serve --transport http` process on loopback (a library module; the entry point
is bench.large_load, which writes the solutions and records the rows)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


MCP_CALL_TIMEOUT_S = 3600.0  # a client's wait on one tool call: above the server's own limits (a profile: 1800 s)


def _mcp_server(out: Path, n: int, backend: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`cuda-agent serve --transport http` on a free loopback port with a bearer token for each of the n clients (each
    its own tenant, as n trainers would be); (process, url, tokens) once it has announced its URL on stderr."""
    from mcp_server.config import TOKEN_ENV

    tokens = [f"large-load-{i}-{secrets.token_hex(16)}" for i in range(n)]
    root = out / "mcp_root"
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "cuda_agent", "serve", "--transport", "http", "--host", "127.0.0.1", "--port", "0",
           "--backend", backend, "--root", str(root), "--max-workspaces", str(max(16, n))]
    log = out / "mcp_server.log"
    with open(log, "w") as fh:  # the tokens go in the environment, which the server clears, not on its command line
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, cwd=REPO,
                                env={**os.environ, TOKEN_ENV: ",".join(tokens)})
    deadline = time.monotonic() + 600  # it announces the URL after starting its warm helper (CUDA initialised)
    while not (m := re.search(r"MCP server on (http://\S+) ", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the MCP server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, m.group(1), tokens


async def _mcp_episode(server, client: int, name: str, kb: Path, out: Path, backend: str) -> dict:
    """One episode as an agent's client runs it: open_task (the task's source: over HTTP the server reads no task
    files), write_file per solution file, compile, verify if it built, profile if it verified, close_workspace. The
    tools report no reward: it is computed here from their results by the judge's own rule (milestone_reward)."""
    from sandbox.results import CompileResult, ProfileResult, VerifyResult
    from sandbox.reward import milestone_reward

    seconds: dict[str, float] = defaultdict(float)
    errors: dict[str, str] = {}

    async def call(tool: str, args: dict) -> dict | None:
        o = await server.call(tool, args, MCP_CALL_TIMEOUT_S)
        seconds[tool] = round(seconds[tool] + o.duration_s, 3)
        if o.is_error:
            errors[tool] = o.text[:2000]
        return None if o.is_error else o.structured or {}

    t0 = time.perf_counter()
    c = v = p = None
    opened = await call("open_task", {"source": (kb / "level1" / f"{name}.py").read_text(), "name": name,
                                      "backend": backend})
    if opened:
        ws = {"workspace_id": opened["workspace_id"]}
        folder = out / "solutions" / name
        for path in sorted(f for f in folder.rglob("*") if f.is_file()):
            if await call("write_file", {**ws, "path": path.relative_to(folder).as_posix(),
                                         "content": path.read_text()}) is None:
                break
        else:
            c = await call("compile", ws)
            v = await call("verify", ws) if c and c.get("ok") else None
            p = await call("profile", ws) if v and v.get("ok") else None
        await call("close_workspace", ws)
    r = milestone_reward(*(m.model_validate(x) if x else None
                           for m, x in ((CompileResult, c), (VerifyResult, v), (ProfileResult, p)))) if c else None
    c, v, p = c or {}, v or {}, p or {}
    return {"task": name, "client": client, "wall_s": round(time.perf_counter() - t0, 2), "seconds": dict(seconds),
            "compile_ok": c.get("ok"), "compile_s": c.get("duration_s"), "compile_reason": c.get("reason"),
            "verify_ok": bool(v.get("ok")), "verify_reason": v.get("reason"), "verify_phases": v.get("phases"),
            "verify_message": (v.get("message") or "")[:600] if v and not v.get("ok") else None,
            "profile_ok": bool(p.get("ok")), "profile_reason": p.get("reason"), "profile_phases": p.get("phases"),
            "queued_s": p.get("queued_s"), "speedup_eager": p.get("speedup_vs_eager"),
            "speedup_compile": p.get("speedup_vs_compile"),
            "profile_message": (p.get("message") or "")[:600] if p and not p.get("ok") else None,
            "reward": r and r.reward, "milestone": r and r.milestone, "errors": errors or None}


def _verdict(row: dict, step: str) -> str:
    return "ok" if row.get(f"{step}_ok") else f"{row.get(f'{step}_reason')}"


async def _mcp_clients(url: str, tokens: list[str], episodes: list[str], kb: Path, out: Path, backend: str,
                       record: Callable[[dict], None]) -> list:
    """len(tokens) clients at once, each over its own connection taking the next episode until none is left."""
    import anyio

    from harness.mcp_tools import ToolServerError, connect_http_server

    rows: list[dict] = []
    todo = list(episodes)

    async def client(i: int, token: str) -> None:
        async with connect_http_server(f"client{i}", url, token) as server:
            while todo:
                name = todo.pop(0)
                try:
                    row = await _mcp_episode(server, i, name, kb, out, backend)
                except ToolServerError as e:  # the connection broke: this client's run ends here
                    row = {"task": name, "client": i, "errors": {"connection": str(e)[:2000]}}
                rows.append(row)
                record(row)
                print(f"mcp client {i} {name}: reward {row.get('reward')} {row.get('milestone')} in "
                      f"{row.get('wall_s')} s; verify {_verdict(row, 'verify')}; profile {_verdict(row, 'profile')} "
                      f"x{row.get('speedup_eager')} eager, queued {round(row.get('queued_s') or 0, 2)} s; "
                      f"calls {row.get('seconds')}"
                      + (f"; errors {row['errors']}"[:800] if row.get("errors") else ""), flush=True)
                if "connection" in (row.get("errors") or {}):
                    return

    async with anyio.create_task_group() as tg:
        for i, token in enumerate(tokens):
            tg.start_soon(client, i, token)
    return rows


def run_mcp(kb: Path, out: Path, names: list[str], n: int, k: int, backend: str,
            record: Callable[[dict], None]) -> None:
    """n clients judge every task k times (len(names) * k episodes, as eval's -k) through the MCP tools of one
    server; each episode's row goes to `record`; a SUMMARY line is printed. The solutions: OUT/solutions/<task>/."""
    import anyio

    t0 = time.perf_counter()
    proc, url, tokens = _mcp_server(out, n, backend)
    print(f"mcp server at {url} after {time.perf_counter() - t0:.1f} s; {n} clients, {len(names) * k} episodes",
          flush=True)
    episodes = [name for _ in range(k) for name in names]  # every task once a round, like eval's -k
    t_all = time.perf_counter()
    try:
        rows = anyio.run(_mcp_clients, url, tokens, episodes, kb, out, backend, record)
    finally:
        proc.terminate()  # the server closes its workspaces and stops its helpers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    total = time.perf_counter() - t_all
    scored = sum(bool(r.get("verify_ok") and (r.get("reward") or 0) >= 1) for r in rows)
    print(f"SUMMARY mcp {n} clients: {scored}/{len(episodes)} scored, {len(rows) / total * 60:.1f} judgments a "
          f"minute ({total:.0f} s)", flush=True)
    if proc.returncode:
        print(f"mcp server exit status {proc.returncode}:\n{(out / 'mcp_server.log').read_text()[-3000:]}", flush=True)
