"""The judge's clock process (sandbox/timing/judge_clock.py): timed requests go through a process of its own, so
their wall time is read without waiting for this process's GIL; errors are the worker channel's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.confinement.worker_process import Worker, WorkerError
from sandbox.timing import judge_clock

# a worker for the clock's channel: its ready line, then per request line a reply after `sleep_ms`, or none
ECHO = r"""
import json, os, sys, time
r, w = int(sys.argv[1]), int(sys.argv[2])
os.write(w, json.dumps({"ready_at": time.monotonic()}).encode() + b"\n")
buf = b""
while True:
    while b"\n" not in buf:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            sys.exit(0)
        buf += chunk
    line, _, buf = buf.partition(b"\n")
    req = json.loads(line)
    if req.get("hang"):
        time.sleep(3600)
    if req.get("die"):
        os._exit(3)
    time.sleep(req.get("sleep_ms", 0) / 1e3)
    reply = {"ok": not req.get("fail"), "op": req["op"], "n": req.get("n"), "pid": os.getpid()}
    extra = json.dumps({**reply, "extra": True}).encode() + b"\n" if req.get("twice") else b""
    os.write(w, extra + json.dumps(reply).encode() + b"\n")  # one write: both lines reach the reader together
"""


class EchoWorker(Worker):
    """Worker's channel, recv and kill, around the ECHO process instead of sandbox.worker."""

    def __init__(self, workdir: Path):
        self.role, self.requested_at, self.ready_at = "candidate", time.monotonic(), None
        self.log_path = workdir / f"echo-{id(self)}.log"
        self.log_path.write_text("")
        self.scratch = str(workdir / f"scratch-{id(self)}")
        os.makedirs(self.scratch)
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO, str(p2c_r), str(c2p_w)], pass_fds=(p2c_r, c2p_w),
                                     start_new_session=True)
        os.close(p2c_r)
        os.close(c2p_w)
        self.forked = False
        self._w, self._r, self._buf, self._early, self._killed = os.fdopen(p2c_w, "wb"), c2p_r, b"", [], False
        self.keep_key, self.reused, self.outstanding, self.clean = None, False, 0, True
        self.own_shm, self.placed = None, []  # the host's /dev/shm: nothing to carry (sandbox/confinement/relay.py)
        self.wait_ready(30, "the echo worker")


@pytest.fixture
def echoes(tmp_path):
    made: list[EchoWorker] = []

    def make() -> EchoWorker:
        made.append(EchoWorker(tmp_path))
        return made[-1]

    yield make
    for w in made:
        w.kill()


def test_each_side_gets_its_own_replies_and_the_wall_covers_the_reply(echoes):
    a, b = echoes(), echoes()
    with judge_clock.attached([a, b]) as clock:
        assert clock is not None and a.clock is clock and b.clock is clock
        for n in range(3):
            ra, wa = judge_clock.timed_request(a, "time_batch", 10, "a batch", n=n, sleep_ms=30)
            rb, wb = judge_clock.timed_request(b, "time_batch", 10, "a batch", n=n)
            assert (ra["n"], ra["pid"], rb["n"], rb["pid"]) == (n, a.proc.pid, n, b.proc.pid)
            assert wa >= 30 and wb >= 0  # the clock runs from the request to the reply: at least the worker's sleep
        assert clock.requests == 6
        # the channel is left as it was: the next request goes the usual way, in order
        assert a.request("plain", 10, "a plain request", n=7)["n"] == 7
    assert a.clock is None and b.clock is None and clock.proc.poll() is not None  # the process ends with the timing


def test_a_failed_reply_marks_the_worker_as_a_plain_request_does(echoes):
    w = echoes()
    with judge_clock.attached([w]):
        r, _ = judge_clock.timed_request(w, "time_batch", 10, "a batch", fail=True)
    assert r["ok"] is False and w.clean is False


