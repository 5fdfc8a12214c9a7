"""The resource limits and the seccomp filter of candidate processes, each in a throwaway child process
(the filter cannot be removed once installed)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.confinement.limits import ResourceLimits, explain_death, seccomp_supported

ROOT = Path(__file__).parents[1]

CHILD = """
import ctypes, os, resource, sys, threading
from sandbox.confinement import limits
notes = limits.apply(limits.ResourceLimits(data_mb=1024))
t = threading.Thread(target=lambda: None); t.start(); t.join()  # threads stay allowed
print("thread ok", flush=True)
resource.getrlimit(resource.RLIMIT_NOFILE)  # reading a limit stays allowed (prlimit64 without a new value)
print("getrlimit ok", flush=True)
try:
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("RAISED", flush=True)
except (OSError, ValueError):
    print("raise refused", flush=True)
try:
    bytearray(2 << 30)
    print("ALLOCATED", flush=True)
except MemoryError:
    print("memory limited", flush=True)
libc = ctypes.CDLL(None, use_errno=True)
print("unshare", libc.unshare(0x00020000), ctypes.get_errno(), flush=True)  # -1 EPERM: mounts stay as they are
getattr(os, sys.argv[1])() if sys.argv[1] != "spawn" else __import__("subprocess").run(["true"])
print("STARTED A PROCESS", flush=True)
"""


@pytest.mark.skipif(not seccomp_supported(), reason="no seccomp filter for this architecture")
@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_filter_allows_threads_and_kills_a_new_process(how):
    r = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = r.stdout.splitlines()
    assert lines[:5] == ["thread ok", "getrlimit ok", "raise refused", "memory limited", "unshare -1 1"], r
    assert "STARTED A PROCESS" not in r.stdout
    assert r.returncode == -signal.SIGSYS, r
    reason, message = explain_death(r.returncode, r.stderr)
    assert reason == "background_work" and "start a process" in message


CUDART_CHILD = """
import sys
from sandbox.worker import guards
from sandbox.confinement import limits
if sys.argv[1] == "resolved":
    guards.resolve_cuda_runtime()  # what a CUDA worker does when it opens its device, before the filter
limits.install_seccomp()
guards.reset_persisting_l2()  # every timed CUDA call does this, under the filter
print("timed-call helpers ok", flush=True)
"""


@pytest.mark.skipif(not seccomp_supported(), reason="no seccomp filter for this architecture")
@pytest.mark.parametrize("order", ["resolved", "fresh"])
def test_the_cuda_timing_helpers_start_no_process(order):
    """The H200 run that killed an honest timed CUDA profile: finding libcudart went through
    ctypes.util.find_library, which runs ldconfig as a child process. Resolved before the filter it must
    not run again; fresh, it must not spawn where a soname loads."""
    import ctypes

    if order == "fresh":
        try:
            ctypes.CDLL("libcudart.so.13")
        except OSError:
            pytest.skip("no libcudart.so.13 the loader finds here")
    r = subprocess.run([sys.executable, "-c", CUDART_CHILD, order], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and "timed-call helpers ok" in r.stdout, r


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("CUDA_AGENT_LIMITS", raising=False)
    default = ResourceLimits.from_env()
    assert 0 < default.data_mb <= 32768 and default.no_processes
    monkeypatch.setenv("CUDA_AGENT_LIMIT_DATA_MB", "512")
    monkeypatch.setenv("CUDA_AGENT_LIMIT_NOFILE", "0")
    lim = ResourceLimits.from_env()
    assert (lim.data_mb, lim.nofile, lim.fsize_mb) == (512, 0, default.fsize_mb)
    # the worker reads what the judge computed, and the judge's overrides still win
    monkeypatch.setenv("CUDA_AGENT_LIMITS", lim.to_env())
    monkeypatch.delenv("CUDA_AGENT_LIMIT_DATA_MB")
    assert ResourceLimits.from_env() == lim
    monkeypatch.setenv("CUDA_AGENT_LIMITS", "off")
    assert ResourceLimits.from_env() == ResourceLimits(**{k: 0 for k in ResourceLimits.__dataclass_fields__})


def test_deaths_by_a_limit_are_named():
    lim = ResourceLimits(data_mb=256, cpu_s=7, fsize_mb=3)
    assert explain_death(-signal.SIGXCPU, "", lim)[0] == "resource_limit"
    assert "7 CPU seconds" in explain_death(-signal.SIGXCPU, "", lim)[1]
    assert "3 MiB" in explain_death(-signal.SIGXFSZ, "", lim)[1]
    abort = "terminate called after throwing an instance of 'std::bad_alloc'"
    assert "256 MiB of host memory" in explain_death(-signal.SIGABRT, abort, lim)[1]
    assert explain_death(-signal.SIGSEGV, "Segmentation fault", lim) is None  # an ordinary crash stays one


LIMIT_OPTIONS = {"--process-threads": ("CUDA_AGENT_LIMIT_THREADS", "64"), "--process-memory-mb": ("CUDA_AGENT_LIMIT_DATA_MB", "2048"),
                 "--process-file-mb": ("CUDA_AGENT_LIMIT_FSIZE_MB", "100"), "--build-memory-mb": ("CUDA_AGENT_BUILD_MEMORY_MB", "3000"),
                 "--build-file-mb": ("CUDA_AGENT_BUILD_FILE_MB", "32"), "--build-tasks": ("CUDA_AGENT_BUILD_TASKS", "512")}


def test_serve_lists_the_limits_and_hands_them_to_the_judge(monkeypatch):
    """`serve --help` names each limit; set, each reaches what the judge reads (its workers' and builds' limits)."""
    from typer.testing import CliRunner

    from cuda_agent.cli import app
    from mcp_server import serve
    from sandbox.build.jail import BuildLimits

    for env, _ in LIMIT_OPTIONS.values():
        monkeypatch.setenv(env, "1")  # restored after the test
        monkeypatch.delenv(env)
    monkeypatch.setattr(serve, "main", lambda **kw: 0)
    shown = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output
    assert all(option in shown for option in LIMIT_OPTIONS), shown
    args = [part for option, (_, value) in LIMIT_OPTIONS.items() for part in (option, value)]
    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 0, r.output
    lim = ResourceLimits.from_env()
    assert (lim.threads, lim.data_mb, lim.fsize_mb) == (64, 2048, 100)
    assert BuildLimits.from_env() == BuildLimits(memory_mb=3000, file_mb=32, tasks=512)
    assert CliRunner().invoke(app, ["serve", "--build-file-mb", "-1"]).exit_code != 0
