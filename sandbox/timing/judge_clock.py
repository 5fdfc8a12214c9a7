"""The judge's clock around a timing's requests, read in a process of its own (sandbox/timing/clock_process.py).

A stream batch of a small kernel is scored by the judge's clock around its request (timing_bound.Run.batch): the
wall time from the request to the reply, less the round trip. Read in the judge's thread, that clock also counted
the wait for the GIL once the reply had come, whenever another of the judge's threads was running Python (a
build's scans, another judgment's results, a trainer's own work): up to the 5 ms switch interval, on batches of a
few milliseconds, and on either side of a pairing. A 1.7 ms request read 6.9 ms beside one busy thread.

So while a timing runs, its workers' timed requests (each batch, and the round-trip probes taken off them) go
through a small process that holds copies of their channels, writes the request, waits for the reply and reads
its clock, and does nothing else; on CUDA it is held to the timing's core with the two sides (cores.one_core).
Every other request goes the usual way. The trust is unchanged: the worker sees the same requests on the same
pipe, and the wall is still taken outside every process that runs candidate code.

`attached(workers)`: the clock for those workers while inside (`w.clock`), or nothing (the judge's own thread
reads the clock, as before) where the process cannot start or ProfileConfig.judge_clock_process is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from sandbox.confinement import proctree
from sandbox.confinement.worker_process import WorkerError
from sandbox.timing import clock_process as cp

SCRIPT = Path(cp.__file__)
GRACE_S = 10.0  # past a request's own timeout, how long the judge waits for the clock process to answer


class Clock:
    """One clock process for `workers`' channels."""

    def __init__(self, workers: list) -> None:
        self.sides = {id(w): k for k, w in enumerate(workers)}
        specs, fds = [], []
        for w in workers:
            specs.append(f"{w._w.fileno()}:{w._r}")
            fds += [w._w.fileno(), w._r]
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(SCRIPT), *specs], pass_fds=fds,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     bufsize=0)
        self.requests = 0
        self.broken: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def usable(self, w) -> bool:
        """Whether `w`'s next request may go through this process: one of its workers, ready, nothing unread."""
        return (self.broken is None and id(w) in self.sides and w.ready_at is not None and not w._buf
                and not w._early and w.outstanding == 0 and not w._killed)

    def request(self, w, op: str, timeout: float, what: str, **args) -> tuple[dict, float]:
        """`w.request`'s reply, and the wall time from writing the request to reading the reply's end, in ms.
        Errors as `w.request` gives them: a worker that overran `timeout` is killed (WorkerError "timeout"), one
        that ended is reported by how it died."""
        line = json.dumps({"op": op, **w.outgoing(args)}).encode() + b"\n"
        timeout_ms = max(1, int(timeout * 1000))
        try:
            self._write(cp.HEADER_IN.pack(self.sides[id(w)], timeout_ms, len(line)) + line)
            head = self._read(cp.HEADER_OUT.size, timeout + GRACE_S)
            status, wall_ns, length = cp.HEADER_OUT.unpack(head)
            reply = self._read(length, GRACE_S) if length else b""
        except (OSError, EOFError, TimeoutError) as e:
            self.broken = f"{type(e).__name__}: {e}"
            w.kill()  # the request may be half sent, its reply half read: the channel cannot be trusted again
            raise WorkerError("internal_error", f"{what}: the judge's clock process stopped answering ({self.broken}); "
                              "this is the judge's failure, not the candidate's") from None
        self.requests += 1
        if status == cp.TIMEOUT:
            raise w.overran(what, timeout)
        if status == cp.ENDED:
            raise w.died(what)
        if status == cp.OVERSIZED:
            raise w.oversized()
        msg = w.incoming(json.loads(reply))
        if not (isinstance(msg, dict) and msg.get("ok", True)):
            w.clean = False
        return msg, wall_ns / 1e6

    def _write(self, data: bytes) -> None:
        view, fd = memoryview(data), self.proc.stdin.fileno()
        while view:
            view = view[os.write(fd, view):]

    def _read(self, n: int, timeout: float) -> bytes:
        out = bytearray()
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while len(out) < n:
            if not proctree.readable([fd], max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("the process ended")
            out += chunk
        return bytes(out)

    def close(self) -> None:
        with suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with suppress(OSError):
            self.proc.stdout.close()


@contextmanager
def attached(workers: list, enabled: bool = True) -> Iterator[Clock | None]:
    """`workers`' timed requests read by a clock process while inside (each worker's `clock`), or None."""
    clock = None
    # a worker without a pipe of its own (a test's scripted timer) keeps the thread's clock
    if enabled and all(isinstance(getattr(w, "_r", None), int) and hasattr(getattr(w, "_w", None), "fileno")
                       for w in workers):
        try:
            clock = Clock(workers)
        except OSError:
            clock = None  # the judge's own thread reads the clock, as before
    saved = [getattr(w, "clock", None) for w in workers]
    if clock is not None:
        for w in workers:
            w.clock = clock
    try:
        yield clock
    finally:
        for w, old in zip(workers, saved, strict=True):
            w.clock = old
        if clock is not None:
            clock.close()


def timed_request(w, op: str, timeout: float, what: str, **args) -> tuple[dict, float]:
    """`w.request(...)` and its wall time in ms, by `w`'s clock process where it has one that may carry it, else by
    this thread's clock."""
    clock = getattr(w, "clock", None)
    if clock is not None and clock.usable(w):
        return clock.request(w, op, timeout, what, **args)
    t0 = time.perf_counter()
    r = w.request(op, timeout, what, **args)
    return r, (time.perf_counter() - t0) * 1e3
