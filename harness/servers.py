"""The tool servers of a run: started (stdio, one per GPU) or connected (HTTP), and shared fairly.

A stdio server per GPU, each told to use only its GPU, bounds how many episodes share a device;
the server itself still queues verify and profile calls on it (profiles get the GPU alone).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from harness.config import ToolServerConfig
from harness.mcp_tools import ToolServer, connect_http_server, serve_args, spawn_stdio_server
from sandbox.backend import resolve_backend


class ToolServerStartError(RuntimeError):
    """A tool server could not be started or reached; the message says which and why."""


def _leaf_messages(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_leaf_messages(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"


class NoServerLeft(RuntimeError):
    """Every tool server of the run went away; the message names them and why."""


class ServerPool:
    """Hands each episode the least loaded server that has room; a server marked lost gets no more."""

    def __init__(self, servers: list[ToolServer], capacity: int | None):
        if not servers:
            raise ValueError("no tool servers")
        self.servers = servers
        self.capacity = capacity
        self.load = {s.alias: 0 for s in servers}
        self.lost: dict[str, str] = {}  # alias -> what broke
        self._cond = anyio.Condition()

    def alive(self) -> list[ToolServer]:
        return [s for s in self.servers if s.alias not in self.lost]

    async def mark_lost(self, server: ToolServer, why: str) -> None:
        async with self._cond:
            self.lost.setdefault(server.alias, why[:500])
            self._cond.notify_all()

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[ToolServer]:
        async with self._cond:
            while True:
                if not self.alive():
                    raise NoServerLeft("every tool server went away: " + "; ".join(
                        f"{a} ({w})" for a, w in self.lost.items()))
                free = [s for s in self.alive() if self.capacity is None or self.load[s.alias] < self.capacity]
                if free:
                    server = min(free, key=lambda s: self.load[s.alias])
                    self.load[server.alias] += 1
                    break
                await self._cond.wait()
        try:
            yield server
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self.load[server.alias] -= 1
                    self._cond.notify_all()


@asynccontextmanager
async def hosted(connection: Any) -> AsyncIterator[ToolServer]:
    """Holds one server's connection in a task of its own. An MCP client runs background work (the HTTP
    transport's streams) in a task group around whatever runs inside it; if that work fails because the
    host went away, the failure would cancel the whole run. Here it ends the keeper task only, and calls
    to that server fail as tool_server_error, which the rollout answers by running the episode elsewhere."""
    ready, stop = anyio.Event(), anyio.Event()
    box: dict[str, Any] = {}

    async def keeper() -> None:
        try:
            async with connection as server:
                box["server"] = server
                ready.set()
                await stop.wait()
        except Exception as e:  # noqa: BLE001  (a lost host's connection errors, reported where they matter)
            box.setdefault("error", e)
            ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper)
        await ready.wait()
        if "server" not in box:
            raise box["error"]
        try:
            yield box["server"]
        finally:
            stop.set()


def _visible_gpus() -> list[str]:
    from mcp_server.scheduling import visible_gpus

    return visible_gpus()


@asynccontextmanager
async def open_servers(cfg: ToolServerConfig, backend: str | None, concurrency: int,
                       log_dir: Path) -> AsyncIterator[list[ToolServer]]:
    if cfg.ray:  # judge actors on a Ray cluster (harness.cluster); the rest of the run is the same
        from harness.cluster.pool import open_ray_servers

        async with open_ray_servers(cfg, backend, concurrency) as ray_servers:
            yield ray_servers
        return
    async with AsyncExitStack() as stack:
        servers: list[ToolServer] = []
        if cfg.urls:
            token = cfg.resolved_token()
            for i, url in enumerate(cfg.urls):
                try:
                    servers.append(await stack.enter_async_context(
                        hosted(connect_http_server(f"http{i}", url, token, cfg.startup_timeout_s))))
                except Exception as e:
                    raise ToolServerStartError(f"cannot use the MCP server at {url} (is it running, and is the "
                                               f"token right?): {_leaf_messages(e)}") from None
        else:
            backend = resolve_backend(backend)
            gpus: list[str | None] = list(cfg.gpus if cfg.gpus is not None else
                                          (_visible_gpus() if backend == "cuda" else []))
            if backend == "cpu" or not gpus:
                gpus = [None]
            per_server = min(cfg.episodes_per_server or concurrency, concurrency)
            # several servers on one machine share its cores for compiles
            compiles = max(1, (os.cpu_count() or 1) // len(gpus)) if len(gpus) > 1 else None
            log_dir.mkdir(parents=True, exist_ok=True)
            for gpu in gpus:
                alias = f"gpu{gpu}" if gpu is not None else backend
                errlog = stack.enter_context(open(log_dir / f"mcp-{alias}.log", "a"))
                root = cfg.root / alias if cfg.root is not None else None
                args = serve_args(backend, root, gpu, per_server + 2, compiles, cfg.extra_args)
                try:
                    servers.append(await stack.enter_async_context(
                        hosted(spawn_stdio_server(alias, args, errlog, gpu, cfg.startup_timeout_s))))
                except Exception as e:
                    raise ToolServerStartError(f"the MCP server `{' '.join(args[2:])}` did not start (its log: "
                                               f"{log_dir / f'mcp-{alias}.log'}): {_leaf_messages(e)}") from None
        yield servers
