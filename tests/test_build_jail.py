"""The compilers and the linker of a workspace's build run confined (MCP server II, item 3).

A source is a client's text, and the compiler opens whatever it names: the red team's `#include` of an
absolute path returned another client's kernel through the compile diagnostics and the build log. Each case
below would hand a secret back in the CompileResult or the log if the compiler could read it; each must fail
to build with the secret nowhere in what comes back, through the object cache's launcher and the jail alone
(no object cache). The environment of a build holds no token or key. An honest build still builds.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.api import compile_workspace
from sandbox.build import jail
from sandbox.build.ninja_run import _run_ninja
from sandbox.config import CompileConfig
from sandbox.confinement import pidgroup
from sandbox.confinement.filesystem import abi_version
from sandbox.workspace import Workspace
from tasks import load_task

SECRET = "SECRET-" + "k3y" * 8
ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.skipif(abi_version() < 1, reason="needs Landlock: without it a build runs unconfined")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    """Another client's kernel, a process with a token in its command line and environment."""
    root = tmp_path_factory.mktemp("secrets")
    other = root / "ws-other" / "kernels" / "secret.h"
    other.parent.mkdir(parents=True)
    other.write_text(f"#error {SECRET}\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--token", SECRET],
                            env={**os.environ, "CUDA_AGENT_MCP_TOKEN": SECRET})
    try:
        yield {"other": str(other), "pid": proc.pid}
    finally:
        proc.kill()
        proc.wait()


CASES = {
    "include_other_workspace": '#include "{other}"\n',
    "include_server_cmdline": '#include "/proc/{pid}/cmdline"\n',
    "include_server_environ": '#include "/proc/{pid}/environ"\n',
    "incbin_other_workspace": 'asm(".incbin \\"{other}\\"");\n',
    "own_environ": '#include "/proc/self/environ"\n',
}


# the default tier: every case through the object cache, the first also through the jail alone; the others'
# jail-only builds in the full suite (tests/README.md)
@pytest.mark.parametrize("case, object_cache", [
    pytest.param(c, oc, id=f"{'objcache' if oc else 'jail-only'}-{c}", marks=() if oc or c == sorted(CASES)[0] else pytest.mark.full)
    for c in sorted(CASES) for oc in (True, False)])
def test_a_build_cannot_read_what_is_not_its_own(case, object_cache, secrets, small_task_path, tmp_path,
                                                 monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)  # the judge's environment holds secrets; the build's must not
    monkeypatch.setenv("CUDA_AGENT_MCP_TOKEN", SECRET)
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/leak.cpp", CASES[case].format(**secrets) + "int leak() { return 1; }\n")
    r = compile_workspace(ws, CompileConfig(object_cache=object_cache))
    if case != "own_environ":  # the compiler's own environment may be read: it is scrubbed of secrets
        assert not r.ok and r.reason == "compile_error", r.message
    assert SECRET not in r.model_dump_json(), "the secret came back in the compile result"
    assert SECRET not in (ws.build_dir / "compile.log").read_text(errors="replace")


def test_the_build_environment_is_scrubbed_and_carries_the_rules(tmp_path):
    env = jail.build_env(["/usr"], [str(tmp_path)], str(tmp_path / "tmp"),
                         base={"PATH": "/usr/bin", "OPENAI_API_KEY": SECRET, "CUDA_AGENT_MCP_TOKEN": SECRET,
                               "CPATH": "/x", "HOME": "/root"}, keep=("CPATH",))
    assert SECRET not in json.dumps(env)
    assert env["PATH"] == "/usr/bin" and env["CPATH"] == "/x" and env["TMPDIR"] == str(tmp_path / "tmp")
    rules = json.loads(env[jail.JAIL_ENV])
    assert rules["read"] == ["/usr"] and rules["write"] == [str(tmp_path)]
    assert rules["limits"] == dataclasses.asdict(jail.BuildLimits.from_env({}))  # the judge's environment sets none
    assert rules["limits"]["memory_mb"] >= 1024 and rules["limits"]["file_mb"] == 64


def test_the_build_limits_come_from_the_judges_environment(tmp_path):
    env = jail.build_env([], [str(tmp_path)], str(tmp_path / "tmp"),
                         base={"CUDA_AGENT_BUILD_MEMORY_MB": "300", "CUDA_AGENT_BUILD_FILE_MB": "5",
                               "CUDA_AGENT_BUILD_TASKS": "0"})
    assert json.loads(env[jail.JAIL_ENV])["limits"] == {"memory_mb": 300, "file_mb": 5, "tasks": 0}
    with pytest.raises(ValueError, match="CUDA_AGENT_BUILD_FILE_MB must be a whole number"):
        jail.BuildLimits.from_env({"CUDA_AGENT_BUILD_FILE_MB": "lots"})


