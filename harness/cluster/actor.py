"""The judge actor: one `cuda-agent serve` (stdio) on the actor's node, and the MCP client that talks to it.

An async Ray actor, so the calls of many episodes interleave on one server as they do on a local stdio
server. Every call names the incarnation it was opened against: a restarted actor (Ray's max_restarts) or
a respawned server has none of the old workspaces, and a call meant for them answers `stale` instead of
reaching a server that would take an unknown workspace id for the model's mistake.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

JUDGE_TOOLS = ("compile", "verify", "profile")


class ToolServerActor:
    def __init__(self, backend: str | None, max_workspaces: int, max_compiles: int | None,
                 extra_args: list[str], startup_timeout_s: float = 120.0):
        self.backend, self.max_workspaces, self.max_compiles = backend, max_workspaces, max_compiles
        self.extra_args, self.startup_timeout_s = list(extra_args), startup_timeout_s
        self.incarnation = uuid.uuid4().hex
        self.server: Any = None
        self.calls: Counter[str] = Counter()
        self.in_flight = 0
        self.started_at = time.time()
        self.log_dir = tempfile.mkdtemp(prefix="cuda-agent-judge-")
        self._lock: asyncio.Lock | None = None
        self._stop: asyncio.Event | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._error: str | None = None

    async def _keep(self, ready: asyncio.Event, stop: asyncio.Event) -> None:
        from harness.mcp_tools import serve_args, spawn_stdio_server

        args = serve_args(self.backend, None, None, self.max_workspaces, self.max_compiles, self.extra_args)
        try:
            with open(os.path.join(self.log_dir, "serve.log"), "a") as errlog:
                async with spawn_stdio_server("ray", args, errlog, None, self.startup_timeout_s) as server:
                    self.server = server
                    ready.set()
                    await stop.wait()
        except Exception as e:  # noqa: BLE001  (reported by the call that needed the server)
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self.server = None
            ready.set()

    async def _ensure(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.server is not None:
                return
            ready, self._stop = asyncio.Event(), asyncio.Event()
            self._error = None
            self._keeper = asyncio.get_running_loop().create_task(self._keep(ready, self._stop))
            await ready.wait()
            if self.server is None:
                raise RuntimeError(f"the judge's MCP server did not start (log {self.log_dir}/serve.log): "
                                   f"{self._error}")

    def _drop(self) -> None:
        """The server broke: a later call starts a new one, as a new incarnation."""
        if self._stop is not None:
            self._stop.set()
        self.server = None
        self.incarnation = uuid.uuid4().hex

    async def info(self) -> dict[str, Any]:
        import ray

        await self._ensure()
        ctx = ray.get_runtime_context()
        return {"incarnation": self.incarnation, "node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id(),
                "node_ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "pid": os.getpid(), "log_dir": self.log_dir, "started_at": self.started_at,
                "tools": [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in self.server.tools]}

    def stats(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "calls": dict(self.calls), "in_flight": self.in_flight,
                "judge_calls": sum(self.calls[t] for t in JUDGE_TOOLS), "up_s": time.time() - self.started_at}

    async def call(self, incarnation: str, name: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        from harness.mcp_tools import ToolServerError

        if incarnation != self.incarnation:
            return {"stale": self.incarnation}
        try:
            await self._ensure()
        except RuntimeError as e:
            return {"server_error": str(e)}
        self.in_flight += 1
        try:
            outcome = await self.server.call(name, args, timeout_s)
        except ToolServerError as e:
            self._drop()
            return {"server_error": str(e)}
        finally:
            self.in_flight -= 1
        self.calls[name] += 1
        return {"outcome": outcome.model_dump(mode="json")}

    async def run(self, fn: Any, *args: Any) -> Any:
        """A judgment that is not an MCP call (train warmup's, synth's): `fn(*args)` on this actor's node,
        in a thread so the server's calls go on."""
        self.in_flight += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.in_flight -= 1
            self.calls["run"] += 1

    async def shutdown(self) -> None:
        self._drop()
        if self._keeper is not None:
            await asyncio.wait([self._keeper], timeout=30)
