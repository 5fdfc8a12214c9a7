"""GPU memory as a scheduled resource (sandbox/timing/memory_admission.py), with scripted memory: the CPU as a device
whose capacity is CUDA_AGENT_MEMORY_BUDGET bytes. Real processes and threads, the real host-wide ledger (in a lock
folder of the test's own), real verifies and profiles of a CPU workspace."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, set_variant
from sandbox.timing import memory_admission
from sandbox.timing.memory_admission import Ledger, admitted

REPO = Path(__file__).resolve().parent.parent

HOLDER = """
import json, os, sys, time
from sandbox.timing.memory_admission import admitted
log, name, nbytes, hold_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
with admitted(sys.argv[5] if len(sys.argv) > 5 else "cpu", nbytes) as adm:
    with open(log, "a") as fh:
        fh.write(json.dumps([name, "in", time.time(), adm.waited_s]) + "\\n")
    # held for hold_s, or until the test lets it go (the file log.name.go)
    deadline = time.time() + hold_s
    while time.time() < deadline and not os.path.exists(f"{log}.{name}.go"):
        time.sleep(0.02)
    with open(log, "a") as fh:
        fh.write(json.dumps([name, "out", time.time(), 0.0]) + "\\n")
"""


def _go(log: Path, name: str) -> None:
    Path(f"{log}.{name}.go").touch()


@pytest.fixture(autouse=True)
def budget(tmp_path, monkeypatch):
    """A ledger of the test's own, the CPU a device of 100 bytes (a test may set another budget)."""
    monkeypatch.setenv("CUDA_AGENT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv(memory_admission.BUDGET_ENV, "100")


def _start(log: Path, name: str, nbytes: int, hold_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(log), name, str(nbytes), str(hold_s)], cwd=REPO, env=env)


