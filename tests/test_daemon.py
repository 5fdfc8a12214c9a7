"""The user's template daemon (sandbox.confinement.daemon, sandbox.worker.daemon), with real processes.

The suite runs with no daemon (conftest sets CUDA_AGENT_TEMPLATE_IDLE_S=0); each test here points the cache,
and so the daemon directory, at a directory of its own, allows daemons, and stops every one it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import set_variant
from sandbox.confinement import daemon, proctree, template
from sandbox.confinement.environment import worker_env
from sandbox.confinement.processes import Session
from sandbox.results import VerifyResult

READY_S = 240.0  # torch's import on a loaded 2-core machine


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cuda_agent", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _allow(mp: pytest.MonkeyPatch, idle: float = 120) -> str:
    cache = tempfile.mkdtemp(prefix="cad-")  # short: a socket path has at most 107 bytes
    mp.setenv("CUDA_AGENT_CACHE", cache)
    mp.setenv(daemon.IDLE_ENV, str(idle))
    mp.delenv(template.FORK_ENV, raising=False)
    # started from this long-lived process, a daemon must not wait for it to exit before importing
    mp.setattr(daemon, "PARALLEL_START_CPUS", 0)
    # and its first worker starts by exec while the daemon imports (the wait has a test of its own)
    mp.setattr(daemon, "READY_WAIT_S", 0.0)
    # this process's connections and started daemons: the cache is not in the key, so start afresh
    mp.setattr(daemon, "_channels", {})
    mp.setattr(daemon, "_spawned", [])
    return cache


def _stop_all(cache: str) -> None:
    """Every daemon of this cache's, and this process's connections to them."""
    daemon.stop()
    for ch in daemon._channels.values():
        ch.close()
    for p in daemon._spawned:
        p.wait(timeout=30)
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def own_daemons() -> Iterator[str]:
    """Daemons allowed, in a daemon directory of this test's; all stopped after it."""
    with pytest.MonkeyPatch.context() as mp:
        cache = _allow(mp)
        try:
            yield cache
        finally:
            _stop_all(cache)


@pytest.fixture(scope="module")
def shared() -> Iterator[dict]:
    """One ready daemon for the tests that leave it running (its entry in `daemons()`)."""
    with pytest.MonkeyPatch.context() as mp:
        cache = _allow(mp)
        try:
            assert not spawn_forked()  # none yet: this one by exec, and the daemon starts
            yield wait_ready()
        finally:
            _stop_all(cache)


def spawn_forked() -> bool:
    """Whether a fresh worker (the `check` role) came from a template."""
    with Session("cpu") as s:
        return s.spawn("check").forked


