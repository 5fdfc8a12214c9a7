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


# a process started as a worker is (device), then its role's set-up (the judgment's uid its judge sent, or none)
JOINER = """
import os, sys, threading, time
from sandbox.confinement import limits, nproc, pidgroup
device = None if sys.argv[1] == "None" else sys.argv[1]
pidgroup.join(40)
pidgroup.bind_rest(40, device=device)
print(os.getuid(), pidgroup.JOINED["note"], flush=True)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a set-up has threads (CUDA's, torch's)
nproc.BOUND["given"] = None if sys.argv[2] == "none" else nproc.exchange_uid(int(sys.argv[2]), os.getppid())
pidgroup.bind_joined(40)
print(os.getuid(), pidgroup.JOINED["note"], flush=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(int(status["CapEff"], 16), int(status["CapBnd"], 16), flush=True)
limits.install_seccomp(processes=False)
for name, undo in (("setresuid", lambda: os.setresuid(0, 0, 0)), ("setuid", lambda: os.setuid(0))):
    try:
        undo()
        print("undone:", name, flush=True)
    except OSError:
        pass
threading.stack_size(32768)
n = 0
try:
    while n < 2000:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        n += 1
except RuntimeError:
    pass
print("started", n, flush=True)
"""


def _joiner(device: str | None, slot: str) -> list[str]:
    env = _env("uid")
    env.pop(pidgroup.DEVICE_ENV, None)
    out = subprocess.run([sys.executable, "-c", JOINER, str(device), slot], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env=env)
    assert out.returncode == 0, out
    return out.stdout.splitlines()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
@pytest.mark.parametrize("device", ["cpu", "cuda", None])
def test_a_cpu_process_takes_a_uid_of_its_own_and_a_cuda_one_its_judgments(device):
    """CUDA IPC maps another process's memory only between processes of one real uid (an H200, 2026-12-03: own
    uids failed either way round, one uid shared passed, taken before or after CUDA opened), so a process that opens
    CUDA, or may (its device not known), drops what would lift RLIMIT_NPROC at its start and takes the uid its judge
    gave the judgment at its set-up, its threads included; a CPU one takes its own at its start."""
    lines = _joiner(device, "5")
    (uid0, _, note0), (uid1, _, note1) = (line.partition(" ") for line in lines[:2])
    cap_eff, cap_bnd = (int(v) for v in lines[2].split())
    for cap in (nproc.CAP_SYS_RESOURCE, nproc.CAP_SYS_ADMIN):
        assert not cap_eff & (1 << cap) and not cap_bnd & (1 << cap), lines
    assert not any(line.startswith("undone:") for line in lines), lines
    started = int(lines[-1].split()[1])
    if device == "cpu":
        assert int(uid0) == int(uid1) == nproc.own_uid(int(uid0) - nproc.BASE), lines
        assert "RLIMIT_NPROC 41 under real uid" in note0 and note1 == note0, lines
        assert started <= 40, lines
        return
    assert uid0 == "0" and "under the judgment's uid" in note0, lines  # nothing taken before its set-up
    assert int(uid1) == nproc.exchange_uid(5), lines
    assert "shared with the judgment's other processes" in note1, lines
    # its threads at the set-up (two) and twice the allowance: the judgment's other process counts against it too
    assert f"RLIMIT_NPROC {2 + 80} under real uid {uid1}" in note1 and started <= 80, lines


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
def test_a_cuda_process_given_no_judgments_uid_keeps_roots_and_says_so():
    lines = _joiner("cuda", "none")
    assert lines[1].startswith("0 ") and "no judgment's uid was given" in lines[1], lines


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
@pytest.mark.parametrize("setting", ["", "0"])
def test_a_cuda_process_that_starts_compilers_takes_its_judgments_uid_unless_told_not_to(setting):
    """A baseline's torch.compile starts gcc and ptxas; started from a differing real uid they run in secure-exec
    mode (glibc drops TMPDIR), and Triton's gcc aborted so on the H200 host until workers got TMP and TEMP too.
    CUDA_AGENT_COMPILER_UID=0 keeps such a process at root's real uid."""
    code = ("import os\nfrom sandbox.confinement import nproc, pidgroup\npidgroup.join(40)\n"
            "pidgroup.bind_rest(40, device='cuda')\nnproc.BOUND['given'] = nproc.exchange_uid(2)\n"
            "pidgroup.bind_joined(40, starts_tools=True)\nprint(os.getuid(), pidgroup.JOINED['note'])")
    env = {**_env("uid"), nproc.TOOLS_ENV: setting}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    uid, _, note = out.stdout.strip().partition(" ")
    if setting != "0":
        assert int(uid) >= nproc.EXCHANGE_BASE and "shared with the judgment's" in note, out
    else:
        assert uid == "0" and "starts compilers keeps root's real uid" in note, out


