"""Workers of a finished operation end off the caller's path (processes._Reaper), without loosening what the
device lock promised: a lock held over them is let go only once they are gone, and a timing in this process
starts only after every earlier operation's workers are gone."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox.confinement.processes import REAPER, Session
from sandbox.timing.device_lock import device_lock

TASK = """import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x + 1
def get_inputs():
    return [torch.randn(4)]
def get_init_inputs():
    return []
"""


def test_a_session_returns_at_once_and_holds_its_lock_until_its_worker_is_gone(tmp_path):
    task = tmp_path / "task.py"
    task.write_text(TASK)
    seen: dict = {}

    @contextmanager
    def hold():
        yield "the lock"
        # what the lock's release sees: everything of the operation's is gone already
        seen["released_at"] = time.monotonic()
        seen["worker_exit"] = w.proc.poll()
        seen["folder_left"] = Path(folder).exists()
        seen["thread"] = threading.current_thread().name

    with Session("cpu", hold=(hold(),)) as s:
        assert s.held == ["the lock"]
        folder = s.dir
        w = s.spawn("check")
        assert w.request("check", 120, "checking the task", task=str(task))["ok"]
        pid = w.proc.pid
        left_at = time.monotonic()
    returned_at = time.monotonic()
    # the worker was sent SIGKILL before the with-block returned, but nobody waited for it there
    assert "released_at" not in seen or seen["released_at"] >= left_at
    assert REAPER.drain(60)
    assert seen["thread"] == "cuda-agent-reaper", seen
    assert seen["worker_exit"] is not None and not seen["folder_left"], seen
    assert seen["released_at"] >= returned_at or seen["released_at"] >= left_at
    assert not Path(folder).exists()
    assert w.proc.poll() is not None and pid > 0


class _SlowToDie:
    """A worker whose death takes a while (a CUDA context being torn down); records when it was done."""

    def __init__(self, done: list):
        self.done = done
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def kill(self) -> None:
        time.sleep(0.6)
        self.done.append(time.monotonic())


def test_an_exclusive_device_lock_waits_for_this_process_s_dying_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_LOCK_DIR", str(tmp_path / "locks"))
    done: list = []
    worker = _SlowToDie(done)
    folder = tmp_path / "op"
    folder.mkdir()
    from contextlib import ExitStack

    REAPER.submit([worker], folder, ExitStack())
    assert worker.stopped  # killed before submit returned
    with device_lock("cpu", exclusive=True):
        entered = time.monotonic()
    assert done and entered >= done[0], (done, entered)
    assert not folder.exists()


def test_a_shared_lock_held_by_a_session_keeps_a_timing_out_until_its_workers_are_gone(tmp_path, monkeypatch):
    """verify's shape: the shared lock goes with the workers, so another process's timing never overlaps them."""
    monkeypatch.setenv("CUDA_AGENT_LOCK_DIR", str(tmp_path / "locks"))
    done: list = []
    with Session("cpu", hold=(device_lock("cpu", exclusive=False),)) as s:
        s.workers.append(_SlowToDie(done))
    # another holder of the lock's files (a second process does the same through flock): it waits for the reap
    import fcntl
    import os

    from sandbox.timing.device_lock import device_key, lock_dir

    fd = os.open(lock_dir() / f"{device_key('cpu')}.lock", os.O_RDWR)
    try:
        t = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_EX)
        got = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert done and got >= done[0] and got - t > 0.3, (done, t, got)


def _fresh_process(monkeypatch, tmp_path, cap: int):
    """This process as if it had judged nothing yet and had no pool, its automatic pool capped at `cap`; a task."""
    from sandbox.confinement import processes

    monkeypatch.setattr(processes, "_AUTO", {"sessions": 0, "live": {}, "enabled": True})
    monkeypatch.setattr(processes, "_POOL", None)
    monkeypatch.setenv(processes.AUTO_POOL_ENV, str(cap))
    task = tmp_path / "task.py"
    task.write_text(TASK)
    return task


def test_a_process_that_judges_again_keeps_ready_workers_as_many_as_it_holds(tmp_path, monkeypatch):
    """Issue 33 item 3: from a process's second operation on, its workers come from a pool that grows with the
    workers its operations hold at once (capped by CUDA_AGENT_WARM_POOL); a one-shot command keeps none."""
    from sandbox.confinement import processes

    task = _fresh_process(monkeypatch, tmp_path, cap=3)
    try:
        with Session("cpu") as first:
            first.spawn("check")
        assert processes._POOL is None  # one operation: nothing kept
        with Session("cpu") as second:
            a, b, c = (second.spawn("check") for _ in range(3))
            pool = processes._POOL
            assert pool is not None and pool.auto and pool._size(pool._key("cpu")) == 3  # the three held: the cap
            assert len(pool.idle[pool._key("cpu")]) == 3
            # the first was started on demand (the pool was empty); the pool started another beside it, for the next
            assert a.log_path.parent == second.dir and b.log_path.parent == pool.dir
        with Session("cpu") as third:
            w = third.spawn("check")
            assert w.log_path.parent == pool.dir and w.role == "check"  # handed out from the pool
            assert w.request("check", 120, "checking the task", task=str(task))["ok"]
        assert REAPER.drain(60)
        assert w.proc.poll() is not None  # used once, then killed like any worker
    finally:
        processes.disable_warm_pool()

    monkeypatch.setattr(processes, "_AUTO", {"sessions": 5, "live": {}, "enabled": True})
    processes.one_shot()
    with Session("cpu") as s:
        s.spawn("check")
    assert processes._POOL is None
    monkeypatch.setattr(processes, "_AUTO", {"sessions": 5, "live": {}, "enabled": True})
    monkeypatch.delenv(processes.AUTO_POOL_ENV)
    with Session("cpu") as s:  # the CPU's default: no pool (a forked worker is ready in milliseconds)
        s.spawn("check")
    assert processes._POOL is None
    assert REAPER.drain(60)


def test_the_pool_grows_per_gpu_with_what_each_holds(tmp_path, monkeypatch):
    """A build over two GPUs holds half its workers on each: each GPU's pool follows its own count."""
    from sandbox.backend import on_gpu
    from sandbox.confinement import processes

    monkeypatch.setattr(processes, "_AUTO", {"sessions": 1, "live": {}, "enabled": True})
    monkeypatch.setattr(processes, "_POOL", None)
    monkeypatch.setenv(processes.AUTO_POOL_ENV, "4")
    try:
        with on_gpu("0"), Session("cpu") as a:
            for _ in range(3):
                a.spawn("check")
            with on_gpu("1"), Session("cpu") as b:
                b.spawn("check")
                pool = processes._POOL
                assert pool._size(pool._key("cpu")) == 2  # one held: the pool's starting two
            assert pool._size(pool._key("cpu")) == 3
            assert {k[1]: len(v) for k, v in pool.idle.items()} == {"0": 3, "1": 2}
        assert processes._AUTO["live"] == {("cpu", "0"): 0, ("cpu", "1"): 0}
    finally:
        processes.disable_warm_pool()
        assert REAPER.drain(60)


