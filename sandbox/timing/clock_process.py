"""The judge's clock for timed requests, in a process of its own (sandbox/timing/judge_clock.py starts it).

    python -I -S clock_process.py REQ_W:REP_R [REQ_W:REP_R ...]

Run by path with the standard library only. Each argument is one worker's channel (the descriptors the judge
writes its requests to and reads its replies from), inherited at start. From the judge, on stdin, a frame:
side, timeout in ms, length (struct HEADER_IN), then one request line; the process writes the line to that
side's worker, reads the worker's reply line, and answers on stdout with status, the wall time in ns between
the write and the reply's last byte, and the line (HEADER_OUT). It ends when stdin ends.

Why a process: the judge is one Python process judging many candidates in threads. A thread waiting for a
batch's reply needs the GIL back before it can read its clock, and any other thread running Python holds it up
to the switch interval (5 ms): a 1.7 ms stream batch of a small kernel, read by the judge's thread beside one
busy thread, took 6.9 ms by that clock. This process does nothing else, so its clock reads the batch.
"""

from __future__ import annotations

import os
import select
import struct
import sys
import time

HEADER_IN = struct.Struct("<IIQ")  # side, timeout_ms, length
HEADER_OUT = struct.Struct("<IQQ")  # status, wall_ns, length
OK, TIMEOUT, ENDED, OVERSIZED = 0, 1, 2, 3
MAX_LINE = 64 << 20  # as the judge's own reader (worker_process._MAX_LINE)


def _read_exactly(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            return False
    return True


def serve(channels: list[tuple[int, int]], inp: int = 0, out: int = 1) -> None:
    bufs = [b""] * len(channels)
    perf = time.perf_counter_ns
    while True:
        head = _read_exactly(inp, HEADER_IN.size)
        if head is None:
            return
        side, timeout_ms, length = HEADER_IN.unpack(head)
        line = _read_exactly(inp, length)
        if line is None:
            return
        req_w, rep_r = channels[side]
        poller = select.poll()  # not select(): a long-lived judge's descriptors pass 1024
        poller.register(rep_r, select.POLLIN | select.POLLPRI)
        status, buf = OK, bufs[side]
        t0 = perf()
        deadline = t0 + timeout_ms * 1_000_000
        if not _write_all(req_w, line):
            status = ENDED
        while status == OK and b"\n" not in buf:
            left_ms = (deadline - perf()) // 1_000_000
            if left_ms <= 0 or not poller.poll(left_ms):
                status = TIMEOUT
                break
            chunk = os.read(rep_r, 1 << 20)
            if not chunk:
                status = ENDED
            elif len(buf) + len(chunk) > MAX_LINE:
                status = OVERSIZED
            else:
                buf += chunk
        wall = perf() - t0
        reply, _, bufs[side] = buf.partition(b"\n") if status == OK else (b"", b"", b"")
        if not _write_all(out, HEADER_OUT.pack(status, wall, len(reply)) + reply):
            return


def main(argv: list[str]) -> None:
    channels = []
    for arg in argv:
        w, _, r = arg.partition(":")
        channels.append((int(w), int(r)))
    serve(channels)


if __name__ == "__main__":
    main(sys.argv[1:])
