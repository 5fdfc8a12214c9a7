"""Nothing left behind (sandbox/confinement/orphans.py): a judging process killed mid-profile, by SIGTERM or SIGKILL,
leaves no worker (the timer stopped between phases included) and no folder. Real processes: a plain script calling
sandbox.api.profile_workspace, killed from here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import set_variant
from sandbox.confinement import environment, proctree

REPO = Path(__file__).resolve().parent.parent

# the judging process: profiles a candidate that never returns, so it stays mid-profile; once its timer and eager
# processes serve (they said they are ready: the judge stops a worker only then) it writes their pids and its
# folders to `info` (read by the test, which then kills it)
JUDGE = textwrap.dedent("""
    import json, os, sys, threading, time
    from sandbox.api import profile_workspace
    from sandbox.confinement import environment, orphans, template
    from sandbox.workspace import Workspace

    ws, info = Workspace(sys.argv[1]), sys.argv[2]

    def watch():
        while True:
            workers = [(w.role, w.proc.pid) for w in orphans.tracked()]
            ready = {w.role for w in orphans.tracked() if w.ready_at is not None}
            if {"timer", "eager"} <= ready:
                own = template.owned()
                with open(info + ".tmp", "w") as f:
                    json.dump({"workers": workers, "folder": environment.current_process_folder(),
                               "template": own.proc.pid if own else None}, f)
                os.replace(info + ".tmp", info)
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    print(profile_workspace(ws).reason, flush=True)
""")


def _started_by(judge: int) -> list[int]:
    """Live processes started for judge `judge`, found without its process tree (a forked worker is its template's
    child, an orphan is init's): each process it starts by exec carries its pid in its environment, and a template's
    children inherit that environment block."""
    mark = f"CUDA_AGENT_JUDGE_PID={judge}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if mark in env and proctree.alive(int(name)):
            found.append(int(name))
    return found


def _gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Those of `pids` still alive after `timeout` seconds (zombies count as gone: nothing of theirs runs)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if proctree.alive(p)]
        if not left or time.monotonic() > deadline:
            return left


def _judge_mid_profile(ws, tmp_path: Path, fork: str) -> tuple[subprocess.Popen, dict]:
    set_variant(ws.root, "spin_forever")
    script, info = tmp_path / "judge.py", tmp_path / "info.json"
    script.write_text(JUDGE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_AGENT_FORK": fork}
    proc = subprocess.Popen([sys.executable, str(script), str(ws.root), str(info)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # the first profile of the session times the task's baseline (torch.compile)
    while not info.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the judge never reached the timing"
        time.sleep(0.1)
    data = json.loads(info.read_text())
    # the timer as it is between a timing's phases: stopped. A stopped process never acts on SIGTERM
    timer = next(pid for role, pid in data["workers"] if role == "timer")
    os.kill(timer, signal.SIGSTOP)
    assert proctree.wait_stopped([timer], 60.0)  # returns once stopped; 5 s was too short beside another test worker
    return proc, data


def _assert_nothing_left(proc: subprocess.Popen, data: dict) -> None:
    pids = [pid for _, pid in data["workers"]] + ([data["template"]] if data["template"] else [])
    assert _gone(pids) == [], data
    assert _gone(_started_by(proc.pid)) == []


def test_a_judge_killed_by_sigterm_mid_profile_takes_its_stopped_timer_and_its_folders(cpu_ws, tmp_path):
    proc, data = _judge_mid_profile(cpu_ws, tmp_path, "auto")
    assert Path(data["folder"]).is_dir()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM  # it still dies of the signal, as it would have without the handler
    _assert_nothing_left(proc, data)
    assert not Path(data["folder"]).exists()
    assert not list(Path(environment.exchange_base()).glob(f"cuda-agent-{proc.pid}-*"))


@pytest.mark.parametrize("fork", [
    "auto",  # workers started by exec: they die of their death signal
    # forked from the judge's own template: its children die with it. `full`: the same kill and sweep as the case
    # above, another way of starting workers (tests/README.md)
    pytest.param("on", marks=pytest.mark.full),
])
def test_a_judge_killed_by_sigkill_mid_profile_leaves_nothing_after_the_next_start_up(cpu_ws, tmp_path, fork):
    own = environment.process_folder()  # a live judge's folder (this process's): never swept
    proc, data = _judge_mid_profile(cpu_ws, tmp_path, fork)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    _assert_nothing_left(proc, data)  # nothing of ours ran: the workers died of their own death signal
    # the folder goes with the next judging process's start-up sweep (its owner's lock is free now)
    subprocess.run([sys.executable, "-c", "from sandbox.confinement.environment import process_folder; "
                    "process_folder()"], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, check=True,
                   timeout=120)
    assert not Path(data["folder"]).exists()
    assert Path(own).is_dir()
