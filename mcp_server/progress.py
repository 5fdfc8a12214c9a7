"""Progress notifications for long calls: what the call is doing (queued, running), on a heartbeat.

Clients that reset their request timeout on progress (and people watching) see a live call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from mcp.server.mcpserver import Context


class Progress:
    def __init__(self, ctx: Context | None, interval_s: float):
        self._ctx = ctx
        self._interval_s = interval_s
        self._t0 = time.monotonic()
        self._last = -1.0
        self.status = "starting"

    async def set(self, status: str) -> None:
        self.status = status
        await self._send()

    async def _send(self) -> None:
        if self._ctx is None:
            return
        elapsed = time.monotonic() - self._t0
        # progress must grow with every notification
        value = max(round(elapsed, 3), self._last + 0.001)
        self._last = value
        try:
            await self._ctx.report_progress(value, None, f"{self.status} ({elapsed:.0f} s)")
        except Exception:  # a courtesy: a client that went away must not fail the call
            pass

    async def _beat(self) -> None:
        while True:
            await anyio.sleep(self._interval_s)
            await self._send()

    @asynccontextmanager
    async def heartbeat(self) -> AsyncIterator[Progress]:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._beat)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # _beat never raises, so the group wraps only the call's own error (a ToolError, say):
            # unwrapped, the SDK reports it to the model instead of treating it as a crash
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
