"""Workers forked from a template process (sandbox.confinement.template, sandbox.worker.template).

A spy task, run by the `check` role (which executes a task file), reports what its process sees: its
file descriptors, session, network namespace, working and temporary directories, and whether anything
an earlier child set is visible. The same spy runs in a worker started by exec, for comparison.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import set_variant
from sandbox.api import verify_workspace
from sandbox.config import VerifyConfig
from sandbox.confinement import proctree, template
from sandbox.confinement.environment import worker_env
from sandbox.confinement.processes import AUTO_POOL_ENV, Session
from sandbox.confinement.reaper import REAPER

FAST = VerifyConfig(trials=1)

SPY = '''
import json, os, sys, tempfile, threading
import torch

TEMPLATE_DIR = {template_dir!r}

def _paths_from_template():
    """Module globals (and torch._dynamo's config) that hold a path computed in the template."""
    found = []
    for name, mod in list(sys.modules.items()):
        for key, value in list(getattr(mod, "__dict__", {{}}).items()):
            if isinstance(value, str) and TEMPLATE_DIR and TEMPLATE_DIR in value and key != "TEMPLATE_DIR":
                found.append(f"{{name}}.{{key}}")
    cfg = sys.modules.get("torch._dynamo.config")
    if cfg is not None and TEMPLATE_DIR and TEMPLATE_DIR in cfg.debug_dir_root:
        found.append("torch._dynamo.config.debug_dir_root")
    return found

fds = {{int(f): os.readlink(f"/proc/self/fd/{{f}}") for f in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{{f}}")}}
seen = {{
    "pid": os.getpid(), "ppid": os.getppid(), "own_session": os.getsid(0) == os.getpid(),
    "fds": len(fds), "sockets": sorted(p for p in fds.values() if p.startswith("socket:")),
    "netns": os.readlink("/proc/self/ns/net"), "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
    "scratch": os.environ.get("CUDA_AGENT_SCRATCH"), "threads_at_task": threading.active_count(),
    "earlier_child_global": getattr(torch, "_spy_was_here", None),
    "earlier_child_module": "spy_state" in sys.modules,
    "from_template": _paths_from_template(),
}}
torch._spy_was_here = os.getpid()
sys.modules["spy_state"] = sys
raise RuntimeError("SPY" + json.dumps(seen) + "SPY")
'''


def spy(tmp_path: Path, template_dir: str = "", n: int = 1) -> list[dict]:
    """Run the spy task in `n` fresh `check` workers, one after the other, all alive until the end; what each saw."""
    task = tmp_path / f"spy_{time.monotonic_ns()}.py"
    task.write_text(SPY.format(template_dir=template_dir))
    out = []
    with Session("cpu") as s:
        for _ in range(n):
            w = s.spawn("check")
            r = w.request("check", 60, "the spy", task=str(task))
            assert not r["ok"] and "SPY" in r["message"], r
            seen = json.loads(r["message"].split("SPY")[1])
            seen.update(forked=w.forked, workdir=str(s.dir), worker_scratch=w.scratch, wait=w.ready_wait)
            out.append(seen)
    return out


@pytest.fixture
def own_template(monkeypatch):
    """This test process's template, ready (its imports done)."""
    monkeypatch.delenv(template.FORK_ENV, raising=False)
    own = template.enable(worker_env())
    own.channel.info()  # answered once the imports are done
    yield own
    template.disable()


def test_waiting_for_a_template_that_is_still_importing_breaks_nothing(monkeypatch):
    """wait_ready asks on a channel of its own: past its limit (the imports still running) it says None, and the
    channel this process forks through is not marked broken (which would get the template replaced and its
    workers killed); asked again, it answers once the imports are done."""
    monkeypatch.delenv(template.FORK_ENV, raising=False)
    template.disable()
    own = template.enable(worker_env())
    try:
        assert own.wait_ready(0.001) is None  # torch's import takes longer than a millisecond
        assert own.channel.broken is None and own.alive()
        info = own.wait_ready(240)
        assert info is not None and info["import_s"] > 0 and info["problems"] == []
        assert template.enable(worker_env()) is own  # still the same template
    finally:
        template.disable()


def test_template_has_imported_torch_but_runs_one_thread_and_no_device(own_template):
    info = own_template.channel.info()
    assert info["problems"] == [], info
    assert info["modules"] == {"torch": True, "torch._dynamo": True, "sandbox.worker.timer": False}
    # seen from outside too: one thread, torch's libraries mapped, no device file or socket open but its own
    pid = own_template.proc.pid
    assert info["pid"] == pid and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    assert "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert not [p for p in links if p.startswith("/dev/nvidia")]
    assert len([p for p in links if p.startswith("socket:")]) == 1  # the control socket, nothing from the imports
    assert info["import_fds"] == []


def test_every_role_is_served_by_a_forked_worker(own_template):
    """Each role's module is imported in the child (the timer's, which the template must not import, too)."""
    # (not imported from sandbox.worker.__main__: its start-up would take this process off the network)
    roles = ["reference", "candidate", "timer", "baseline", "check", "synth_probe", "idle:cpu"]
    with Session("cpu") as s:
        for role in roles:
            w = s.spawn(role)
            if role.startswith("idle:"):
                assert w.request("become", 60, "become", role="timer")["ok"]
            assert w.request("exit", 60, f"{role}: exit")["ok"]
            assert w.forked and w.ready_wait is not None, role
    assert own_template.channel.info()["modules"]["sandbox.worker.timer"] is False


def test_forked_worker_starts_like_an_exec_one_and_inherits_nothing(own_template, tmp_path, monkeypatch):
    first, second = spy(tmp_path, own_template.dir, n=2)  # the second forked after the first ran the task
    monkeypatch.setenv(template.FORK_ENV, "off")
    execd, = spy(tmp_path, own_template.dir)
    assert first["forked"] and second["forked"] and not execd["forked"]
    for seen in (first, second):
        assert seen["ppid"] == own_template.proc.pid and seen["own_session"]
        # nothing of the template's but what a fresh process has: no socket (the template's control socket and
        # channels stay behind), as many descriptors as the exec'd worker, which got only its two pipes
        assert seen["sockets"] == [] and seen["fds"] == execd["fds"]
        assert seen["cwd"] == seen["workdir"] and seen["tmp"] == seen["scratch"] == seen["worker_scratch"]
        assert seen["from_template"] == []  # no path the template computed at import time
        assert seen["threads_at_task"] == execd["threads_at_task"]
    # each child has a network namespace of its own (both alive at once: a namespace's number is reused once
    # it is gone); the template stays in this process's, since each child leaves it for a new one
    host = os.readlink("/proc/self/ns/net")
    assert os.readlink(f"/proc/{own_template.proc.pid}/ns/net") == host
    assert len({first["netns"], second["netns"], host}) == 3 and execd["netns"] != host
    # what the first child set in its memory is not in the second: each is a copy of the template alone
    assert first["earlier_child_global"] is None and not first["earlier_child_module"]
    assert second["earlier_child_global"] is None and not second["earlier_child_module"]
    assert execd["own_session"] and execd["cwd"] == execd["workdir"] and execd["tmp"] == execd["worker_scratch"]


def test_forked_candidate_is_confined_like_an_exec_one(own_template, cpu_ws, monkeypatch):
    set_variant(cpu_ws.root, "correct")
    forked = verify_workspace(cpu_ws, FAST)
    monkeypatch.setenv(template.FORK_ENV, "off")
    execd = verify_workspace(cpu_ws, FAST)
    assert forked.ok and execd.ok, (forked.message, execd.message)
    assert forked.phases["import_torch"] == 0 < execd.phases["import_torch"]
    assert forked.sandbox_notes == execd.sandbox_notes  # Landlock's stages, the limits, the seccomp filter
    assert any("seccomp refuses new processes" in n for n in forked.sandbox_notes), forked.sandbox_notes


def test_template_outlives_a_crashing_worker_and_is_restarted_when_killed(own_template, cpu_ws):
    pid = own_template.proc.pid
    set_variant(cpu_ws.root, "segfault")
    r = verify_workspace(cpu_ws, FAST)
    assert r.reason == "crash" and "SIGSEGV" in r.message, r.message  # the status came through the template
    assert REAPER.drain(60)  # the workers are released in the background once dead (confinement/reaper.py)
    assert proctree.alive(pid) and own_template.channel.info()["children"] == 0
    os.kill(pid, signal.SIGKILL)
    own_template.proc.wait()
    set_variant(cpu_ws.root, "correct")
    r = verify_workspace(cpu_ws, FAST)
    assert r.ok, r.message
    assert template.owned() is not own_template and template.owned().alive()
    assert r.phases["import_torch"] == 0  # forked from the new template


def test_a_closed_channel_takes_its_workers_down(own_template, tmp_path):
    """An MCP helper that dies (however) closes its channel; the workers it had forked are killed."""
    channel = template.Channel(own_template.new_channel())
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    env = {**worker_env(), "CUDA_AGENT_SCRATCH": str(tmp_path)}
    with open(tmp_path / "log", "wb") as log:
        proc = channel.fork("check", str(tmp_path), env, r1, w2, log.fileno())
    for fd in (r1, w2):
        os.close(fd)
    assert json.loads(os.read(r2, 4096))["ready_at"] > 0  # it serves
    channel.sock.close()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    for fd in (w1, r2):
        os.close(fd)
    proc.release()


def test_exit_status_and_zombie_until_released(own_template, tmp_path):
    """The template keeps an exited worker a zombie until the judge releases it: its pid cannot be reused
    while the judge may still kill it by pid."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    env = {**worker_env(), "CUDA_AGENT_SCRATCH": str(tmp_path)}
    with open(tmp_path / "log", "wb") as log:
        proc = own_template.channel.fork("check", str(tmp_path), env, r1, w2, log.fileno())
    for fd in (r1, w2):
        os.close(fd)
    os.write(w1, b'{"op": "exit"}\n')
    assert proc.wait(timeout=60) == 0
    assert Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    proc.release()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{proc.pid}")
    for fd in (w1, r2):
        os.close(fd)


def test_a_worker_needs_the_environment_the_template_imported_under(own_template, tmp_path, monkeypatch):
    r1, w1 = os.pipe()
    env = {**worker_env(), "TORCH_SHOW_CPP_STACKTRACES": "1"}
    with pytest.raises(template.TemplateError) as e:
        own_template.channel.fork("check", str(tmp_path), env, r1, w1, w1)
    assert e.value.env and "TORCH_SHOW_CPP_STACKTRACES" in str(e.value)
    for fd in (r1, w1):
        os.close(fd)
    # a worker's own settings may differ: it sets them before anything reads them
    assert template.import_env({**env, "CUDA_VISIBLE_DEVICES": "3", "TMPDIR": "/x", "CUDA_AGENT_SCRATCH": "/y"}) \
        == template.import_env(env)
    # this process's own template is started again under the new environment, but not while a worker it
    # forked is in use (closing the template would kill it): meanwhile workers start by exec
    with Session("cpu") as s:
        assert s.spawn("check").forked
        monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
        seen, = spy(tmp_path)
        assert not seen["forked"] and template.owned() is own_template and own_template.alive()
    assert REAPER.drain(60)  # until its workers are collected, the template counts them in use
    seen, = spy(tmp_path)
    assert seen["forked"] and template.owned() is not own_template
    assert template.owned().env["TORCH_SHOW_CPP_STACKTRACES"] == "1"


def test_off_means_exec_and_a_helper_channel_is_used(own_template, tmp_path, monkeypatch):
    monkeypatch.setenv(template.FORK_ENV, "off")
    assert not spy(tmp_path)[0]["forked"]
    monkeypatch.delenv(template.FORK_ENV)
    # an MCP helper: no template of its own, its server's through an inherited channel
    theirs = own_template.new_channel()
    template._own = None
    try:
        assert not spy(tmp_path)[0]["forked"]  # no template, none wanted: exec
        template.attach(os.dup(theirs.fileno()))
        theirs.close()
        seen, = spy(tmp_path)
        assert seen["forked"] and seen["ppid"] == own_template.proc.pid
    finally:
        template._own = own_template
        if template._attached is not None:
            template._attached.close()
        template._attached = None
    a, b = socket.socketpair()  # a stream socket: not a channel
    with pytest.raises(ValueError):
        template.attach(a.fileno())
    a.close()
    b.close()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_mcp_helper_leaves_no_forked_worker(own_template, cpu_ws, stop):
    """Forked workers are the template's children, not the helper's: the helper kills them when stopped
    (SIGTERM, as the server stops it), and the template when the helper's channel closes (SIGKILL)."""
    set_variant(cpu_ws.root, "spin_forever")
    theirs = own_template.new_channel()
    env = {**os.environ, template.CHANNEL_ENV: str(theirs.fileno())}
    helper = subprocess.Popen([sys.executable, "-m", "mcp_server.runner"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              pass_fds=(theirs.fileno(),), start_new_session=True)
    theirs.close()
    helper.stdin.write(json.dumps({"op": "verify", "workdir": str(cpu_ws.root), "config": {"trials": 1}}).encode())
    helper.stdin.close()
    deadline = time.monotonic() + 120
    while len(proctree.descendants(own_template.proc.pid)) < 2:  # the reference and the spinning candidate
        assert time.monotonic() < deadline and helper.poll() is None
        time.sleep(0.1)
    workers = proctree.descendants(own_template.proc.pid)
    helper.send_signal(stop)
    helper.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(proctree.alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(proctree.alive(p) for p in workers)
    # and reaped: the template may read this query before it reads the end of the helper's channel
    while own_template.channel.info()["children"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert own_template.alive() and own_template.channel.info()["children"] == 0


DEVICE_PROBE = '''
import json, os, torch
seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count()}
if seen["count"]:
    seen["sum"] = float(torch.ones(1024, device="cuda").sum())
raise RuntimeError("SPY" + json.dumps(seen) + "SPY")
'''


@pytest.mark.gpu
def test_forked_worker_initialises_the_device_it_is_given(own_template, tmp_path, monkeypatch):
    """The template never initialised CUDA, so a child can, under the CUDA_VISIBLE_DEVICES the judge gives it."""
    # this template's own children: not a ready worker of the pool that earlier GPU tests in this process grew
    monkeypatch.setenv(AUTO_POOL_ENV, "0")
    task = tmp_path / "device_probe.py"
    task.write_text(DEVICE_PROBE)

    def probe() -> dict:
        with Session("cuda") as s:
            w = s.spawn("check")
            r = w.request("check", 120, "the device probe", task=str(task))
            assert w.forked and "SPY" in r["message"], r
            return json.loads(r["message"].split("SPY")[1])

    seen = probe()
    assert seen["count"] >= 1 and seen["sum"] == 1024.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe() == {"visible": "", "count": 0}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert probe()["count"] == 1
    assert own_template.channel.info()["problems"] == []  # and the template itself still has not


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_process_that_judges_many_times_keeps_no_descriptor_of_its_workers(own_template, start, monkeypatch):
    """Each worker's log was opened twice and one descriptor never closed: a synth build's gate, judging for
    hours in one process, reached descriptor 1024 after ~400 tasks and failed every task after that."""
    if start == "exec":
        monkeypatch.setenv(template.FORK_ENV, "off")
    with Session("cpu") as s:  # the first session's one-time state (the reaper, the lock files) opened first
        assert s.spawn("check").request("exit", 60, "exit")["ok"]
    before = _open_fds()
    for _ in range(6):
        with Session("cpu") as s:
            w = s.spawn("check")
            assert w.forked == (start == "fork")
            assert w.request("exit", 60, "exit")["ok"]
    REAPER.drain(30)
    assert _open_fds() <= before + 1, (before, _open_fds())


def test_a_descriptor_numbered_past_select_s_limit_is_watched(tmp_path):
    """poll, not select: a descriptor at 1024 or above is waited on like any other."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else 4096) < 1600:
        pytest.skip("this process may not open descriptor 1500")
    if soft < 1600:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1600 if hard == resource.RLIM_INFINITY else min(1600, hard), hard))
    r, w = os.pipe()
    high = os.dup2(r, 1500)
    try:
        assert proctree.readable([high], 0.05) == []
        os.write(w, b"x")
        assert sorted(proctree.readable([high, r], 1.0)) == sorted([high, r])
        sock_a, sock_b = socket.socketpair()
        sock_b.send(b"y")
        assert proctree.readable([sock_a], 1.0) == [sock_a]  # objects with fileno() come back as themselves
        sock_a.close()
        sock_b.close()
    finally:
        os.close(high)
        os.close(r)
        os.close(w)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
