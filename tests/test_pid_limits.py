"""Threads and processes of a confined process are bounded as root (MCP server III, item 2, case 3).

RLIMIT_NPROC binds no root process, and RLIMIT_DATA let a client start hundreds of thousands of 32 KiB-stack
threads: in the red team's run one client took every process id its cgroup had left while another's open_task
failed. Each confined process now joins a cgroup pids group of its own (sandbox/confinement/pidgroup.py), or, where
no cgroup can be had (the GPU hosts: a v2 leaf that holds processes), takes a real uid of its own under which
RLIMIT_NPROC binds root too (sandbox/confinement/nproc.py). Each test runs with both mechanisms: `cgroup` where a
writable pids hierarchy exists, `uid` as root (CUDA_AGENT_PIDS=uid chooses it where a cgroup could be had).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.api import compile_workspace, verify_workspace
from sandbox.config import VerifyConfig
from sandbox.confinement import nproc, pidgroup
from sandbox.confinement.limits import explain_death
from sandbox.workspace import Workspace
from tasks import Task

ROOT = Path(__file__).parents[1]
EXPLOITS = ROOT / "tests" / "exploits"
sys.path.insert(0, str(EXPLOITS))
from catalogue import HEAD, HONEST, task_source  # noqa: E402

MECHANISMS = [
    pytest.param("cgroup", marks=pytest.mark.skipif(pidgroup.base() is None,
                                                   reason=f"no writable cgroup pids hierarchy here: {pidgroup.why_none()}")),
    pytest.param("uid", marks=pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's (a user is "
                                                 "bound by RLIMIT_NPROC as it is)")),
]


def _env(mechanism: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != pidgroup.MECHANISM_ENV}
    return {**env, pidgroup.MECHANISM_ENV: mechanism}


# a bound far above the limit, so that a failure of the defence cannot take the machine down
CHILD = """
import os, resource, sys, threading, time
from sandbox.confinement import limits, pidgroup
pidgroup.join(int(sys.argv[2]))
pidgroup.bind_rest(int(sys.argv[2]), device="cpu")  # a CPU worker's
print(pidgroup.JOINED["note"], flush=True)
limits.install_seccomp(processes=sys.argv[1] == "processes")  # a worker's, before any candidate code
for name, undo in (("setresuid", lambda: os.setresuid(0, 0, 0)), ("setuid", lambda: os.setuid(0)),
                   ("setrlimit", lambda: resource.setrlimit(resource.RLIMIT_NPROC, (1 << 20, 1 << 20)))):
    try:
        undo()
        print("undone:", name, flush=True)
    except (OSError, ValueError):
        pass
threading.stack_size(32768)
n = 0
try:
    while n < 2000:
        if sys.argv[1] == "threads":
            threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        elif os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except (RuntimeError, OSError) as e:
    print("refused:", type(e).__name__, e, flush=True)