def _events(log: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, what, t, waited in (json.loads(x) for x in log.read_text().splitlines()):
        out.setdefault(name, {})[what] = t
        if what == "in":
            out[name]["waited"] = waited
    return out


def _wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_processes_past_the_budget_wait_their_turn_and_all_run(tmp_path):
    """a (60) and c (30) fit together; b (60), arriving while both hold theirs, waits until a leaves, says how long it
    waited, and then runs beside c."""
    log = tmp_path / "log.jsonl"
    a = _start(log, "a", 60, 120)
    _wait_for(lambda: log.exists() and "a" in _events(log))
    c = _start(log, "c", 30, 120)
    _wait_for(lambda: "c" in _events(log))  # beside a: 90 fit in 100
    b = _start(log, "b", 60, 120)
    _wait_for(lambda: len(Ledger("cpu").entries()) == 3)  # b registered, waiting
    time.sleep(1.0)
    assert "b" not in _events(log)
    _go(log, "a")
    _wait_for(lambda: "b" in _events(log))  # 30 + 60 fit: beside c
    assert "out" not in _events(log)["c"]
    _go(log, "c")
    _go(log, "b")
    for p in (a, b, c):
        assert p.wait(60) == 0
    ev = _events(log)
    assert ev["c"]["in"] < ev["a"]["out"] <= ev["b"]["in"] < ev["c"]["out"], ev
    assert ev["b"]["waited"] > 1.0 and ev["c"]["waited"] < 1.0, ev
    assert Ledger("cpu").entries() == []


def test_threads_past_the_budget_never_hold_more_than_it():
    """Six threads of 40 bytes each on a device of 100: at most two at a time, all of them admitted."""
    inside, peak, waits, lock = [0], [0], [], threading.Lock()

    def judge() -> None:
        with admitted("cpu", 40) as adm:
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.3)
            with lock:
                inside[0] -= 1
            waits.append(adm.waited_s)

    threads = [threading.Thread(target=judge) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(waits) == 6 and peak[0] == 2, (waits, peak)
    assert sorted(waits)[-1] > 0.5, waits  # the last pair waited for two pairs before it


def test_a_dead_holders_share_is_reclaimed(tmp_path):
    """A judge killed while admitted (SIGKILL: no cleanup of its own) holds nothing: the next judgment is admitted
    at once, and its entry is gone from the ledger."""
    log = tmp_path / "log.jsonl"
    p = _start(log, "dead", 90, 600)
    _wait_for(lambda: log.exists() and "dead" in _events(log))
    assert [e["pid"] for e in Ledger("cpu").entries()] == [p.pid]
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    with admitted("cpu", 90) as adm:
        assert adm.waited_s < 1.0
        assert [e["pid"] for e in Ledger("cpu").entries()] == [os.getpid()]


def test_the_allowances_hold_at_least_one_input_set_and_one_output_copy():
    """KernelBench's level-1 activations (6.4 GB an input and an output): an allowance of 4 GiB ahead and 2 GiB of
    copies held neither, so every spot copy went through pageable host memory (4.3 s of a 15 s judgment, H200)."""
    gb = 4096 * 393216 * 4
    ahead, spots = memory_admission.allowance(gb, gb)
    assert ahead == gb and spots == gb
    assert memory_admission.footprint_of(2 * gb, gb, gb, True) == 2 * 2 * gb + 2 * gb + 3 * memory_admission.CONTEXT_BYTES
    small = memory_admission.allowance(1 << 20, 1 << 20)
    assert small == (memory_admission.SMALL_BYTES, memory_admission.SMALL_BYTES)  # hundreds of sets ahead
    # four sets and four copies, within the timer's own budgets
    assert memory_admission.allowance(600 << 20, 300 << 20) == (2400 << 20, 1200 << 20)
    assert memory_admission.allowance(3 << 29, 1 << 30) == (memory_admission.AHEAD_BYTES, memory_admission.SPOT_BYTES)


def test_an_admitted_profile_keeps_its_copies_within_the_allowance_and_sends_none_through_host_memory(
        small_task_path, tmp_path, monkeypatch):
    """What bounded() hands the timer for a measured footprint at KernelBench's published sizes: one 6.4 GB copy on the
    device and none in host memory (a copy's trip out and back cost 4-5 s on an H200); with spot_device_room off, the
    configured device budget bounds it and host memory takes the rest, as before."""
    from types import SimpleNamespace

    from sandbox.correctness.task_process import task_source
    from sandbox.timing.profile import bounded

    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(memory_admission.BUDGET_ENV, str(200 << 30))
    gb = 4096 * 393216 * 4
    sha = task_source(str(small_task_path))[1]

    def tcfg(room: bool) -> dict:
        pr = SimpleNamespace(device="cpu", task=str(small_task_path), ws=SimpleNamespace(backend="cpu"),
                             tcfg={"spot_device_bytes": 2 << 30, "spot_host_bytes": 8 << 30, "spot_device_room": room})
        with admitted("cpu", None):
            memory_admission.measured("cpu", sha, "cpu", {"peak_bytes": 2 * gb, "input_bytes": gb, "output_bytes": gb})
            bounded(pr)
        return pr.tcfg

    assert tcfg(True) == {"spot_device_bytes": gb, "spot_host_bytes": 0, "spot_device_room": False, "ahead_bytes": gb}
    assert tcfg(False) == {"spot_device_bytes": 2 << 30, "spot_host_bytes": 8 << 30, "spot_device_room": False,
                           "ahead_bytes": gb}


def test_a_footprint_past_the_device_runs_alone_without_deadlock(tmp_path):
    """500 bytes on a device of 100: it waits for the holder before it, runs alone, and one arriving after it waits
    for it (first come, first admitted: a later small one does not pass it)."""
    log = tmp_path / "log.jsonl"
    small = _start(log, "small", 30, 120)
    _wait_for(lambda: log.exists() and "small" in _events(log))
    order: list[tuple[str, float]] = []
    let_go = threading.Event()

    def big() -> None:
        with admitted("cpu", 500) as adm:
            order.append(("in", time.time(), adm.waited_s))
            let_go.wait(60)
            order.append(("out", time.time(), 0.0))

    th = threading.Thread(target=big)
    th.start()
    _wait_for(lambda: len(Ledger("cpu").entries()) == 2)  # the big one registered, waiting
    later = _start(log, "later", 10, 0.1)
    _wait_for(lambda: len(Ledger("cpu").entries()) == 3)  # the later one too
    time.sleep(0.5)
    assert not order and "later" not in _events(log)
    _go(log, "small")
    _wait_for(lambda: order)  # alone, past the device's size
    time.sleep(0.5)
    assert "later" not in _events(log)  # 10 more do not fit beside 500
    let_go.set()
    th.join(60)
    assert small.wait(60) == 0 and later.wait(60) == 0
    ev = _events(log)
    assert ev["small"]["out"] <= order[0][1] and order[1][1] <= ev["later"]["in"], (order, ev)
    assert order[0][2] > 0.5


def test_the_cpu_without_a_budget_admits_nothing(monkeypatch):
    monkeypatch.delenv(memory_admission.BUDGET_ENV)
    assert memory_admission.capacity("cpu") is None
    with admitted("cpu", 10 << 40) as adm:
        assert adm is None
    assert not (Path(os.environ["CUDA_AGENT_LOCK_DIR"]) / "cpu.memory").exists()


def test_admission_is_reentrant_per_thread_and_resizes():
    with admitted("cpu", None) as outer:  # unknown footprint: a third of the device until measured
        assert outer.bytes == 100 // memory_admission.UNKNOWN_SHARE
        with admitted("cpu", 50) as inner:
            assert inner is None  # the judgment's admission covers its verify and profile
        outer.resize(20)
        assert [e["bytes"] for e in Ledger("cpu").entries()] == [20]
        got: list = []
        th = threading.Thread(target=lambda: got.append(admitted("cpu", 70).__enter__().waited_s))
        th.start()
        th.join(10)  # 20 + 70 fit: admitted at once after the shrink
        assert got and got[0] < 1.0


def test_new_tasks_start_three_at_a_time_not_one():
    """A footprint not yet measured holds a third of the device: three new tasks' first judgments run together (with
    the whole device each, every new task waited for all the others, and everything behind it waited for it)."""
    entered, go = [], threading.Event()

    def judge(name: str) -> None:
        with admitted("cpu", None) as adm:
            entered.append((name, adm.waited_s))
            go.wait(30)

    first = [threading.Thread(target=judge, args=(f"new{i}",)) for i in range(3)]
    for t in first:
        t.start()
    _wait_for(lambda: len(entered) == 3, 30)
    fourth = threading.Thread(target=judge, args=("new3",))
    fourth.start()
    time.sleep(0.5)
    assert [n for n, _ in entered] != [] and "new3" not in [n for n, _ in entered], "a fourth third was admitted"
    go.set()
    for t in (*first, fourth):
        t.join(30)
    assert sorted(n for n, _ in entered) == ["new0", "new1", "new2", "new3"]


class _Session:
    """What take_whole needs of a processes.Session: hold(cm), let go at close (there: once the workers are gone)."""

    def __init__(self):
        from contextlib import ExitStack
        self.stack = ExitStack()

    def hold(self, cm):
        return self.stack.enter_context(cm)


def test_a_second_run_alone_takes_the_whole_devices_memory():
    """An out-of-memory failure's second run holds the whole device: it waits for what is admitted, and nothing is
    admitted beside it (the device lock alone left kept processes' and other judgments' memory beside it)."""
    other_in, other_go = threading.Event(), threading.Event()

    def other() -> None:
        with admitted("cpu", 40):
            other_in.set()
            other_go.wait(30)

    t = threading.Thread(target=other)
    t.start()
    other_in.wait(10)
    s, waited = _Session(), []
    alone = threading.Thread(target=lambda: waited.append(memory_admission.take_whole(s, "cpu")))
    alone.start()
    time.sleep(0.5)
    assert not waited, "admitted beside another judgment's 40 bytes"
    other_go.set()
    t.join(10)
    alone.join(10)
    assert waited and waited[0] >= 0.4
    assert [e["bytes"] for e in Ledger("cpu").entries()] == [100]
    small: list = []
    late = threading.Thread(target=lambda: small.append(admitted("cpu", 10).__enter__()))
    late.start()
    time.sleep(0.5)
    assert not small, "a judgment was admitted beside the run alone"
    s.stack.close()  # the run's workers gone
    late.join(10)
    assert small


# --- real judgments ---

class _Holder:
    """Another judge's process holding `nbytes` until 1.5 s after a second judgment has asked for memory (registered in
    the ledger): the judgment's start (seconds on a loaded machine) does not eat into its wait."""

    def __init__(self, tmp_path: Path, nbytes: int, device: str = "cpu"):
        log = tmp_path / f"holder{time.monotonic_ns()}.jsonl"
        # the caller's PYTHONPATH kept after the repository: on the device the dependencies are installed there
        # (a --target folder), and a holder without them failed to import pydantic
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(log), "holder", str(nbytes), "300", device],
                                     cwd=REPO, env=env)
        _wait_for(lambda: log.exists() and "holder" in _events(log))

        def release() -> None:
            _wait_for(lambda: len(Ledger(device).entries()) >= 2, 600)
            time.sleep(1.5)
            _go(log, "holder")

        self.thread = threading.Thread(target=release, daemon=True)
        self.thread.start()

    def wait(self) -> int:
        self.thread.join(60)
        return self.proc.wait(30)