def test_the_clock_is_read_outside_this_process_gil(echoes):
    """The issue's fault: a reply that comes while another thread holds the GIL. The judging thread's clock cannot
    stop before the GIL is free; the clock process stops at the reply."""
    w = echoes()

    def hold_the_gil_while_a_request_waits(use_process: bool) -> tuple[float, float]:
        got: dict = {}
        sent = threading.Event()

        def judge() -> None:
            sent.set()
            if use_process:
                got["wall"] = judge_clock.timed_request(w, "time_batch", 30, "a batch", sleep_ms=20)[1]
            else:
                t0 = time.perf_counter()
                w.request("time_batch", 30, "a batch", sleep_ms=20)
                got["wall"] = (time.perf_counter() - t0) * 1e3

        t = threading.Thread(target=judge)
        t.start()
        sent.wait()
        time.sleep(0.005)  # the request is out; the thread waits for its reply without the GIL
        h0 = time.perf_counter()
        sum(range(40_000_000))  # one C call: the GIL is not let go until it returns
        held = (time.perf_counter() - h0) * 1e3
        t.join()
        return got["wall"], held

    with judge_clock.attached([w]):
        by_process, held = hold_the_gil_while_a_request_waits(True)
    assert 20 <= by_process < held, (by_process, held)
    by_thread, held = hold_the_gil_while_a_request_waits(False)
    assert by_thread >= held - 5, (by_thread, held)


@pytest.mark.parametrize("fault, timeout, reason, words", [
    ("hang", 0.3, "timeout", "did not finish within"),  # killed with the usual timeout
    ("die", 10, "crash", "exited with status 3"),  # reported by how it died
])
def test_a_worker_that_overruns_or_dies_fails_as_on_the_usual_channel(echoes, fault, timeout, reason, words):
    w = echoes()
    with judge_clock.attached([w]):
        with pytest.raises(WorkerError) as e:
            judge_clock.timed_request(w, "time_batch", timeout, f"a batch that should {fault}", **{fault: True})
    assert e.value.reason == reason and words in e.value.message
    assert w._killed and w.proc.poll() is not None


def test_a_dead_clock_process_is_the_judge_failure_not_the_candidate(echoes):
    w = echoes()
    with judge_clock.attached([w]) as clock:
        clock.proc.kill()
        clock.proc.wait()
        with pytest.raises(WorkerError) as e:
            judge_clock.timed_request(w, "time_batch", 10, "a batch")
        assert e.value.reason == "internal_error" and "judge's clock process" in e.value.message
        assert w._killed  # its channel's state is unknown: the worker goes
        assert not clock.usable(w)


def test_a_worker_with_unread_output_keeps_the_thread_clock(echoes):
    """A line the judge has not read yet would be taken for the next reply by whichever reader comes first: such
    a request goes the usual way, and so do workers the clock was not made for."""
    w, other = echoes(), echoes()
    with judge_clock.attached([w]) as clock:
        w.send("time_batch", twice=True, n=1)
        assert w.recv(10, "a reply")["extra"] is True  # the second line waits in w's buffer
        assert not clock.usable(w) and not clock.usable(other)
        r, _ = judge_clock.timed_request(w, "time_batch", 10, "a batch", n=2)
        assert r["n"] == 1 and "extra" not in r and clock.requests == 0  # the buffered line, by the usual reader
        # n=2's reply is still in the pipe: the clock process reads the same stream in the same order
        r, _ = judge_clock.timed_request(w, "time_batch", 10, "a batch", n=3)
        assert r["n"] == 2 and clock.requests == 1


def test_no_clock_process_when_it_is_off_or_a_worker_has_no_pipe(echoes):
    w = echoes()
    with judge_clock.attached([w], enabled=False) as clock:
        assert clock is None and w.clock is None
    scripted = type("Scripted", (), {"proc": None})()
    with judge_clock.attached([w, scripted]) as clock:
        assert clock is None


def test_the_clock_process_imports_nothing_of_the_package():
    code = ("import sys; sys.argv = ['x']; import runpy; runpy.run_path(%r, run_name='not_main'); "
            "print(sorted(m for m in sys.modules if m.startswith(('sandbox', 'torch', 'pydantic'))))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code % str(judge_clock.SCRIPT)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout.strip().replace("'", '"')) == [], out
