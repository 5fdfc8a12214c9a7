"""sandbox.confinement.proctree with real processes: what a kill reaches, and what it must spare."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from sandbox.confinement import proctree

# a group leader (its own session) that forks a child left in its group, as a template's worker is until its setsid()
LEADER = textwrap.dedent('''
    import os, sys, time
    pid = os.fork()
    if pid == 0:
        if sys.argv[1] == "own-group":
            os.setpgid(0, 0)
        time.sleep(600)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(600)
''')


def _start(how: str) -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER, how], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while proctree.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not proctree.alive(pid)


def test_killing_a_child_in_its_parents_group_spares_the_parent():
    leader, child = _start("same-group")
    try:
        assert os.getpgid(child) == leader.pid and proctree.ancestors(child)[0] == leader.pid
        assert child in proctree.kill_tree(child) or _gone(child)
        assert _gone(child)
        time.sleep(0.3)
        assert leader.poll() is None and proctree.alive(leader.pid)  # not killed, and not left stopped
        assert proctree._stat(leader.pid)[1] != "T"
    finally:
        leader.kill()
        leader.wait()


ESCAPE = textwrap.dedent('''
    import os, time
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # leads a group, leaves a stray in it and exits: the stray is re-parented out of the tree
        os.setpgid(0, 0)
        if os.fork() == 0:
            os.write(w, f"{os.getpid()}\\n".encode())
            time.sleep(600)
        time.sleep(0.2)
        os._exit(0)
    time.sleep(0.1)
    if os.fork() == 0:  # stays in the tree, in the first one's group
        os.setpgid(0, first)
        time.sleep(600)
    print(os.read(r, 64).decode().strip(), flush=True)
    time.sleep(600)
''')


def test_a_group_the_tree_made_is_killed_whole_even_its_strays():
    leader = subprocess.Popen([sys.executable, "-c", ESCAPE], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    stray = int(leader.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while stray in proctree.descendants(leader.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert proctree.alive(stray)
        proctree.kill_tree(leader.pid)
        assert leader.wait(timeout=10) < 0 and _gone(stray)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        if proctree.alive(stray):
            os.kill(stray, 9)


SPINNER = textwrap.dedent('''
    import threading
    def spin():
        while True:
            pass
    for _ in range(3):
        threading.Thread(target=spin, daemon=True).start()
    print("ready", flush=True)
    spin()
''')


def _states(pid: int) -> set[str]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
            data = fh.read()
        out.add(data[data.rfind(b")") + 2:].split()[0].decode())
    return out


def test_a_stop_is_waited_for_until_every_thread_has_taken_it():
    """A SIGSTOP is sent at once and taken when each thread next runs: judgment.py lets the device lock go only once
    the candidate's threads have all stopped (wait_stopped), never merely once the signal is sent."""
    p = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert "R" in _states(p.pid)
        assert not proctree.wait_stopped([p.pid], timeout=0.05)  # running, never stopped: a timeout, not a hang
        with proctree.stopped([p.pid]):
            assert proctree.wait_stopped([p.pid], timeout=5.0)
            assert _states(p.pid) == {"T"}
        deadline = time.monotonic() + 5
        while "R" not in _states(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "R" in _states(p.pid)  # running again once let go
    finally:
        p.kill()
        p.wait()
