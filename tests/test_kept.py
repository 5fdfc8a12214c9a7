"""Task processes kept between judgments (sandbox/confinement/kept.py): real workers, real verifies and a real
profile on the CPU, with keeping switched on (its default is on for CUDA only)."""

import contextlib
import os
import shutil
import signal
import time

import pytest

from conftest import profile_scored, set_variant
from sandbox.api import verify_workspace
from sandbox.config import VerifyConfig
from sandbox.confinement import kept, proctree
from sandbox.confinement.processes import Session
from sandbox.confinement.reaper import REAPER
from sandbox.correctness.verify import run_verification
from sandbox.workspace import Workspace

FAST = VerifyConfig(trials=2, signed_trials=0, generalize=False)


@pytest.fixture
def keeper(monkeypatch):
    """A keeper of this test's own, keeping up to 4 CPU task processes in a process that judges repeatedly."""
    from sandbox.confinement import processes

    own = kept.TaskKeeper()
    monkeypatch.setattr(kept, "KEEPER", own)
    monkeypatch.setenv(kept.KEEP_ENV, "4")
    monkeypatch.setitem(processes._AUTO, "enabled", True)
    yield own
    assert REAPER.drain(60)
    own.close()


def idle_pids(keeper) -> list[int]:
    assert REAPER.drain(60)  # the retired ones are collected by the reaper
    return [w.proc.pid for ws in keeper.idle.values() for _, w in ws]


def gone(pid: int) -> bool:
    """Dead within 10 s: a retired process is killed at once and collected in a thread of the keeper's."""
    deadline = time.monotonic() + 10
    while proctree.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not proctree.alive(pid)


def copy_ws(cpu_ws, tmp_path, name: str) -> Workspace:
    dst = tmp_path / name
    shutil.copytree(cpu_ws.root, dst, symlinks=True)
    return Workspace(dst)


def test_a_task_process_serves_later_judgments_of_its_task_from_another_workspace(keeper, cpu_ws, tmp_path):
    first = verify_workspace(cpu_ws, FAST)
    assert first.ok, first.message
    assert first.phases["reference_kept"] == 0
    [pid] = idle_pids(keeper)
    # another workspace of the same task (another path: the kept process reads no file of it), a wrong candidate
    other = copy_ws(cpu_ws, tmp_path, "other")
    set_variant(other.root, "wrong_values")
    wrong = verify_workspace(other, FAST)
    assert not wrong.ok and wrong.reason == "value_mismatch", wrong.message
    assert wrong.phases["reference_kept"] == 1 and wrong.phases["reference_wait"] == 0
    assert idle_pids(keeper) == [pid]  # the same process, kept again: the candidate's failure is not the task's
    # after a wrong candidate, a right one is judged right by it; and one that mutates its input is caught by it
    again = verify_workspace(cpu_ws, FAST)
    assert again.ok and again.phases["reference_kept"] == 1, again.message
    set_variant(other.root, "mutates_input")
    assert verify_workspace(other, FAST).reason == "input_mutated"
    assert idle_pids(keeper) == [pid] and keeper.counts["reused"] == 3


def test_a_task_of_other_text_never_shares_a_process(keeper, cpu_ws, tmp_path):
    assert verify_workspace(cpu_ws, FAST).ok
    [pid] = idle_pids(keeper)
    task = tmp_path / "task.py"
    task.write_text(cpu_ws.reference_path.read_text() + "\n# one more line: another task to the keeper\n")
    r = run_verification(str(task), str(next((cpu_ws.root / "build").rglob("*.so"))), str(cpu_ws.root / "model_new.py"),
                         "cpu", FAST, dict(backend="cpu", atol=FAST.atol, rtol=FAST.rtol, restored_files=[]),
                         time.perf_counter())
    assert r.ok and r.phases["reference_kept"] == 0, r.message
    assert pid in idle_pids(keeper) and len(idle_pids(keeper)) == 2


def test_a_reference_that_fails_is_not_kept(keeper, cpu_ws, tmp_path):
    task = tmp_path / "task.py"
    task.write_text(cpu_ws.reference_path.read_text().replace(
        "self.bias = nn.Parameter(torch.randn(features) * 0.1)", "raise RuntimeError('the reference breaks')"))
    r = run_verification(str(task), str(next((cpu_ws.root / "build").rglob("*.so"))), str(cpu_ws.root / "model_new.py"),
                         "cpu", FAST, dict(backend="cpu", atol=FAST.atol, rtol=FAST.rtol, restored_files=[]),
                         time.perf_counter())
    assert not r.ok and r.reason == "reference_error", r.message
    assert idle_pids(keeper) == [] and keeper.counts["kept"] == 0