def test_a_drain_waits_for_what_was_submitted_before_it_not_for_a_lull(tmp_path):
    """Under a steady stream of judgments the reaper is never idle: a timing waits only for earlier operations."""
    from contextlib import ExitStack

    done: list = []
    first = tmp_path / "first"
    first.mkdir()
    REAPER.submit([_SlowToDie(done)], first, ExitStack())
    stop = threading.Event()

    def stream() -> None:  # operations ending all the time, each slow to die
        i = 0
        while not stop.is_set():
            folder = tmp_path / f"later{i}"
            folder.mkdir()
            REAPER.submit([_SlowToDie([])], folder, ExitStack())
            i += 1
            time.sleep(0.3)

    t = threading.Thread(target=stream)
    t.start()
    try:
        t0 = time.monotonic()
        assert REAPER.drain(30)
        waited = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert done and waited < 3.0, waited  # the first job, and the few queued before the drain: not the stream
    assert REAPER.drain(60)


@pytest.mark.full  # ~45 s of pool starts; the pool's workers ready as many as a process holds stay in the default tier as test_a_process_that_judges_again_keeps_ready_workers_as_many_as_it_holds and test_the_pool_grows_per_gpu_with_what_each_holds
def test_a_process_that_says_how_many_it_judges_at_once_has_its_workers_ready_for_the_first(tmp_path, monkeypatch):
    """Issue 33 item 3, the first wave: told that `n` judgments run at once, the pool starts now (not at the second
    operation), sized two workers a judgment and two over, per GPU, and the very first operation's workers come
    from it. A one-shot process and a backend without an automatic pool get none."""
    from sandbox.backend import on_gpu
    from sandbox.confinement import processes

    task = _fresh_process(monkeypatch, tmp_path, cap=16)
    try:
        pool = processes.expect_judgments(3, "cpu", ["0", "1"])
        assert pool is processes._POOL and pool.auto
        keys = {}
        for gpu in ("0", "1"):
            with on_gpu(gpu):
                keys[gpu] = pool._key("cpu")  # the device, the GPU and the limits a worker starts with
        # two judgments a GPU (3 over 2, rounded up): four workers held, two over
        assert {g: pool._size(k) for g, k in keys.items()} == {"0": 6, "1": 6}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(len(pool.idle.get(k, [])) < 6 for k in keys.values()):
            time.sleep(0.05)
        assert {g: len(pool.idle[k]) for g, k in keys.items()} == {"0": 6, "1": 6}  # started in the background
        with on_gpu("1"), Session("cpu") as first:  # the process's first operation
            w = first.spawn("check")
            assert w.log_path.parent == pool.dir and w.role == "check"
            assert w.request("check", 120, "checking the task", task=str(task))["ok"]
            assert len(pool.idle[keys["1"]]) == 6  # and another started in its place
    finally:
        processes.disable_warm_pool()
        assert REAPER.drain(60)

    monkeypatch.setattr(processes, "_POOL", None)
    processes.one_shot()
    assert processes.expect_judgments(8, "cpu") is None and processes._POOL is None
    monkeypatch.setattr(processes, "_AUTO", {"sessions": 0, "live": {}, "enabled": True})
    monkeypatch.delenv(processes.AUTO_POOL_ENV)
    assert processes.expect_judgments(8, "cpu") is None and processes._POOL is None  # the CPU's default: none


