"""The compilers and the linker of a workspace's build run confined (MCP server II, item 3).

A source is a client's text, and the compiler opens whatever it names: the red team's `#include` of an
absolute path returned another client's kernel through the compile diagnostics and the build log. Each case
below would hand a secret back in the CompileResult or the log if the compiler could read it; each must fail
to build with the secret nowhere in what comes back, through the object cache's launcher and the jail alone
(no object cache). The environment of a build holds no token or key. An honest build still builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox.api import compile_workspace
from sandbox.build import jail
from sandbox.config import CompileConfig
from sandbox.confinement.filesystem import abi_version
from sandbox.workspace import Workspace
from tasks import load_task

SECRET = "SECRET-" + "k3y" * 8
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


@pytest.mark.parametrize("object_cache", [True, False], ids=["objcache", "jail-only"])
@pytest.mark.parametrize("case", sorted(CASES))
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
    assert json.loads(env[jail.JAIL_ENV]) == {"read": ["/usr"], "write": [str(tmp_path)]}


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