def wait_ready(name: str | None = None, timeout: float = READY_S) -> dict:
    name = name or daemon.key(worker_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [d for d in daemon.daemons() if d["key"] == name]
        if found and found[0]["state"] == "ready":
            assert found[0]["info"]["problems"] == [], found[0]["info"]
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no daemon {name} ready; log:\n{_log(name)}")


def _log(name: str) -> str:
    try:
        return Path(daemon.paths(name)["log"]).read_text()
    except OSError:
        return "(none)"


def _info(name: str) -> dict:
    return next(d for d in daemon.daemons() if d["key"] == name)["info"]


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while proctree.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not proctree.alive(pid)


def test_a_second_cli_verify_forks_from_the_daemon(own_daemons, cpu_ws):
    """The CLI's own path: the first call starts the daemon and runs by exec; a later call forks."""
    set_variant(cpu_ws.root, "correct")
    first = cli("verify", cpu_ws.root, "--json", "--trials", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    assert VerifyResult.model_validate_json(first.stdout).phases["import_torch"] > 0  # exec: imported torch
    ready = wait_ready()
    second = cli("verify", cpu_ws.root, "--json", "--trials", "1")
    assert second.returncode == 0 and second.stderr == "", second.stdout + second.stderr
    assert VerifyResult.model_validate_json(second.stdout).phases["import_torch"] == 0  # both workers forked
    status = cli("judge-daemon", "status", "--json")
    entry, = json.loads(status.stdout)
    assert entry["pid"] == ready["pid"] and entry["info"]["forks"] == 2 and entry["info"]["children"] == 0
    stopped = cli("judge-daemon", "stop", "--json")
    assert json.loads(stopped.stdout) == [{"key": entry["key"], "pid": entry["pid"]}]
    assert _gone(entry["pid"]) and json.loads(cli("judge-daemon", "status", "--json").stdout) == []
    assert not os.path.exists(daemon.paths(entry["key"])["sock"])


def test_the_key_is_what_a_fork_depends_on(tmp_path):
    env = worker_env()
    assert daemon.key(env) == daemon.key({**env, "CUDA_VISIBLE_DEVICES": "3", "TMPDIR": "/x", "CUDA_AGENT_SCRATCH": "/y"})
    assert daemon.key(env) != daemon.key({**env, "TORCH_SHOW_CPP_STACKTRACES": "1"})
    # the judge's source: a change to any of its files is a new key
    root = tmp_path / "root"
    shutil.copytree(Path(daemon.__file__).parents[2] / "sandbox", root / "sandbox")
    moved = {**env, "PYTHONPATH": os.pathsep.join([str(root)] + env["PYTHONPATH"].split(os.pathsep)[1:])}
    before = daemon.key(moved)
    assert before == daemon.key(moved)
    with open(root / "sandbox" / "worker" / "compare.py", "a") as f:
        f.write("\n# changed\n")
    assert daemon.key(moved) != before


def test_a_daemon_of_another_key_is_not_used(shared, monkeypatch, tmp_path):
    assert spawn_forked()
    forks = _info(shared["key"])["forks"]
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")  # read by torch's import: another key
    assert not spawn_forked()
    assert _info(shared["key"])["forks"] == forks
    other = daemon.key(worker_env())
    assert other != shared["key"] and any(d["key"] == other for d in daemon.daemons())  # started for later calls
    # and reached all the same (its socket under the other name), the template refuses the environment
    ch = template.Channel(daemon.connect(daemon.paths(shared["key"])["sock"]))
    r1, w1 = os.pipe()
    with pytest.raises(template.TemplateError) as e:
        ch.fork("check", str(tmp_path), worker_env(), r1, w1, w1)
    assert e.value.env and "TORCH_SHOW_CPP_STACKTRACES" in str(e.value)
    for fd in (r1, w1):
        os.close(fd)
    ch.close()


CONNECT = textwrap.dedent('''
    import json, os, socket, sys
    how, path = sys.argv[1], sys.argv[2]
    if how == "nobody":
        os.setgid(65534); os.setuid(65534)
    elif how == "landlock":
        sys.path.insert(0, sys.argv[3])
        from sandbox.confinement import filesystem
        if filesystem.abi_version() >= 1:
            filesystem.restrict(filesystem.start_rules(sys.argv[4], None))
        else:
            import ctypes
            ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs, as Landlock and the seccomp filter set it
    elif how == "netns":
        import ctypes
        assert ctypes.CDLL(None).unshare(0x40000000) == 0
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.send(b'{"op": "info"}')
    data = s.recv(1 << 20)
    print(json.dumps(json.loads(data) if data else None))
''')


@pytest.mark.parametrize("how", ["same", "landlock", "netns", "nobody"])
def test_only_unconfined_processes_of_the_user_are_served(shared, tmp_path, how):
    """Same uid is not enough: a worker confined by Landlock can still connect() to a named socket."""
    if how in ("netns", "nobody") and os.getuid() != 0:
        pytest.skip("needs root (another user, a network namespace)")
    sock = daemon.paths(shared["key"])["sock"]
    where = os.path.dirname(sock)
    refused = _info(shared["key"])["refused"]
    if how == "nobody":  # let the other user reach the socket at all (it and its directories are private)
        for p in (os.path.dirname(where), where):
            os.chmod(p, 0o711)
        os.chmod(sock, 0o777)
    try:
        out = subprocess.run([sys.executable, "-I", "-c", CONNECT, how, sock, str(Path(daemon.__file__).parents[2]),
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
    finally:
        for p in (os.path.dirname(where), where):
            os.chmod(p, 0o700)
        os.chmod(sock, 0o600)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    if how == "same":
        assert reply["pid"] == shared["pid"] and _info(shared["key"])["refused"] == refused
        return
    assert reply is not None and reply["error"].startswith("refused: "), reply
    assert "pid" not in reply and _info(shared["key"])["refused"] == refused + 1
    expected = {"landlock": "is confined", "netns": "another net namespace", "nobody": "uid 65534"}[how]
    assert expected in reply["error"]
    # and the check itself, on a connection of this process's: served
    a = daemon.connect(sock)
    assert a is not None and daemon.refusal(a, daemon.traits()) is None
    a.close()


def test_killing_the_client_kills_its_workers(shared, cpu_ws):
    set_variant(cpu_ws.root, "spin_forever")
    client = subprocess.Popen([sys.executable, "-m", "cuda_agent", "verify", str(cpu_ws.root), "--trials", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(proctree.descendants(shared["pid"])) < 2:  # the reference and the spinning candidate, forked
        assert time.monotonic() < deadline and client.poll() is None
        time.sleep(0.1)
    workers = proctree.descendants(shared["pid"])
    client.kill()
    client.wait(timeout=30)
    assert all(_gone(p) for p in workers)
    deadline = time.monotonic() + 30
    while _info(shared["key"])["children"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proctree.alive(shared["pid"]) and _info(shared["key"])["children"] == 0


def test_the_daemon_exits_when_idle(own_daemons, monkeypatch):
    monkeypatch.setenv(daemon.IDLE_ENV, "2")
    assert not spawn_forked()
    ready = wait_ready()
    files = daemon.paths(ready["key"])
    ch = daemon.channel(worker_env())  # a judge connected is not idle, even with no worker
    time.sleep(4)
    assert proctree.alive(ready["pid"])
    ch.close()
    daemon._channels.clear()
    assert _gone(ready["pid"], timeout=30)
    assert not os.path.exists(files["sock"]) and not os.path.exists(files["tmp"])
    assert "exiting: idle for 2 s" in Path(files["log"]).read_text()


def test_a_dead_daemons_socket_is_replaced(own_daemons):
    assert not spawn_forked()
    first = wait_ready()
    os.kill(first["pid"], signal.SIGKILL)
    assert _gone(first["pid"])
    sock = daemon.paths(first["key"])["sock"]
    assert os.path.exists(sock)  # left behind: nobody listens on it
    assert not spawn_forked()  # refused: exec, and a new daemon starts in the dead one's place
    second = wait_ready()
    assert second["pid"] != first["pid"] and spawn_forked()


def test_off_or_no_private_directory_means_exec(own_daemons, monkeypatch, capfd):
    monkeypatch.setenv(template.FORK_ENV, "off")
    assert not spawn_forked()
    monkeypatch.setenv(template.FORK_ENV, "auto")
    monkeypatch.setenv(daemon.IDLE_ENV, "0")
    assert not spawn_forked()
    assert not os.path.exists(daemon.directory())  # neither looked for one nor started one
    monkeypatch.setenv(daemon.IDLE_ENV, "60")
    os.makedirs(daemon.directory(), mode=0o755)
    os.chmod(daemon.directory(), 0o755)
    assert not spawn_forked()
    assert "is not a private directory of this user" in capfd.readouterr().err
    assert os.listdir(daemon.directory()) == []


def test_a_daemon_exits_when_its_code_changes(own_daemons, tmp_path):
    """A daemon started from a copy of the judge's source (PYTHONPATH) notices an edit to that copy."""
    root = Path(tempfile.mkdtemp(prefix="cad-src-"))
    try:
        shutil.copytree(Path(daemon.__file__).parents[2] / "sandbox", root / "sandbox")
        env = worker_env()
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + env["PYTHONPATH"].split(os.pathsep)[1:])
        name = daemon.key(env)
        assert daemon.channel(env) is None
        ready = wait_ready(name)
        assert daemon.channel(env) is not None
        daemon._channels.pop(name).close()
        with open(root / "sandbox" / "worker" / "compare.py", "a") as f:
            f.write("\n# changed\n")
        assert daemon.key(env) != name
        assert _gone(ready["pid"], timeout=daemon_stale_wait())
        assert "out of date" in _log(name)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def daemon_stale_wait() -> float:
    from sandbox.worker.daemon import STALE_CHECK_S

    return STALE_CHECK_S + 20


NNP_JUDGE = textwrap.dedent('''
    import ctypes
    ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs, as some containers run everything
    from sandbox.confinement import daemon
    from sandbox.confinement.environment import worker_env
    try:
        daemon.channel(worker_env())
    except daemon.DaemonError as e:
        print(e)
''')


def test_a_judge_with_no_new_privs_uses_no_daemon(own_daemons):
    """It could not tell a worker confined by Landlock alone from itself: no daemon, said why."""
    out = subprocess.run([sys.executable, "-c", NNP_JUDGE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "runs with no_new_privs" in out.stdout, out.stdout + out.stderr
    assert not os.path.exists(daemon.directory())


# an MCP helper (mcp_server.runner): a subreaper that judges once, then kills its whole tree
SUBREAPER_JUDGE = textwrap.dedent('''
    import sys
    from sandbox.confinement import daemon, proctree
    from sandbox.confinement.processes import Session
    daemon.PARALLEL_START_CPUS = 0  # a daemon it started would import at once, not after it exits
    proctree.become_subreaper()
    with Session("cpu") as s:
        w = s.spawn("check")
        print("forked" if w.forked else "exec", flush=True)
        w.request("exit", 60, "exit")
    sys.stdin.readline()
    proctree.kill_own_tree()
''')


def test_a_daemon_is_not_started_in_a_helpers_tree_so_others_workers_outlive_the_helper(own_daemons):
    """An MCP helper's end kills everything below it. A daemon it had started was below it however detached,
    and went with it, and with it the workers it had forked for other judges (on the GPU host: the task checks
    of fifteen concurrent open_task calls, each a judge error). A subreaper starts no daemon; a daemon started
    elsewhere serves it, and survives it."""
    helper = subprocess.Popen([sys.executable, "-c", SUBREAPER_JUDGE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline().strip() in ("exec", "forked")  # it judged
        spawn_forked()  # this process starts it, if the helper did not
        ready = wait_ready()
        with Session("cpu") as s:
            w = s.spawn("check")
            assert w.forked
            helper.stdin.write("\n")
            helper.stdin.flush()
            assert helper.wait(timeout=60) == 0
            assert w.request("exit", 60, "exit")["ok"]  # its template lived through the helper's end
        assert proctree.alive(ready["pid"])
    finally:
        helper.kill()
        helper.wait()


def test_a_process_that_judges_again_waits_for_a_starting_daemon_and_forks(own_daemons, monkeypatch):
    """Not a one-shot CLI call: its first worker waits for the daemon it starts instead of importing torch by exec
    beside it, and is forked; a one-shot process still starts its first worker by exec."""
    from sandbox.confinement import processes

    monkeypatch.setattr(daemon, "READY_WAIT_S", READY_S)
    monkeypatch.setitem(processes._AUTO, "enabled", False)  # one-shot: no waiting
    assert not spawn_forked()
    daemon.stop()
    for p in daemon._spawned:
        p.wait(timeout=30)
    monkeypatch.setattr(daemon, "_channels", {})
    monkeypatch.setitem(processes._AUTO, "enabled", True)
    with Session("cpu") as s:
        w = s.spawn("check")
        assert w.forked and w.request("exit", 60, "exit")["ok"]
    ready = wait_ready()
    assert ready["info"]["forks"] >= 1



@pytest.mark.full  # a build and a daemon's first start (~64 s); forks from a started daemon stay in the default tier: test_a_second_cli_verify_forks_from_the_daemon, test_a_process_that_judges_again_waits_for_a_starting_daemon_and_forks
def test_a_build_starts_the_daemon_without_waiting_and_the_verify_after_it_forks(own_daemons, monkeypatch, cpu_ws):
    """A compile, one-shot (a CLI call) or not, starts the user's template daemon and goes on beside its imports,
    so the verify that follows forks its workers instead of importing torch by exec."""
    from sandbox.api import compile_workspace
    from sandbox.confinement import processes

    monkeypatch.setitem(processes._AUTO, "enabled", False)  # one-shot, as `cuda-agent compile` is
    name = daemon.key(worker_env())
    asked: list[bool] = []
    real = daemon.channel

    def spy(env, wait=False):
        asked.append(wait)
        return real(env, wait)
    monkeypatch.setattr(daemon, "channel", spy)
    assert not [d for d in daemon.daemons() if d["key"] == name]
    assert compile_workspace(cpu_ws).ok
    assert asked == [False]  # started, not waited for
    assert [d for d in daemon.daemons() if d["key"] == name]
    wait_ready()
    assert spawn_forked()
