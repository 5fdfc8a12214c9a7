"""MCP server III, cases 5, 6, 8, 9, 10 and 11: what one client's workspaces make on the server, and what another
client can learn of it. A real server process on loopback with two bearer tokens, two real SDK clients over
streamable HTTP, real g++ builds (light sources without torch's headers: what is under test is the server's
accounting and the object cache, not the compiler).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from test_mcp import REPO, TOKEN_A, TOKEN_B, call, http_client, tool_error

from conftest import http_mcp_server
from mcp_server.app import CudaAgentServer
from mcp_server.auth import principal
from mcp_server.config import ServerConfig
from mcp_server.redact import Redactor
from mcp_server.workspaces import DEFAULT_ID
from sandbox.confinement.filesystem import abi_version, shared_caches_trusted

pytestmark = pytest.mark.anyio
LIMIT = 2 << 20  # --max-workspace-bytes (and --max-file-bytes): a 4 MiB object is over it, a light build far under
LIGHT = "int light_fn() { return 42; }\n"
BLOB = "char blob[4 << 20] = {1};\nint blob_fn() { return blob[0]; }\n"
TRUSTED = pytest.mark.skipif(not shared_caches_trusted(), reason="no Landlock: the object cache is not used here")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenancy-root")
    log = root.parent / "tenancy-server.log"
    limits = ["--max-workspace-bytes", str(LIMIT), "--max-file-bytes", str(LIMIT)]
    with http_mcp_server(root, log, [TOKEN_A, TOKEN_B], limits) as (url, proc):
        yield url, root, proc.pid
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log.read_text()
    # what the clients' compiles kept goes with the server (the root itself was given, so it stays)
    assert not (root / ".objects").exists()


async def open_ws(client: Any) -> str:
    return (await call(client, "open_task", {"task": "example/swish_bias"}))["workspace_id"]


def kept_objects(root: Path) -> list[Path]:
    return sorted((root / ".objects").rglob("*.o"))


# ---- case 5: build output is counted, bounded and goes away -------------------------------------------------
@TRUSTED
async def test_build_output_counts_against_the_quota_and_goes_with_the_workspace(server):
    url, root, _ = server
    async with http_client(url, TOKEN_A) as a:
        ws = await open_ws(a)
        before = kept_objects(root)
        await call(a, "write_file", {"workspace_id": ws, "path": "kernels/blob.cpp", "content": BLOB})
        err = await tool_error(a, "compile", {"workspace_id": ws})
        assert f"over its {LIMIT}-byte limit" in err and "was removed" in err, err
        build = root / ws / "build"
        assert not list(build.glob("*.o")) and not (build / "cuda_extension.so").exists()
        assert kept_objects(root) == before, "the refused build's object stayed in the cache"

        # an honest build: its output and what it kept are counted, and listed
        await call(a, "write_file", {"workspace_id": ws, "path": "kernels/blob.cpp", "content": LIGHT})
        built = await call(a, "compile", {"workspace_id": ws})
        assert built["ok"], built
        listed = await call(a, "list_files", {"workspace_id": ws})
        so = (build / "cuda_extension.so").stat().st_size
        assert listed["build_bytes"] > so, listed["build_bytes"]
        mine = [p for p in kept_objects(root) if p not in before]
        assert mine, "the build kept nothing in its client's cache"
        # a file that would fit beside the agent's files alone but not beside the build's output too
        room = LIMIT - listed["total_bytes"] - listed["build_bytes"]
        err = await tool_error(a, "write_file", {"workspace_id": ws, "path": "kernels/pad.txt",
                                                 "content": "p" * (room + listed["build_bytes"] // 2)})
        assert "of them the build's output" in err, err

        await call(a, "close_workspace", {"workspace_id": ws})
        assert not (root / ws).exists()
        assert not [p for p in mine if p.exists()], "the closed workspace's cache entries stayed"


# ---- case 9 and issue 68 item 4 over the server: reused says nothing of another client ------------------------
@TRUSTED
async def test_reused_names_only_the_clients_own_compiles(server):
    url, root, _ = server
    source = "int shared_fn() { return 7; }\n"
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        ws_a = await open_ws(a)
        await call(a, "write_file", {"workspace_id": ws_a, "path": "kernels/s.cpp", "content": source})
        first = await call(a, "compile", {"workspace_id": ws_a})
        assert first["ok"] and first["reused"] == [], first
        ws_b1, ws_b2 = await open_ws(b), await open_ws(b)
        await call(b, "write_file", {"workspace_id": ws_b1, "path": "kernels/s.cpp", "content": source})
        other = await call(b, "compile", {"workspace_id": ws_b1})
        assert other["ok"] and other["reused"] == [], "B was told that A had compiled this source"
        await call(b, "write_file", {"workspace_id": ws_b2, "path": "kernels/s.cpp", "content": source})
        own = await call(b, "compile", {"workspace_id": ws_b2})
        assert own["ok"] and own["reused"] == ["kernels/s.cpp"], "B's own cache does not work"
        for client, ws in ((a, ws_a), (b, ws_b1), (b, ws_b2)):
            await call(client, "close_workspace", {"workspace_id": ws})
    assert kept_objects(root) == []


# ---- case 11: a name the build cannot take is refused where it is written ----------------------------------
def _nested(length: int) -> str:
    folder = "d" * 128
    return f"kernels/{folder}/" + "f" * (length - len(f"kernels/{folder}/") - len(".cpp")) + ".cpp"


async def test_a_source_name_the_build_cannot_make_is_refused_at_write(server):
    """The limit is the build's: at 256 characters a source builds as every source does; past it the thin compile's
    output file cannot be made (the build falls back to the slow full compile), and past 259 the depfile cannot."""
    url, root, _ = server
    longest, too_long = _nested(256), _nested(257)
    async with http_client(url, TOKEN_A) as a:
        ws = await open_ws(a)
        err = await tool_error(a, "write_file", {"workspace_id": ws, "path": too_long, "content": LIGHT})
        assert repr(too_long) in err and "at most 256 characters" in err, err
        await call(a, "write_file", {"workspace_id": ws, "path": "kernels/x.cpp", "content": LIGHT})
        # the longest name that is accepted really builds: the limit is the build's, not a guess
        await call(a, "write_file", {"workspace_id": ws, "path": longest, "content": "int long_fn() { return 1; }\n"})
        built = await call(a, "compile", {"workspace_id": ws})
        assert built["ok"] and longest in built["rebuilt"] + built["reused"], built
        assert longest not in built["full_bindings"], built
        # one character more, planted on the server's disk: its thin compile cannot write its output
        planted = root / ws / too_long
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_text("int planted_fn() { return 2; }\n")
        degraded = await call(a, "compile", {"workspace_id": ws})
        assert degraded["ok"] and too_long in degraded["full_bindings"], degraded
        planted.unlink()
        # and past 259 characters ninja stops on it
        broken = root / ws / _nested(260)
        broken.write_text("int broken_fn() { return 3; }\n")
        failed = await call(a, "compile", {"workspace_id": ws})
        assert not failed["ok"] and "File name too long" in failed["message"] + failed["log_tail"], failed
        await call(a, "close_workspace", {"workspace_id": ws})


# ---- case 10: the exchange area is a server path like the others ----------------------------------------------
def test_the_redactor_knows_the_exchange_area(tmp_path):
    r = Redactor.for_server(tmp_path / "srv")
    for text in ("/dev/shm/cuda-agent-4242-x1y2z3/tmpab_12/task.py", f"{tempfile.gettempdir()}/cuda-agent-7-q/t/task.py"):
        said = r.text(f'File "{text}", line 3')
        assert said.startswith('File "<exchange>/') and "cuda-agent-" not in said, said
    # a server root in the temporary folder is still the server's root, not the exchange area
    root = Path(tempfile.gettempdir()) / "cuda-agent-mcp-abc"
    assert Redactor.for_server(root).text(f"{root}/ws-0a1b/kernels/a.cpp:3") == "kernels/a.cpp:3"


# a task is checked for Model, get_inputs and get_init_inputs before it runs: each probe defines them after it raises
TASK_TAIL = '''
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.randn(4)]
def get_init_inputs():
    return []
'''
FAILING_TASK = 'raise RuntimeError("checked from " + __file__)\n' + TASK_TAIL


async def test_open_task_errors_name_no_exchange_path(server):
    url, _, _ = server
    async with http_client(url, TOKEN_B) as b:
        r = await b.call_tool("open_task", {"source": FAILING_TASK, "name": "fails"})
        assert r.is_error
        text = r.content[0].text
        assert "checked from" in text, text[:2000]
        assert "/dev/shm" not in text and f"{tempfile.gettempdir()}/cuda-agent-" not in text, text[:2000]
        # the judging process's folder is a placeholder; what is left is the judgment's own session's random names
        paths = re.findall(r"[^\s\"']*cuda-agent-[^\s\"']*", text)
        assert paths and all(p.startswith("<exchange>/") for p in paths), paths


# ---- case 8: the server's root, from a confined process of another client --------------------------------------
PROBE = r'''
import ctypes, errno, json, os

def attempt(fn):
    try:
        return "ok:" + json.dumps(fn())[:4000]
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def watch(path):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    if libc.inotify_add_watch(fd, path.encode(), 0xFFF) < 0:
        raise OSError(ctypes.get_errno(), "inotify_add_watch")
    return "watching"

def cgroup_names():
    # every group's name (v1 or v2): those that name the other client's workspace or files, and how many were read
    seen = []
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        seen += dirnames
    return [n for n in seen if __WS__ in n or "SECRET_NAME" in n], len(seen)

def mentions(path):
    text = open(path, errors="replace").read()
    return [line for line in text.splitlines() if __WS__ in line or "SECRET_NAME" in line]

raise RuntimeError("REPORT" + json.dumps({
    "list_root": attempt(lambda: os.listdir(__ROOT__)),
    "list_workspace": attempt(lambda: os.listdir(os.path.join(__ROOT__, __WS__))),
    "list_proc": attempt(lambda: os.listdir("/proc")),
    "server_cmdline": attempt(lambda: open("/proc/%d/cmdline" % __SERVER__, "rb").read().decode(errors="replace")),
    "mountinfo": attempt(lambda: mentions("/proc/self/mountinfo")),
    "mounts": attempt(lambda: mentions("/proc/mounts")),
    "cgroups": attempt(cgroup_names),
    "watch_root": attempt(lambda: watch(__ROOT__)),
}) + "REPORT")
''' + TASK_TAIL


@pytest.mark.skipif(abi_version() < 1, reason="needs Landlock (reads are not confined without it)")
async def test_another_clients_workspace_ids_and_names_do_not_reach_a_confined_process(server):
    url, root, server_pid = server
    secret_name = "kernels/SECRET_NAME_" + "q" * 12 + ".cpp"
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        ws_a = await open_ws(a)
        await call(a, "write_file", {"workspace_id": ws_a, "path": secret_name, "content": LIGHT})
        source = (PROBE.replace("__ROOT__", repr(str(root))).replace("__WS__", repr(ws_a))
                  .replace("__SERVER__", str(server_pid)))
        r = await b.call_tool("open_task", {"source": source, "name": "probe"})
        assert r.is_error
        text = r.content[0].text
        m = re.search(r"REPORT(\{.*?\})REPORT", text.replace('\\"', '"').replace("\\\\", "\\"))
        assert m, text[:3000]
        report = json.loads(m.group(1))
        for what in ("list_root", "list_workspace", "list_proc", "server_cmdline"):
            assert report[what] in ("EACCES", "EPERM"), (what, report[what][:300])
        assert not report["watch_root"].startswith("ok:"), report["watch_root"]
        for what in ("mountinfo", "mounts"):
            assert report[what] in ("ok:[]", "EACCES"), (what, report[what][:500])
        assert report["cgroups"].startswith("ok:[[]") or report["cgroups"] == "EACCES", report["cgroups"][:500]
        for what, said in report.items():
            assert ws_a not in said and "SECRET_NAME" not in said, (what, said[:500])
        await call(a, "close_workspace", {"workspace_id": ws_a})


# ---- case 6: the default workspace belongs to one client, or the server refuses to start ------------------------
def test_a_default_workspace_with_several_tokens_is_refused_at_start(tmp_path):
    cmd = [sys.executable, "-m", "cuda_agent", "serve", "--transport", "http", "--port", "0", "--backend", "cpu",
           "--root", str(tmp_path / "root"), "--task", "example/swish_bias", "--token", TOKEN_A, "--token", TOKEN_B]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "CUDA_AGENT_MCP_TOKEN"})
    assert done.returncode == 2, done.stderr
    assert "with several tokens it would be every client's" in done.stderr, done.stderr
    assert not (tmp_path / "root" / DEFAULT_ID).exists()


def test_the_default_workspace_belongs_to_the_one_token(tmp_path):
    config = ServerConfig(transport="http", tokens=[TOKEN_A], root=tmp_path / "root", backend="cpu",
                          check_tasks=False)
    app = CudaAgentServer(config)
    try:
        entry = app.open_default(task="example/swish_bias")
        assert entry.owner == principal(TOKEN_A)
        assert app.workspaces.get(None, principal(TOKEN_A)) is entry
        with pytest.raises(Exception, match="unknown workspace"):
            app.workspaces.get(None, principal(TOKEN_B))
    finally:
        app.shutdown()
