"""Two HTTP clients: what one can reach of the other and of the host through the code it hands the server
(MCP server II, items 1 and 3). A real server process on loopback, started with both tokens on its command
line (as `--token` users do), two real SDK clients.

Client B tries, through a task `source` (run by the task check before any workspace exists) and through a
kernel (run by the compiler), to read the server's environment and command line (both clients' tokens) and
client A's kernel by its absolute path. Every attempt must come back refused, and no reply B receives may
carry a token or A's text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import http_mcp_server
from sandbox.confinement.filesystem import abi_version

TOKEN_A = "token-a-" + "a" * 24
TOKEN_B = "token-b-" + "b" * 24
MARKER = "A_PRIVATE_KERNEL_" + "x" * 12
# full suite only (tests/README.md): a real HTTP server and a build; in the default tier a task's code is confined
# in the check (exploits/test_task_confinement.py), a compiler in its jail (test_build_jail.py), HTTP clients
# apart (test_mcp.py)
pytestmark = [pytest.mark.anyio, pytest.mark.full,
              pytest.mark.skipif(abi_version() < 1, reason="needs Landlock (reads are not confined without it)")]

PROBE = r'''
import errno, json, os

def attempt(p):
    try:
        with open(p, "rb") as f:
            return "read:" + f.read(4000).decode(errors="replace")
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

raise RuntimeError("REPORT" + json.dumps({
    "environ": attempt("/proc/%d/environ" % __SERVER__),
    "cmdline": attempt("/proc/%d/cmdline" % __SERVER__),
    "parent_environ": attempt("/proc/%d/environ" % os.getppid()),
    "a_kernel": attempt(__A_KERNEL__),
}) + "REPORT")

import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.randn(4)]
def get_init_inputs():
    return []
'''


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcp-confined-root")
    with http_mcp_server(root, root.parent / "mcp-confined.log", [TOKEN_A, TOKEN_B]) as (url, proc):
        yield url, proc.pid, root


def client(url: str, token: str) -> Client:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    return Client(streamable_http_client(url, http_client=http))


def _text(result) -> str:
    return json.dumps(result.structured_content) + "".join(getattr(c, "text", "") for c in result.content)


async def test_a_client_reaches_neither_the_host_nor_another_client(server):
    url, server_pid, root = server
    async with client(url, TOKEN_A) as a:
        opened = await a.call_tool("open_task", {"task": "example/swish_bias"})
        assert not opened.is_error, opened.content[0].text
        ws_a = opened.structured_content["workspace_id"]
        wrote = await a.call_tool("write_file", {"workspace_id": ws_a, "path": "kernels/secret.h",
                                                 "content": f"// {MARKER}\n#error {MARKER}\n"})
        assert not wrote.is_error, wrote.content[0].text
    a_kernel = root / ws_a / "kernels" / "secret.h"
    assert a_kernel.is_file()

    async with client(url, TOKEN_B) as b:
        # 1. the task check runs B's source: its report comes back in the tool error
        source = PROBE.replace("__SERVER__", str(server_pid)).replace("__A_KERNEL__", repr(str(a_kernel)))
        refused = await b.call_tool("open_task", {"source": source, "name": "probe"})
        assert refused.is_error
        text = _text(refused)
        m = re.search(r"REPORT(\{.*?\})REPORT", text.replace('\\"', '"'))
        assert m, text[:2000]
        report = json.loads(m.group(1))
        for what in ("environ", "cmdline", "parent_environ", "a_kernel"):
            assert report[what] in ("EACCES", "EPERM"), (what, report[what][:200])
        for secret in (TOKEN_A, TOKEN_B, MARKER):
            assert secret not in text

        # 2. the compiler reads B's includes: A's kernel and the server's command line stay out of reach
        opened = await b.call_tool("open_task", {"task": "example/swish_bias"})
        assert not opened.is_error, opened.content[0].text
        ws_b = opened.structured_content["workspace_id"]
        for include in (str(a_kernel), f"/proc/{server_pid}/cmdline", f"/proc/{server_pid}/environ"):
            await b.call_tool("write_file", {"workspace_id": ws_b, "path": "kernels/steal.cpp",
                                             "content": f'#include "{include}"\nint steal() {{ return 1; }}\n'})
            built = await b.call_tool("compile", {"workspace_id": ws_b})
            text = _text(built)
            assert not built.is_error and built.structured_content["ok"] is False, text[:1500]
            for secret in (TOKEN_A, TOKEN_B, MARKER):
                assert secret not in text, (include, secret)
            log = await b.call_tool("read_file", {"workspace_id": ws_b, "path": "build/compile.log"})
            for secret in (TOKEN_A, TOKEN_B, MARKER):
                assert secret not in _text(log), (include, secret)
    assert Path(a_kernel).read_text().startswith(f"// {MARKER}")