def test_a_kept_process_that_dies_while_idle_is_replaced_not_blamed(keeper, cpu_ws, monkeypatch):
    assert verify_workspace(cpu_ws, FAST).ok
    [pid] = idle_pids(keeper)
    taken = []
    real = keeper.take

    def take_then_kill(key):
        w = real(key)
        if w is not None:  # it passed the keeper's liveness check, then dies before its set-up
            os.kill(w.proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while proctree.alive(w.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            taken.append(w.proc.pid)
        return w
    monkeypatch.setattr(keeper, "take", take_then_kill)
    r = verify_workspace(cpu_ws, FAST)
    assert r.ok, r.message
    assert taken == [pid] and r.phases["reference_kept"] == 0  # judged by the fresh process that replaced it
    [new] = idle_pids(keeper)
    assert new != pid


def test_only_task_processes_are_kept_up_to_the_cap(keeper, monkeypatch):
    monkeypatch.setenv(kept.KEEP_ENV, "2")
    pids = []
    with contextlib.ExitStack() as stack:  # three judgments of one task at once: three processes
        for _ in range(3):
            s = stack.enter_context(Session("cpu"))
            cand = s.spawn("candidate", keep="abc")  # a candidate's process is never kept, whatever it is asked
            task = s.spawn("eager", keep="abc")
            task.wait_ready(60, "start")
            cand.wait_ready(60, "start")
            assert not task.reused and cand.keep_key is None
            pids.append(task.proc.pid)
    idle = idle_pids(keeper)
    assert sorted(idle) == sorted(pids[:2])  # the first parked retired (ExitStack closes the last session first)
    assert gone(cand.proc.pid) and gone(pids[2])
    with Session("cpu") as s:
        assert s.spawn("eager", keep="other").proc.pid not in idle  # another task's key: a process of its own
        w = s.spawn("eager", keep="abc")
        assert w.reused and w.proc.pid == pids[0]  # the last parked
    # one whose scratch folder went (a pool that started it was closed) is not taken
    [(_, w)] = keeper.idle[w.keep_key]
    shutil.rmtree(w.scratch)
    with Session("cpu") as s:
        assert not s.spawn("eager", keep="abc").reused
    assert gone(w.proc.pid)
    # past its uses, or idle for long, a process is retired
    monkeypatch.setattr(kept, "IDLE_S", 0.0)
    with Session("cpu") as s:
        assert not s.spawn("eager", keep="abc").reused
    assert all(gone(p) for p in pids)


def test_a_profile_takes_the_task_process_its_verify_gave_back(keeper, cpu_ws):
    assert verify_workspace(cpu_ws, FAST).ok
    [pid] = idle_pids(keeper)
    p = profile_scored(cpu_ws)
    assert p.ok and p.speedup_vs_eager, p.message
    assert p.phases["eager_kept"] == 1
    assert idle_pids(keeper) == [pid]  # and given back again after its timing and spot checks


def test_a_parked_process_past_any_bound_is_retired_and_says_why():
    healthy = {"ok": True, "allocated_bytes": 0, "profiling": False, "open_fds": 20,
               "limits_used": {"cpu": 0.1, "data": 0.3, "fds": 0.01}}
    assert kept.retire_reason(healthy, 1) is None
    for change, uses, why in (({"ok": False}, 1, "park failed"), ({}, 1, None),
                              ({"allocated_bytes": (64 << 20) + 1}, 1, "device memory left"),
                              ({"profiling": True}, 1, "profiler running"),
                              ({"limits_used": {"cpu": 0.5}}, 1, "CPU seconds"),
                              ({"limits_used": {"data": 0.8}}, 1, "host memory"),
                              ({"limits_used": {"fds": 0.6}}, 1, "descriptors"), ({"open_fds": 300}, 1, "descriptors"),
                              ({}, kept.MAX_USES, "uses")):
        assert kept.retire_reason({**healthy, **change}, uses) == why, change
    assert kept.retire_reason({}, 1) == "park failed"  # no reply at all (it died while parking)


def test_a_real_park_reports_what_the_keeper_judges_it_by(keeper, cpu_ws):
    assert verify_workspace(cpu_ws, FAST).ok
    assert idle_pids(keeper)
    park = keeper.last_park
    assert park["ok"] and park["allocated_bytes"] == 0 and park["profiling"] is False and "why" not in park
    assert park["open_fds"] > 0 and set(park["limits_used"]) == {"cpu", "data", "fds"}
    assert all(v is None or 0 < v < 0.5 for v in park["limits_used"].values()), park


def test_a_process_started_under_other_limits_is_not_taken(keeper, monkeypatch):
    with Session("cpu") as s:
        w = s.spawn("eager", keep="abc")
        w.wait_ready(60, "start")
        pid = w.proc.pid
    monkeypatch.setenv("CUDA_AGENT_LIMITS", '{"cpu_s": 100}')
    with Session("cpu") as s:
        assert not s.spawn("eager", keep="abc").reused  # its limits were the old ones
    monkeypatch.delenv("CUDA_AGENT_LIMITS")
    with Session("cpu") as s:
        again = s.spawn("eager", keep="abc")
        assert again.reused and again.proc.pid == pid


def test_the_task_text_is_read_as_python_reads_a_source_file(tmp_path):
    from sandbox.correctness.task_process import task_source

    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nNAME = '\xe9'\n")
    utf8 = tmp_path / "utf8.py"
    utf8.write_bytes("NAME = 'é'  # ×\n".encode())
    (a, sha_a), (b, sha_b) = task_source(str(latin)), task_source(str(utf8))
    assert "NAME = 'é'" in a and "NAME = 'é'" in b  # whatever the locale (CI's may be C)
    assert sha_a != sha_b and len(sha_a) == 64