print("started", n, flush=True)
os.killpg(0, 9) if sys.argv[1] == "processes" else None
"""


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("what", ["threads", "processes"])
def test_a_process_is_stopped_at_the_limit(what, mechanism):
    out = subprocess.run([sys.executable, "-c", CHILD, what, "40"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, start_new_session=True, env=_env(mechanism)).stdout
    lines = out.splitlines()
    sign = "cgroup pids.max" if mechanism == "cgroup" else "RLIMIT_NPROC 41 under real uid"
    assert lines and sign in lines[0], out
    assert not any(line.startswith("undone:") for line in lines), out  # root again, or the limit raised
    assert any(line.startswith("refused:") for line in lines), out
    started = int(lines[-1].split()[1]) if lines[-1].startswith("started") else None
    assert started is not None and started <= 40, out  # every thread or process counts, the first one's included


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
@pytest.mark.parametrize("device", ["cpu", "cuda", None])
def test_only_a_cpu_process_takes_a_uid_of_its_own(device):
    """CUDA IPC between a judgment's processes failed across two such uids on the H200 host (every CUDA verify:
    'mapping of buffer object failed'), so a process that opens CUDA, or may (its device not known), keeps root's
    real uid and says what bounds it; a CPU one is bound."""
    code = ("import os, sys\nfrom sandbox.confinement import pidgroup\npidgroup.join(40)\n"
            f"pidgroup.bind_rest(40, device={device!r})\nprint(os.getuid(), pidgroup.JOINED['note'])")
    env = _env("uid")
    env.pop(pidgroup.DEVICE_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    uid, _, note = out.stdout.strip().partition(" ")
    if device == "cpu":
        assert int(uid) == nproc.own_uid(int(uid) - nproc.BASE) and "RLIMIT_NPROC 41 under real uid" in note, out
    else:
        assert uid == "0" and "keeps root's real uid" in note, out


def test_a_failed_thread_start_is_named_as_the_limit():
    reason, message = explain_death(1, "RuntimeError: can't start new thread")
    assert reason == "resource_limit" and "threads" in message


# the static scan refuses `import threading` in model_new.py: it is off here to test the runtime's bound, which an
# extension's C++ threads meet the same way
QUICK = VerifyConfig(trials=1, static_checks=False)
# holds its group full for HOLD_S, then reports how many threads it started; the verify it is in fails
HOLD_S = 45
BOMB = (HEAD + "import threading, time\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        threading.stack_size(32768)\n        n = 0\n"
        "        try:\n            while n < 3000:\n"
        f"                threading.Thread(target=time.sleep, args=({HOLD_S},), daemon=True).start()\n"
        "                n += 1\n        except RuntimeError:\n"
        f"            time.sleep({HOLD_S})\n"
        "        raise RuntimeError(f'REPORT{n}REPORT')\n\n"
        "    def forward(self, x):\n        return cuda_extension.relu(x)\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    ws = Workspace.create(Task(id="exploits/threads", source=task_source("relu01")),
                          tmp_path_factory.mktemp("threads") / "ws", backend="cpu")
    shutil.copytree(EXPLOITS / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    r = compile_workspace(ws)
    assert r.ok, r.log_tail
    return ws.root


def _workspace(built: Path, root: Path, model_new: str) -> Workspace:
    ws = Workspace.create(Task(id="exploits/threads", source=task_source("relu01")), root, backend="cpu")
    for d in ("kernels", "build"):
        shutil.copytree(built / d, ws.root / d, dirs_exist_ok=True)
    (ws.root / "model_new.py").write_text(model_new)
    return ws


def _full_groups(at_least: int = 0, mechanism: str | None = None) -> list[Path]:
    """Groups of ours at their pids.max (the bomb's, once it is held); with the uid mechanism (`mechanism`, else
    the environment's), /proc entries of processes under a uid of their own with `at_least` threads."""
    full = []
    mechanism = mechanism or os.environ.get(pidgroup.MECHANISM_ENV) or ("cgroup" if pidgroup.base() else "uid")
    if mechanism == "uid":
        for pid in os.listdir("/proc"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            uid, threads = int(fields.get("Uid", "0").split()[0]), int(fields.get("Threads", "0"))
            if nproc.BASE <= uid < nproc.BASE + nproc.PID_MAX and threads >= at_least > 0:
                full.append(Path(f"/proc/{pid}"))
        return full
    for group in Path(pidgroup.base()).glob("w*"):
        try:
            if int((group / "pids.current").read_text()) >= int((group / "pids.max").read_text()):
                full.append(group)
        except (OSError, ValueError):
            pass
    return full


# the uid mechanism's judgment in the full suite where a cgroup serves the default tier: the default tier holds its
# process-level tests above (threads, processes, undoing it) and the sweep's
@pytest.mark.parametrize("mechanism", [MECHANISMS[0], pytest.param("uid", marks=[
    *MECHANISMS[1].marks, *([pytest.mark.full] if pidgroup.base() is not None else [])])])
def test_a_thread_bomb_is_stopped_at_its_limit_while_another_judgment_runs(built, tmp_path, monkeypatch, mechanism):
    monkeypatch.setenv("CUDA_AGENT_LIMIT_THREADS", "100")
    monkeypatch.setenv(pidgroup.MECHANISM_ENV, mechanism)
    bomb = _workspace(built, tmp_path / "bomb", BOMB)
    results: dict = {}
    judged = threading.Thread(target=lambda: results.update(bomb=verify_workspace(bomb, QUICK)))
    judged.start()
    try:
        # the other judgment starts while the bomb's group is full (or its uid's count at its RLIMIT_NPROC)
        while judged.is_alive() and not _full_groups(95):  # the worker's start under load: no bound but the verify's
            judged.join(0.1)
        assert _full_groups(95), f"the bomb's group never filled up: {results}"
        honest = verify_workspace(_workspace(built, tmp_path / "honest", HONEST["relu01"]), VerifyConfig(trials=1))
        assert honest.ok, honest.message
    finally:
        judged.join()
    r = results["bomb"]
    assert not r.ok
    assert "REPORT" in r.message, r.message
    started = int(r.message.split("REPORT")[1])
    assert started < 100, r.message  # the limit, less the threads torch had started already


# a worker that leaves a process of its own behind in its group, then dies: a candidate's child, reparented away
LEAVER = """
import os, sys, time
from sandbox.confinement import pidgroup
pidgroup.join(64)
pidgroup.bind_rest(64, device="cpu")
print(pidgroup.JOINED["note"], flush=True)
if os.fork() == 0:
    os.setsid()
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the test reads this process's output to its end
            os.dup2(null, fd)
        time.sleep(300)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)
os.wait()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_dead_workers_leftover_children_are_killed_by_the_next_sweep(mechanism):
    """Item 8 of issue 65: a judge killed by SIGKILL takes its workers with it (their death signal), but what a
    candidate started and set adrift stays in the worker's pids group (or under its uid); the next judging
    process's sweep ends it."""
    proc = subprocess.Popen([sys.executable, "-c", LEAVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**_env(mechanism), "PYTHONPATH": str(ROOT)})
    out, err = proc.communicate(timeout=120)
    note, left = out.split("\n")[:2]
    left_pid = int(left)
    if mechanism == "uid":
        assert "RLIMIT_NPROC 65 under real uid" in note, (note, err)
        try:
            assert not _gone(left_pid), "the leftover died by itself: the test proves nothing"
            assert nproc._real_uid(str(left_pid)) == nproc.own_uid(proc.pid), "the leftover is not under the uid"
            pidgroup.sweep()
            deadline = time.monotonic() + 10
            while not _gone(left_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _gone(left_pid), "the sweep left a dead worker's child running"
        finally:
            if not _gone(left_pid):
                os.kill(left_pid, 9)
        return
    assert "cgroup pids.max" in note, (note, err)
    group = Path(pidgroup.base()) / f"w{proc.pid}"
    try:
        assert not _gone(left_pid), "the leftover died by itself: the test proves nothing"
        assert str(left_pid) in (group / "cgroup.procs").read_text().split(), "the leftover is not in the group"
        pidgroup.sweep()
        deadline = time.monotonic() + 10
        while not _gone(left_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(left_pid), "the sweep left a dead worker's child running"
        deadline = time.monotonic() + 10
        while group.exists() and time.monotonic() < deadline:  # emptied, the group goes at the next sweep
            pidgroup.sweep()
            time.sleep(0.1)
        assert not group.exists()
    finally:
        if not _gone(left_pid):
            os.kill(left_pid, 9)
