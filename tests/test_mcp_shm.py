"""Two HTTP clients and the exchange area (MCP server III, case 1). A real server process on loopback with two
tokens, two real SDK clients, the CPU backend, the judge as root as on the GPU hosts.

Client B's task source, run by the task check while client A's correct kernel is verified, does what the red team's
did: it watches /dev/shm (where it then saw each judgment's session folder and files, read A's task source and
overwrote A's outputs as they were closed), and for several seconds writes into every file in /dev/shm it can name.
Its report comes back in the tool's error; A's verdict must not move.
"""

from __future__ import annotations

import json
import os
import re
import uuid

import anyio
import pytest
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from test_mcp import call, write_solution

from conftest import http_mcp_server

TOKEN_A = "token-a-" + "a" * 24
TOKEN_B = "token-b-" + "b" * 24
# full suite only (tests/README.md): a real HTTP server, two clients and seconds of probing; the exchange area's
# privacy in the default tier: test_relay.py, test_judge_clock.py
pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.full]

PROBE = r'''
import ctypes, errno, json, os, struct, time

libc = ctypes.CDLL(None, use_errno=True)
report = {"watch_shm": None, "seen": [], "written": 0}
fd = libc.inotify_init1(0o4000)  # IN_NONBLOCK
watches = {}

def watch(p):
    wd = libc.inotify_add_watch(fd, p.encode(), 0x100 | 0x8)  # IN_CREATE | IN_CLOSE_WRITE
    if wd >= 0:
        watches[wd] = p
    return "watching" if wd >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

report["watch_shm"] = watch("/dev/shm") if fd >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
end = time.monotonic() + __SECONDS__
while fd >= 0 and time.monotonic() < end:
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        time.sleep(0.005)
        continue
    at = 0
    while at < len(data):
        wd, mask, _, size = struct.unpack_from("iIII", data, at)
        name = data[at + 16:at + 16 + size].rstrip(b"\0").decode()
        at += 16 + size
        path = os.path.join(watches.get(wd, "?"), name)
        if mask & 0x40000000:  # a folder: watch it too
            watch(path)
        elif mask & 0x8:  # a file closed after writing: overwrite its start, as the red team did
            report["seen"].append(path)
            try:
                with open(path, "r+b") as f:
                    f.write(b"\xff" * 16)
                report["written"] += 1
            except OSError:
                pass
raise RuntimeError("REPORT" + json.dumps(report) + "REPORT")
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


def _client(url: str, token: str):
    from mcp import Client

    return Client(streamable_http_client(url, http_client=create_mcp_http_client(
        headers={"Authorization": f"Bearer {token}"})))


async def test_one_clients_task_code_reaches_no_file_of_anothers_judgment(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with http_mcp_server(root, tmp_path / "server.log", [TOKEN_A, TOKEN_B]) as (url, _):
        async with _client(url, TOKEN_A) as a, _client(url, TOKEN_B) as b:
            ws = (await call(a, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
            await write_solution(a, ws, "cpu")
            assert (await call(a, "compile", {"workspace_id": ws}))["ok"]
            verdicts: list[dict] = []
            probe: dict = {}

            async def judge_a() -> None:
                await anyio.sleep(1.0)  # B's probe is running by then, and runs past A's verify
                for _ in range(2):
                    verdicts.append(await call(a, "verify", {"workspace_id": ws}))

            async def probe_b() -> None:
                r = await b.call_tool("open_task", {"source": PROBE.replace("__SECONDS__", "15"), "name": "probe"})
                text = "".join(getattr(c, "text", "") for c in r.content).replace('\\"', '"')
                m = re.search(r"REPORT(\{.*?\})REPORT", text)
                assert r.is_error and m, text[:2000]
                probe.update(json.loads(m.group(1)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(probe_b)
                tg.start_soon(judge_a)
    assert [v["ok"] for v in verdicts] == [True, True], [v.get("message", "")[:500] for v in verdicts]
    assert probe["watch_shm"] == "EPERM" and probe["written"] == 0, probe  # no watch, so nothing named


LEFTOVER = r'''
import time
with open("/dev/shm/__MARK__", "wb") as f:
    f.write(b"x" * (1 << 20))
time.sleep(__SLEEP__)
raise RuntimeError("left")
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.randn(4)]
def get_init_inputs():
    return []
'''


def _in_shm(name: str) -> list[str]:
    """Paths under the host's /dev/shm whose name contains `name`, or whose text does (a task.py)."""
    found = []
    for top, _, files in os.walk("/dev/shm"):
        for f in files:
            path = os.path.join(top, f)
            try:
                if name in f or (f.endswith(".py") and name in open(path, errors="replace").read()):
                    found.append(path)
            except OSError:
                pass
    return found


async def test_what_a_client_leaves_in_dev_shm_goes_with_its_call_even_a_cancelled_one(tmp_path):
    """Cases 2 and 7b: a task's file in /dev/shm outlived the workspace and the server (RAM, any number); a call
    cancelled mid-check left its session folder (the task's text among it) for good."""
    root = tmp_path / "root"
    root.mkdir()
    mark = f"cuda-agent-test-leftover-{uuid.uuid4().hex}"
    with http_mcp_server(root, tmp_path / "server.log", [TOKEN_A, TOKEN_B]) as (url, _):
        async with _client(url, TOKEN_B) as b:
            r = await b.call_tool("open_task", {"source": LEFTOVER.replace("__MARK__", mark).replace("__SLEEP__", "0"),
                                                "name": "leftover"})
            assert r.is_error and "left" in r.content[0].text, r.content[0].text[:1000]
            assert _in_shm(mark) == []  # the check's own /dev/shm went with its worker

            slow = LEFTOVER.replace("__MARK__", mark).replace("__SLEEP__", "120")
            with anyio.fail_after(90):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(b.call_tool, "open_task", {"source": slow, "name": "leftover"})
                    while len(_in_shm(mark)) < 2:  # its file in its /dev/shm, its source in its scratch
                        await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()
            for _ in range(100):
                if not _in_shm(mark):
                    break
                await anyio.sleep(0.1)
            assert _in_shm(mark) == []
