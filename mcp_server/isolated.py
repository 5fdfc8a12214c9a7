"""Run one sandbox operation in a helper process that a cancelled or overdue call can kill whole."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, Process

from mcp_server.config import TOKEN_ENV
from mcp_server.runner import PARENT_ENV, PREWARM_ENV
from sandbox.confinement import proctree, template

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_MAX_REPLY = 64 << 20
_STDERR_TAIL = 16 << 10
_STOP_GRACE_S = 5.0


class HelperError(Exception):
    """The operation did not produce a result. kind: input (the caller's mistake), internal, timeout."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def helper_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # the sandbox forwards CUDA_AGENT_* to the candidate's processes: never the server's token
    env.pop(TOKEN_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())
    env.update(overrides or {})
    return env


async def _drain(stream: ByteReceiveStream | None, buf: bytearray, cap: int, keep_tail: bool) -> None:
    if stream is None:
        return
    async for chunk in stream:
        if keep_tail:
            buf += chunk
            del buf[: max(0, len(buf) - cap)]
        elif len(buf) <= cap:
            # past the cap the reply is dropped (it will not parse); keep reading so the helper can exit
            buf += chunk


async def _stop(proc: Process) -> None:
    """Stop a cancelled or overdue helper and everything it started, ninja and workers included.

    Asked politely first, because the helper (a subreaper) can then also collect its dead children;
    forced if it does not exit in time.
    """
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    with anyio.move_on_after(_STOP_GRACE_S):
        await proc.wait()
    if proc.returncode is None:
        proctree.kill_tree(proc.pid)
        await proc.wait()


def _how_it_ended(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


async def _open_helper(env: dict[str, str] | None) -> Process:
    # a channel to the server's template, if it has one: the helper's workers are forked from it
    fd = template.new_channel_fd()
    channel = {template.CHANNEL_ENV: str(fd)} if fd is not None else {}
    try:
        return await anyio.open_process([sys.executable, "-m", "mcp_server.runner"], env=helper_env({**(env or {}),
                                        **channel}), start_new_session=True, cwd=_PACKAGE_ROOT,
                                        pass_fds=(fd,) if fd is not None else ())
    finally:
        if fd is not None:
            os.close(fd)


class HelperPool:
    """Helpers per device environment started before their calls, their torch workers already warm: up to `depth`
    of them each (ServerConfig.warm_helpers).

    A verify or profile otherwise waits for two fresh processes to import torch, or, forked from the server's
    template, to open the device (0.2-0.5 s alone, 2-5 s each with sixteen judgments starting on one H100). Each
    helper still serves exactly one call and is then gone, so the isolation is unchanged.
    """

    def __init__(self, depth: int = 1) -> None:
        self.depth = max(1, depth)
        self._ready: dict[tuple, list[Process]] = {}
        self._starting: dict[tuple, int] = {}  # helpers being started: calls that end together top up once

    @staticmethod
    def _key(env: dict[str, str] | None, warm_device: str) -> tuple:
        return (warm_device, tuple(sorted((env or {}).items())))

    def ready(self, env: dict[str, str] | None, warm_device: str) -> int:
        """How many helpers wait for this device environment (those that died waiting dropped)."""
        waiting = self._ready.get(self._key(env, warm_device), [])
        waiting[:] = [p for p in waiting if p.returncode is None]
        return len(waiting)

    async def prefill(self, env: dict[str, str] | None, warm_device: str) -> None:
        """Start helpers now (a workspace just opened, a build began) until `depth` wait, so that even the first
        verify of a burst finds one warm."""
        key = self._key(env, warm_device)
        while self.ready(env, warm_device) + self._starting.get(key, 0) < self.depth:
            self._starting[key] = self._starting.get(key, 0) + 1  # counted before the await: no overshoot
            try:
                proc = await _open_helper({**(env or {}), PREWARM_ENV: warm_device})
            finally:
                self._starting[key] -= 1
            self._ready.setdefault(key, []).append(proc)

    async def take(self, env: dict[str, str] | None, warm_device: str) -> Process:
        """A waiting helper, the longest waiting first (the readiest), or a fresh one. Replacements are started by
        the caller after its call (prefill), so that they import torch during the agent's turn rather than
        competing with the call."""
        if self.ready(env, warm_device):
            return self._ready[self._key(env, warm_device)].pop(0)
        return await _open_helper(env)

    def close(self) -> None:
        for waiting in self._ready.values():
            for proc in waiting:
                if proc.returncode is None:
                    try:
                        proc.send_signal(signal.SIGTERM)  # the helper takes its warm workers down with it
                    except ProcessLookupError:
                        pass
        self._ready.clear()


async def run_in_helper(request: dict[str, Any], *, limit_s: float, env: dict[str, str] | None = None,
                        pool: HelperPool | None = None, warm_device: str | None = None) -> dict[str, Any]:
    """The operation's result (a JSON-ready dict), or HelperError. Cancellation kills the whole tree."""
    if pool is not None and warm_device is not None:
        proc = await pool.take(env, warm_device)
    else:
        proc = await _open_helper(env)
    try:
        return await _serve_one(proc, request, limit_s)
    finally:
        if pool is not None and warm_device is not None:
            with anyio.CancelScope(shield=True):
                await pool.prefill(env, warm_device)


async def _serve_one(proc: Process, request: dict[str, Any], limit_s: float) -> dict[str, Any]:
    out, err = bytearray(), bytearray()
    try:
        assert proc.stdin is not None
        await proc.stdin.send(json.dumps(request).encode())
        await proc.stdin.aclose()
        with anyio.move_on_after(limit_s) as deadline:
            async with anyio.create_task_group() as io:
                io.start_soon(_drain, proc.stdout, out, _MAX_REPLY, False)
                io.start_soon(_drain, proc.stderr, err, _STDERR_TAIL, True)
            await proc.wait()
        if deadline.cancelled_caught:
            raise HelperError("timeout", f"did not finish within the server's {limit_s:g} s limit and was stopped")
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                await _stop(proc)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    await stream.aclose()
    try:
        reply = json.loads(out)
    except ValueError:
        tail = err.decode(errors="replace").strip()[-2000:]
        how = _how_it_ended(proc.returncode)
        raise HelperError("internal", f"the sandbox helper {how} without a result"
                          + (f":\n{tail}" if tail else "")) from None
    if not reply.get("ok"):
        raise HelperError(reply.get("kind", "internal"), reply.get("error", "unknown error"))
    return reply["result"]