def test_the_jail_confines_what_it_runs(tmp_path):
    """jail.py itself: the command it execs reads the allowed folder and nothing beside it."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (mine / "a").write_text("mine")
    (other / "b").write_text(SECRET)
    env = jail.build_env([str(mine)], [str(mine)], str(mine / "tmp"), base=dict(os.environ))
    run = [*jail.launcher(), "/bin/sh", "-c", f"cat {mine}/a; cat {other}/b; echo ok > {mine}/w; echo x > {other}/w"]
    out = subprocess.run(run, env=env, capture_output=True, text=True)
    assert "mine" in out.stdout and SECRET not in out.stdout + out.stderr
    assert (mine / "w").read_text() == "ok\n" and not (other / "w").exists()


# Resource limits of a build's tools (MCP server III, item 2): they hold as root, and say what stopped the build.

@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_compiler_opens_no_device_but_dev_null(device, small_task_path, tmp_path):
    """22 bytes, `#include "/dev/zero"`, made a compiler read until the host's memory ran out."""
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/endless.cpp", f'#include "{device}"\nint endless() {{ return 1; }}\n')
    r = compile_workspace(ws, CompileConfig(object_cache=False))
    assert not r.ok and r.reason == "compile_error"
    assert f"{device}: Permission denied" in r.message, r.message


def test_a_compiler_runs_out_of_its_memory_with_a_clear_message(small_task_path, tmp_path, monkeypatch):
    """An include of a huge readable file (torch's largest library, hundreds of MiB) under a 256 MiB limit."""
    import torch

    lib = max((p for p in (Path(torch.__file__).parent / "lib").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    assert lib.stat().st_size > 300 << 20, f"{lib} is too small to need more than the limit"
    monkeypatch.setenv("CUDA_AGENT_BUILD_MEMORY_MB", "256")
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/huge.cpp", f'#include "{lib}"\nint huge() {{ return 1; }}\n')
    r = compile_workspace(ws, CompileConfig(object_cache=False))
    assert not r.ok and r.reason == "compile_error"
    assert "ran out of its 256 MiB of memory" in r.message, (r.message, r.log_tail)


@pytest.mark.parametrize("object_cache", [True, False], ids=["objcache", "jail-only"])
def test_a_huge_object_is_refused_and_an_honest_build_is_far_below_the_limit(object_cache, small_task_path, tmp_path):
    """80 bytes of source made a 128 MiB object (and extension, and object-cache entry)."""
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "blob", backend="cpu")
    ws.write_text("kernels/blob.cpp", "char blob[128 << 20] = {1};\nint blob_size() { return sizeof(blob); }\n")
    r = compile_workspace(ws, CompileConfig(object_cache=object_cache))
    assert not r.ok and r.reason == "compile_error"
    assert "larger than its limit of 64 MiB per file" in r.message, (r.message, r.log_tail)
    assert all(p.stat().st_size <= 64 << 20 for p in ws.build_dir.rglob("*") if p.is_file())

    honest = Workspace.create(load_task(str(ROOT / "tasks" / "examples" / "swish_bias.py")), tmp_path / "honest",
                              backend="cpu")
    shutil.copytree(ROOT / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu" / "kernels", honest.root / "kernels",
                    dirs_exist_ok=True)
    r = compile_workspace(honest, CompileConfig(object_cache=object_cache))
    assert r.ok, r.message
    assert (honest.build_dir / "cuda_extension.so").stat().st_size < 8 << 20  # the limit leaves 8x headroom


@pytest.mark.skipif(pidgroup.base() is None, reason=f"no writable cgroup pids hierarchy: {pidgroup.why_none()}")
def test_a_builds_tools_share_one_pids_group(tmp_path, monkeypatch):
    """ninja and every tool it starts run in one cgroup pids group of CUDA_AGENT_BUILD_TASKS."""
    monkeypatch.setenv("CUDA_AGENT_BUILD_TASKS", "77")
    build = tmp_path / "build"
    build.mkdir()
    script = "from sandbox.confinement import pidgroup; print(pidgroup.current())"
    (build / "build.ninja").write_text(f"rule where\n  command = PYTHONPATH={ROOT} "
                                       f"{sys.executable} -c '{script}' > $out\nbuild a.txt: where\nbuild b.txt: where\n")
    rc, log = _run_ninja(build, tmp_path / "build.log", 120, 2)
    assert rc == 0, log
    groups = {(build / f).read_text().strip() for f in ("a.txt", "b.txt")}
    assert len(groups) == 1, groups  # both tools in ninja's group
    folder, most = ast.literal_eval(groups.pop())
    assert os.path.basename(folder).startswith("b") and most == "78", (folder, most)  # ninja itself, and 77 more
