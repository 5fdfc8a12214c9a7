"""Who may use which device when: GPU slots for verify/profile, a limit on concurrent compiles.

profile holds a device exclusively, because anything else on it would disturb the timings.
verify shares a device with other verifies but never with a profile. Waiters are served in
arrival order; an exclusive waiter that cannot start yet reserves the least busy device, so a
stream of verifies cannot starve a profile.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio

from sandbox.backend import visible_gpus  # noqa: F401 (the server's and harness's name for it)

OnQueued = Callable[[str], Awaitable[None]]


@dataclass(eq=False)
class Device:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    exclusive: str | None = None
    shared: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.exclusive:
            return f"{self.name}: {self.exclusive}"
        if self.shared:
            return f"{self.name}: {', '.join(self.shared)}"
        return f"{self.name}: idle"


@dataclass(eq=False)
class _Waiter:
    exclusive: bool
    label: str
    event: anyio.Event
    granted: Device | None = None


class DevicePool:
    def __init__(self, devices: list[Device]):
        self.devices = devices
        self._waiters: list[_Waiter] = []

    @classmethod
    def for_gpus(cls, gpus: list[str]) -> DevicePool:
        if not gpus:
            return cls([Device("gpu")])
        return cls([Device(f"gpu{g}", {"CUDA_VISIBLE_DEVICES": g}) for g in gpus])

    def describe(self) -> str:
        return "; ".join(d.describe() for d in self.devices)

    def _fits(self, d: Device, w: _Waiter, reserved: set[str]) -> bool:
        if d.exclusive is not None or d.name in reserved:
            return False
        return not (w.exclusive and d.shared)

    def _dispatch(self) -> None:
        reserved: set[str] = set()
        for w in list(self._waiters):
            fits = [d for d in self.devices if self._fits(d, w, reserved)]
            if fits:
                d = min(fits, key=lambda d: len(d.shared))
                if w.exclusive:
                    d.exclusive = w.label
                else:
                    d.shared.append(w.label)
                w.granted = d
                self._waiters.remove(w)
                w.event.set()
            elif w.exclusive:
                free = [d for d in self.devices if d.name not in reserved]
                if free:
                    reserved.add(min(free, key=lambda d: (d.exclusive is not None, len(d.shared))).name)

    def _release(self, w: _Waiter) -> None:
        d = w.granted
        if d is None:
            return
        if w.exclusive:
            d.exclusive = None
        else:
            d.shared.remove(w.label)
        w.granted = None
        self._dispatch()

    @asynccontextmanager
    async def use(self, *, exclusive: bool, label: str, on_queued: OnQueued) -> AsyncIterator[Device]:
        w = _Waiter(exclusive, label, anyio.Event())
        self._waiters.append(w)
        self._dispatch()
        try:
            if w.granted is None:
                await on_queued(f"queued for a device ({self.describe()})")
                await w.event.wait()
        except BaseException:
            if w in self._waiters:
                self._waiters.remove(w)
            self._release(w)
            raise
        assert w.granted is not None
        try:
            yield w.granted
        finally:
            self._release(w)


class ClientQuota:
    """At most `limit` calls of one kind per client (a token's principal; None over stdio) at once; more wait.

    Taken before the shared resource (a compile slot, a device), so a client at its quota queues behind its own
    calls and leaves the shared slots to the others; waiters of one client are served in arrival order.
    """

    def __init__(self, limit: int | None, what: str):
        self.limit = limit
        self.what = what
        self._held: dict[str | None, anyio.Semaphore] = {}  # one per principal: bounded by the tokens

    @asynccontextmanager
    async def hold(self, owner: str | None, on_queued: OnQueued) -> AsyncIterator[None]:
        if self.limit is None:
            yield
            return
        sem = self._held.setdefault(owner, anyio.Semaphore(self.limit))
        if sem.value < 1:
            await on_queued(f"queued: your client has {self.limit} {self.what} running, its limit; this one "
                            "starts when one of them ends")
        async with sem:
            yield


class Scheduler:
    """One per server; its anyio primitives are made on first use, inside the event loop."""

    def __init__(self, max_compiles: int, gpus: list[str], compiles_per_client: int | None = None,
                 judgments_per_client: int | None = None):
        self.max_compiles = max_compiles
        self.gpu_pool = DevicePool.for_gpus(gpus)
        # CPU timing is disturbed by anything else on the CPU side too; one slot serialises profiles
        self.cpu_pool = DevicePool([Device("cpu")])
        self._compiles: anyio.CapacityLimiter | None = None
        self.client_compiles = ClientQuota(compiles_per_client, "compiles")
        self.client_judgments = ClientQuota(judgments_per_client, "verify/profile calls")

    def pool(self, backend: str) -> DevicePool:
        return self.gpu_pool if backend == "cuda" else self.cpu_pool

    @asynccontextmanager
    async def compile_slot(self, on_queued: OnQueued, owner: str | None = None) -> AsyncIterator[None]:
        async with self.client_compiles.hold(owner, on_queued):
            if self._compiles is None:
                self._compiles = anyio.CapacityLimiter(self.max_compiles)
            if self._compiles.available_tokens < 1:
                await on_queued(f"queued: {self._compiles.borrowed_tokens} compiles running "
                                f"(at most {self.max_compiles} at once)")
            async with self._compiles:
                yield

    @asynccontextmanager
    async def judgment_slot(self, backend: str, owner: str | None, *, exclusive: bool, label: str,
                            on_queued: OnQueued) -> AsyncIterator[Device]:
        """A device for a verify or profile, within the client's quota of them."""
        async with self.client_judgments.hold(owner, on_queued):
            async with self.pool(backend).use(exclusive=exclusive, label=label, on_queued=on_queued) as dev:
                yield dev