def test_each_session_takes_a_judgment_uid_of_its_own_and_a_kept_process_brings_its_own(monkeypatch):
    """The judge's side: two live sessions never share a uid; a kept task process's uid becomes the uid of the
    session that takes it (its partner must share it), and one of another uid is refused once the session's is
    fixed; a released uid comes back last."""
    from types import SimpleNamespace

    from sandbox.confinement import judgment_uid
    from sandbox.confinement.processes import Session

    monkeypatch.setenv(pidgroup.MECHANISM_ENV, "judgment")
    with Session("cpu") as a, Session("cpu") as b:
        ua, ub = a._judgment_uid(), b._judgment_uid()
        assert ua != ub and all(nproc.EXCHANGE_BASE <= u < 0x80000000 for u in (ua, ub))
        assert nproc._owner(ua) == str(os.getpid() % nproc.PID_MAX)
    with Session("cpu") as c:
        kept_one = SimpleNamespace(exchange_uid=ua)
        assert c._adopt_uid(kept_one) and c._judgment_uid() == ua  # the kept process's, not a new one
        assert not c._adopt_uid(SimpleNamespace(exchange_uid=ub))
    taken = []
    with Session("cpu") as d:
        taken.append(d._judgment_uid())
    assert taken[0] not in (ua, ub)  # the two just freed come back last
    assert judgment_uid._HELD == {}
    monkeypatch.setenv(pidgroup.MECHANISM_ENV, "uid")
    with Session("cpu") as e:
        assert not e._uid_binds  # a CPU process takes its own


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
    if mechanism in ("uid", "judgment"):
        low, high = (nproc.BASE, nproc.EXCHANGE_BASE) if mechanism == "uid" else (nproc.EXCHANGE_BASE, 1 << 31)
        for pid in os.listdir("/proc"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            uid, threads = int(fields.get("Uid", "0").split()[0]), int(fields.get("Threads", "0"))
            if low <= uid < high and threads >= at_least > 0:
                full.append(Path(f"/proc/{pid}"))
        return full
    for group in Path(pidgroup.base()).glob("w*"):
        try:
            if int((group / "pids.current").read_text()) >= int((group / "pids.max").read_text()):
                full.append(group)
        except (OSError, ValueError):
            pass
    return full


# the uid mechanisms' judgments in the full suite where a cgroup serves the default tier: the default tier holds
# their process-level tests above (threads, processes, undoing it, a judgment's uid taken at the set-up) and the
# sweep's. "judgment": a CPU judgment's processes share a judgment's uid as a CUDA one's do (there, CUDA IPC needs it)
@pytest.mark.parametrize("mechanism", [MECHANISMS[0], *(pytest.param(m, marks=[
    *MECHANISMS[1].marks, *([pytest.mark.full] if pidgroup.base() is not None else [])]) for m in ("uid", "judgment"))])
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
        if mechanism == "judgment":  # the bomb's candidate and its reference, under one uid
            uids = {nproc._real_uid(p.name) for p in _full_groups(1, "judgment")}
            assert len(uids) == 1 and len(_full_groups(1, "judgment")) >= 2, uids
        honest = verify_workspace(_workspace(built, tmp_path / "honest", HONEST["relu01"]), VerifyConfig(trials=1))
        assert honest.ok, honest.message
        if mechanism == "judgment":
            shared = [n for n in honest.sandbox_notes if "shared with the judgment's other processes" in n]
            assert shared and not any(str(u) in shared[0] for u in uids), honest.sandbox_notes
    finally:
        judged.join()
    r = results["bomb"]
    assert not r.ok
    assert "REPORT" in r.message, r.message
    started = int(r.message.split("REPORT")[1])
    # the limit, less the threads torch had started already (a judgment's uid: twice the allowance, shared)
    assert started < (200 if mechanism == "judgment" else 100), r.message


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


# a CUDA worker of a judgment whose judging process is argv[1], that leaves a process behind and dies
JUDGMENT_LEAVER = """
import os, sys, time
from sandbox.confinement import nproc, pidgroup
pidgroup.join(64)
pidgroup.bind_rest(64, device="cuda")
nproc.BOUND["given"] = nproc.exchange_uid(7, int(sys.argv[1]))
pidgroup.bind_joined(64)
print(pidgroup.JOINED["note"], flush=True)
if os.fork() == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(300)
    os._exit(0)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
@pytest.mark.parametrize("judge", ["gone", "alive"])
def test_what_a_judgment_left_is_killed_once_its_judging_process_is_gone(judge):
    """A judgment's uid follows its judging process (processes of one judgment come and go under it, a kept task
    process among them): the sweep ends what is left under it once that process is gone, and nothing before."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    judge_pid = dead.pid if judge == "gone" else os.getpid()
    env = {**_env("uid"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", JUDGMENT_LEAVER + "print(os.getpid())", str(judge_pid)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert "shared with the judgment's other processes" in out.stdout, out
    uid = nproc.exchange_uid(7, judge_pid)
    left = [p for p in os.listdir("/proc") if p.isdigit() and nproc._real_uid(p) == uid]
    try:
        assert left, "nothing was left under the judgment's uid: the test proves nothing"
        pidgroup.sweep()
        deadline = time.monotonic() + 10
        while not all(_gone(int(p)) for p in left) and time.monotonic() < deadline and judge == "gone":
            time.sleep(0.05)
        if judge == "gone":
            assert all(_gone(int(p)) for p in left), "the sweep left a gone judgment's process running"
        else:
            assert not any(_gone(int(p)) for p in left), "the sweep killed a live judgment's process"
    finally:
        for p in left:
            if not _gone(int(p)):
                os.kill(int(p), 9)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback is root's")
def test_a_program_started_under_a_uid_of_ours_still_finds_the_scratch_for_temporary_files(tmp_path):
    """Under a real uid of ours (effective uid 0) every program a worker starts runs in secure-exec mode, where glibc
    drops TMPDIR: gcc's driver then made its temporary files in /tmp, which confinement refuses, and aborted (the
    H200 host). TMP and TEMP survive, and gcc looks at them next."""
    from sandbox.confinement.filesystem import scratch_env

    code = ("import os, subprocess\nfrom sandbox.confinement import nproc\nos.environ.update(SCRATCH)\n"
            "print(nproc.bind(64))\nprint(subprocess.run(['env'], capture_output=True, text=True).stdout)")
    env = {k: v for k, v in _env("uid").items() if k not in ("TMP", "TEMP", "TMPDIR")}
    out = subprocess.run([sys.executable, "-c", code.replace("SCRATCH", repr(scratch_env(str(tmp_path))))],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines()[1:] if "=" in line)
    assert "under real uid" in out.stdout.splitlines()[0], out
    assert "TMPDIR" not in seen, "no secure-exec mode here: the test proves nothing"
    assert seen.get("TMP") == seen.get("TEMP") == str(tmp_path), seen