def test_a_verify_measures_its_footprint_waits_for_memory_and_says_so(cpu_ws, tmp_path, monkeypatch):
    from sandbox.api import verify_workspace
    from sandbox.config import VerifyConfig
    from sandbox.correctness import task_process

    set_variant(cpu_ws.root, "correct")
    monkeypatch.setenv(memory_admission.BUDGET_ENV, str(1 << 30))
    quick = VerifyConfig(trials=1, signed_trials=0)
    v = verify_workspace(cpu_ws, quick)
    assert v.ok, v.message
    sha = task_process.task_source(str(cpu_ws.reference_path))[1]
    rec = memory_admission.record(sha, "cpu")
    assert rec and rec["bytes"] >= rec["peak_bytes"] > rec["input_bytes"] > 0, rec
    # released once the verify's workers are gone (in the background)
    _wait_for(lambda: Ledger("cpu").entries() == [], 120)

    # a device of 1.5 footprints, another judge holding all of it for 2 s: the verify waits, then passes
    fp = rec["bytes"]
    monkeypatch.setenv(memory_admission.BUDGET_ENV, str(fp * 3 // 2))
    holder = _Holder(tmp_path, fp * 3 // 2)
    v = verify_workspace(cpu_ws, quick)
    assert holder.wait() == 0
    assert v.ok, v.message
    assert v.phases["memory_queued"] > 1.0, v.phases

    # two verifies at once that do not fit together: both pass
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(verify_workspace(cpu_ws, quick))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(out) == 2 and all(r.ok for r in out), [r.message for r in out]
    assert all("memory_queued" in r.phases for r in out)


@pytest.mark.full  # a judgment and a profile held back by another judge (~30 s); the same admission, its wait and what it says stay in the default tier as test_a_verify_measures_its_footprint_waits_for_memory_and_says_so
def test_a_judgment_and_a_profile_wait_for_memory_and_say_so(cpu_ws, tmp_path, monkeypatch):
    from sandbox.api import verify_workspace
    from sandbox.config import ProfileConfig, VerifyConfig
    from sandbox.correctness import task_process
    from sandbox.timing.judgment import judge_workspace
    from sandbox.timing.profile import profile_workspace

    set_variant(cpu_ws.root, "correct")
    monkeypatch.setenv(memory_admission.BUDGET_ENV, str(1 << 30))
    quick = VerifyConfig(trials=1, signed_trials=0)
    assert verify_workspace(cpu_ws, quick).ok  # the footprint measured
    fp = memory_admission.record(task_process.task_source(str(cpu_ws.reference_path))[1], "cpu")["bytes"]
    monkeypatch.setenv(memory_admission.BUDGET_ENV, str(fp))
    _wait_for(lambda: Ledger("cpu").entries() == [], 120)
    pcfg = ProfileConfig(target_ms=50, max_trials=20, warmup_ms=5, top_kernels=0)

    holder = _Holder(tmp_path, fp)
    v, p = judge_workspace(cpu_ws, quick, pcfg)
    assert holder.wait() == 0
    assert v.ok, v.message
    assert v.phases["memory_queued"] > 1.0, v.phases
    assert p is not None and (p.ok or p.reason == "timing_noisy"), p and p.message

    _wait_for(lambda: Ledger("cpu").entries() == [], 120)  # the judgment's admission let go with its workers
    holder = _Holder(tmp_path, fp)
    p = profile_workspace(cpu_ws, pcfg)
    assert holder.wait() == 0
    # this test is about the wait: on a 2-core machine shared with other jobs the timing's own verdict may be a load's
    # (timing_noisy, or timing_unverified when the judge's clock read a stalled batch), never memory's
    assert p.ok or p.reason in ("timing_noisy", "timing_unverified"), p.message
    assert "timing" in p.phases, p.phases  # past the admission, the baseline and the set-up
    assert p.phases["memory_queued"] > 1.0, p.phases
    _wait_for(lambda: Ledger("cpu").entries() == [], 120)


@pytest.mark.gpu
def test_the_gpu_capacity_is_the_devices_total_less_headroom(monkeypatch):
    import torch

    monkeypatch.delenv(memory_admission.BUDGET_ENV)
    total = torch.cuda.mem_get_info(0)[1]
    assert memory_admission.capacity("cuda:0") == int(total * (1 - memory_admission.HEADROOM))


@pytest.mark.gpu
def test_a_gpu_verify_measures_the_references_peak_and_waits_for_memory(tmp_path, monkeypatch, small_task_path):
    """On the GPU: the reference's peak (max_memory_reserved) is kept as the task's footprint, and a verify waits while
    another judge holds the device's whole capacity."""
    from sandbox.api import compile_workspace, init_workspace, verify_workspace
    from sandbox.config import VerifyConfig
    from sandbox.correctness import task_process

    monkeypatch.delenv(memory_admission.BUDGET_ENV)
    ws, _ = init_workspace(str(small_task_path), tmp_path / "ws", backend="cuda")
    shutil.copytree(FIXTURES / "cuda_multi" / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    set_variant(ws.root, "correct")
    assert compile_workspace(ws).ok
    quick = VerifyConfig(trials=1, signed_trials=0)
    assert verify_workspace(ws, quick).ok
    rec = memory_admission.record(task_process.task_source(str(ws.reference_path))[1], "cuda")
    assert rec and rec["peak_bytes"] >= rec["input_bytes"] > 0 and rec["bytes"] > 3 * memory_admission.CONTEXT_BYTES
    _wait_for(lambda: Ledger("cuda").entries() == [], 30)
    holder = _Holder(tmp_path, memory_admission.capacity("cuda"), "cuda")
    v = verify_workspace(ws, quick)
    assert holder.wait() == 0
    assert v.ok and v.phases["memory_queued"] > 1.0, (v.message, v.phases)