def test_a_pools_workers_open_the_device_only_where_no_timing_runs(tmp_path, monkeypatch):
    """A pooled worker's CUDA context, created beside a timing, stalled the timing's batches for seconds: a gated
    pool's workers open their device only when its opener holds the device's shared lock. While a timing holds
    it, they wait unopened; one handed out meanwhile opens the device in its role's set-up (under its judgment's
    lock); once the timing ends, the rest are opened. (CPU here: the protocol and the lock, not CUDA.)"""
    from sandbox.confinement import processes, warm_pool
    from sandbox.timing import device_lock

    monkeypatch.setenv("CUDA_AGENT_LOCK_DIR", str(tmp_path / "locks"))
    assert warm_pool._OPEN_GATE[0] is not None and "device_lock" in warm_pool._OPEN_GATE[0].__code__.co_names
    task = tmp_path / "task.py"
    task.write_text(TASK)
    pool = warm_pool.WarmPool(3, refill=False, gated=("cpu",), worker=processes.Worker)
    key = pool._key("cpu")
    try:
        with device_lock.timing_hold("cpu"):
            pool.prefill("cpu")
            time.sleep(1.5)
            assert [pool.state[id(w)] for w in pool.idle[key]] == ["pending"] * 3
            w = pool.take("check", "cpu")
            assert w is not None and w.role == "check" and w.log_path.parent == pool.dir
            assert w.request("check", 120, "checking the task", task=str(task))["ok"]
            w.kill()
            assert [pool.state[id(x)] for x in pool.idle[key]] == ["pending"] * 2
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(pool.state.get(id(x)) != "open" for x in pool.idle[key]):
            time.sleep(0.05)
        assert [pool.state[id(x)] for x in pool.idle[key]] == ["open"] * 2
        w = pool.take("check", "cpu")
        assert w.request("check", 120, "checking the task", task=str(task))["ok"]
        w.kill()
        # handed out as they open, with the opener refilling behind: each one taken is the taker's alone (an opener
        # that killed what it had marked open, once it was handed out, failed an honest kernel as a crash)
        pool.refill = True
        for _ in range(6):
            w = pool.take("check", "cpu")
            assert w is not None and w.request("check", 120, "checking the task", task=str(task))["ok"]
            w.kill()
    finally:
        pool.close()
        assert REAPER.drain(60)
