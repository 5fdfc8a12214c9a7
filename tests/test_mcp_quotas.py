"""The MCP server under concurrent and competing clients: atomic file edits, per-client quotas, and no server
path in anything a client is sent. Two real clients (tokens) over streamable HTTP on loopback, CPU backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError
from test_mcp import REPO, SMALL_TASK, TOKEN_A, TOKEN_B, call, http_client, make_app, tool_error

from conftest import http_mcp_server
from mcp_server.config import ServerConfig
from mcp_server.redact import Redactor
from mcp_server.scheduling import Scheduler
from sandbox.api import init_workspace

pytestmark = pytest.mark.anyio
MAX_WORKSPACES = 4  # with two tokens each client may hold half: 2


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("quota-root")
    log = root.parent / "quota-server.log"
    with http_mcp_server(root, log, [TOKEN_A, TOKEN_B], ["--max-workspaces", str(MAX_WORKSPACES)]) as (url, proc):
        yield url, root
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()


async def open_ws(client: Client) -> str:
    return (await call(client, "open_task", {"task": "example/swish_bias"}))["workspace_id"]


async def outcome(client: Client, tool: str, args: dict[str, Any]) -> tuple[bool, str]:
    r = await client.call_tool(tool, args)
    return not r.is_error, r.content[0].text


# ---- atomic writes -------------------------------------------------------------------------------

async def test_concurrent_edits_of_one_file_are_all_applied(server):
    url, root = server
    n = 60
    async with http_client(url, TOKEN_A) as client:
        ws = await open_ws(client)
        try:
            await call(client, "write_file", {"workspace_id": ws, "path": "kernels/log.cpp", "content": "// top\n"})
            results: dict[int, tuple[bool, str]] = {}

            async def edit(i: int) -> None:
                # every edit keeps the anchor, so applied one after another all of them match exactly once
                results[i] = await outcome(client, "edit_file", {
                    "workspace_id": ws, "path": "kernels/log.cpp", "old_text": "// top\n",
                    "new_text": f"// top\n// marker-{i:03d}\n"})

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(edit, i)
            text = (await call(client, "read_file", {"workspace_id": ws, "path": "kernels/log.cpp"}))["content"]
            ok = [i for i, (good, _) in results.items() if good]
            for i, (good, msg) in results.items():
                assert text.count(f"marker-{i:03d}") == (1 if good else 0), (i, good, msg)
            # queued behind each other, none is refused (a refusal would be a lost edit the client must redo)
            assert len(ok) == n, [msg for good, msg in results.values() if not good][:3]
            names = [f["path"] for f in (await call(client, "list_files", {"workspace_id": ws}))["files"]]
            assert not [p for p in names if p.endswith(".tmp")], "temporary files were left behind"
        finally:
            await call(client, "close_workspace", {"workspace_id": ws})


async def test_concurrent_writes_leave_one_whole_content(server):
    url, _ = server
    contents = [f"// writer {i}\n" + f"int w{i}_{{0}};\n" * 2000 for i in range(40)]
    async with http_client(url, TOKEN_B) as client:
        ws = await open_ws(client)
        try:
            results: list[tuple[bool, str]] = []

            async def write(content: str) -> None:
                results.append(await outcome(client, "write_file", {
                    "workspace_id": ws, "path": "kernels/w.cpp", "content": content}))

            async with anyio.create_task_group() as tg:
                for c in contents:
                    tg.start_soon(write, c)
            assert all(good for good, _ in results), [msg for good, msg in results if not good][:3]
            final = await call(client, "read_file", {"workspace_id": ws, "path": "kernels/w.cpp", "unit": "chars",
                                                     "limit": 10 ** 6})
            assert final["total"] == len(final["content"]) and final["content"] in contents
            names = [f["path"] for f in (await call(client, "list_files", {"workspace_id": ws}))["files"]]
            assert [p for p in names if "w.cpp" in p] == ["kernels/w.cpp"]
        finally:
            await call(client, "close_workspace", {"workspace_id": ws})


async def test_concurrent_writes_cannot_overshoot_the_workspace_limit(tmp_path):
    limit, chunk, room, writers = 1 << 16, 2048, 4, 24
    app = make_app(tmp_path, check_tasks=False, max_workspace_bytes=limit)
    async with Client(app.mcp) as client:
        ws = (await call(client, "open_task", {"source": SMALL_TASK.read_text(), "name": "small"}))["workspace_id"]
        used = (await call(client, "list_files", {"workspace_id": ws}))["total_bytes"]
        pad = limit - used - room * chunk - chunk // 2  # space for `room` more chunks, not one more
        assert pad > 0
        await call(client, "write_file", {"workspace_id": ws, "path": "kernels/pad.txt", "content": "p" * pad})
        # a race is a matter of luck: several rounds, each from the same free space (the chunks emptied again)
        async def write(i: int, results: list[tuple[bool, str]]) -> None:
            results.append(await outcome(client, "write_file", {
                "workspace_id": ws, "path": f"kernels/c{i}.cpp", "content": "c" * chunk}))

        for _ in range(6):
            results: list[tuple[bool, str]] = []
            async with anyio.create_task_group() as tg:
                for i in range(writers):
                    tg.start_soon(write, i, results)
            assert sum(good for good, _ in results) == room, [msg for _, msg in results]
            assert all("byte limit" in msg for good, msg in results if not good)
            assert (await call(client, "list_files", {"workspace_id": ws}))["total_bytes"] <= limit
            for f in (await call(client, "list_files", {"workspace_id": ws}))["files"]:
                if f["path"].startswith("kernels/c"):
                    await call(client, "write_file", {"workspace_id": ws, "path": f["path"], "content": ""})
    app.shutdown()


def test_workspace_writers_in_threads_never_share_a_temporary_file(tmp_path):
    # below the server's lock: threads of one process writing one file each write a whole file of their own
    ws, _ = init_workspace("example/swish_bias", tmp_path / "ws", "cpu", check=False)
    contents = [f"// thread {i}\n" * 500 for i in range(16)]

    def write(content: str) -> None:
        for _ in range(40):
            ws.write_text("kernels/k.cpp", content)

    with ThreadPoolExecutor(len(contents)) as pool:
        for f in [pool.submit(write, c) for c in contents]:
            f.result()  # a temporary file renamed or replaced by another thread fails here
    assert (ws.root / "kernels" / "k.cpp").read_text() in contents
    assert sorted(p.name for p in (ws.root / "kernels").iterdir()) == ["k.cpp"]


# ---- quotas --------------------------------------------------------------------------------------

async def test_one_client_cannot_take_every_workspace(server):
    url, _ = server
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        mine = [await open_ws(a), await open_ws(a)]
        theirs: list[str] = []
        try:
            err = await tool_error(a, "open_task", {"task": "example/swish_bias"})
            assert "your client has 2 open workspaces, its limit" in err and "close_workspace" in err, err
            theirs.append(await open_ws(b))  # two slots of four are still free for the other client
            await call(a, "close_workspace", {"workspace_id": mine.pop()})
            mine.append(await open_ws(a))  # a closed one frees the client's share again
        finally:
            for ws in mine:
                await call(a, "close_workspace", {"workspace_id": ws})
            for ws in theirs:
                await call(b, "close_workspace", {"workspace_id": ws})


def test_per_client_defaults_and_help():
    two = ServerConfig(transport="http", tokens=[TOKEN_A, TOKEN_B], max_workspaces=16, max_concurrent_compiles=8)
    assert (two.max_workspaces_per_client, two.max_compiles_per_client) == (8, 4)
    assert two.judgments_per_client(1) == 2 and two.judgments_per_client(8) == 4
    # one principal (one token, or stdio) starves nobody: the server's limits are its own
    one = ServerConfig(transport="http", tokens=[TOKEN_A], max_workspaces=16, max_concurrent_compiles=8)
    assert (one.max_workspaces_per_client, one.max_compiles_per_client) == (16, 8)
    assert one.judgments_per_client(1) is None
    tiny = ServerConfig(tokens=[TOKEN_A, TOKEN_B], max_workspaces=1, max_concurrent_compiles=1)
    assert (tiny.max_workspaces_per_client, tiny.max_compiles_per_client) == (1, 1)
    given = ServerConfig(tokens=[TOKEN_A, TOKEN_B], max_workspaces=4, max_workspaces_per_client=9,
                         max_compiles_per_client=3, max_judgments_per_client=5, max_concurrent_compiles=8)
    assert (given.max_workspaces_per_client, given.max_compiles_per_client) == (4, 3)
    assert given.judgments_per_client(8) == 5
    env = {**os.environ, "COLUMNS": "200"}
    help_text = subprocess.run([sys.executable, "-m", "cuda_agent", "serve", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=REPO, env=env).stdout
    for flag in ("--max-workspaces-per-client", "--max-compiles-per-client", "--max-judgments-per-client"):
        assert flag in help_text, flag


async def test_a_client_over_its_compile_quota_waits_and_the_other_does_not():
    sched = Scheduler(4, [], compiles_per_client=2)
    notes: dict[str, list[str]] = {"a": [], "b": []}
    inside: list[str] = []
    release = anyio.Event()

    async def compile_(who: str, tag: str) -> None:
        async def note(msg: str) -> None:
            notes[who].append(msg)

        async with sched.compile_slot(note, owner=who):
            inside.append(tag)
            await release.wait()

    async with anyio.create_task_group() as tg:
        for tag in ("a1", "a2", "a3"):
            tg.start_soon(compile_, "a", tag)
        await anyio.sleep(0.05)
        tg.start_soon(compile_, "b", "b1")
        await anyio.sleep(0.05)
        # two global slots are free, yet a's third waits for one of its own; b is let in at once
        assert sorted(inside) == ["a1", "a2", "b1"]
        assert notes["a"] == ["queued: your client has 2 compiles running, its limit; this one starts when one "
                              "of them ends"]
        assert notes["b"] == []
        release.set()
    assert sorted(inside) == ["a1", "a2", "a3", "b1"]


async def test_a_client_over_its_judgment_quota_waits_and_the_other_does_not():
    sched = Scheduler(1, ["0", "1"], judgments_per_client=2)
    notes: list[str] = []
    running: list[str] = []
    release = anyio.Event()

    async def verify(who: str, tag: str) -> None:
        async def note(msg: str) -> None:
            notes.append(f"{tag}: {msg}")

        async with sched.judgment_slot("cuda", who, exclusive=False, label=tag, on_queued=note):
            running.append(tag)
            await release.wait()

    async with anyio.create_task_group() as tg:
        for tag in ("a1", "a2", "a3", "a4"):
            tg.start_soon(verify, "a", tag)
        await anyio.sleep(0.05)
        tg.start_soon(verify, "b", "b1")
        await anyio.sleep(0.05)
        assert sorted(running) == ["a1", "a2", "b1"]  # verifies share a device: only the quota holds a3, a4
        assert sorted(n.split(":")[0] for n in notes) == ["a3", "a4"]
        assert all("your client has 2 verify/profile calls running" in n for n in notes)
        release.set()
    assert sorted(running) == ["a1", "a2", "a3", "a4", "b1"]


# ---- no server paths ----------------------------------------------------------------------------

def test_redactor_replaces_whole_path_prefixes_only(tmp_path):
    root = tmp_path / "srv"
    r = Redactor(root, [(root, "<server-root>"), ("/home/someone", "~")])
    assert r.text(f"{root}/ws-0a1b/kernels/a.cpp:3:1: error") == "kernels/a.cpp:3:1: error"
    assert r.text(f"cd {root}/ws-0a1b && c++ -I{root}/ws-0a1b/build -I/home/someone/x") == "cd . && c++ -Ibuild -I~/x"
    assert r.text(f"{root}x /home/someonex /work/home/someone/y") == f"{root}x /home/someonex /work/home/someone/y"
    assert r.data({"/home/someone/k": [f"{root}/.x", 1, None]}) == {"~/k": ["<server-root>/.x", 1, None]}


async def test_no_reply_or_error_names_a_server_path(server):
    url, root = server
    cache = os.environ["CUDA_AGENT_CACHE"]
    home = str(Path.home())
    secret = [str(root), str(root.resolve()), cache, str(REPO)]
    home_re = re.compile(re.escape(home) + r"(?![\w.-])")
    seen: list[str] = []

    def record(text: str, structured: Any = None) -> None:
        seen.append(text)
        if structured is not None:
            seen.append(json.dumps(structured))

    async def any_call(client: Client, tool: str, args: dict[str, Any]) -> Any:
        r = await client.call_tool(tool, args)
        record(r.content[0].text, r.structured_content)
        return r

    async with http_client(url, TOKEN_A) as client:
        opened = await any_call(client, "open_task", {"task": "example/swish_bias"})
        ws = opened.structured_content["workspace_id"]
        w = {"workspace_id": ws}
        try:
            assert opened.structured_content["workdir"] == "."
            # an OS error (a file used as a folder), a missing file, a protected one, a bad edit
            for tool, args in [("write_file", {"path": "model_new.py/x.cpp", "content": "x"}),
                               ("read_file", {"path": "kernels/missing.cu"}),
                               ("write_file", {"path": "model.py", "content": "x"}),
                               ("edit_file", {"path": "model_new.py", "old_text": "no such text", "new_text": ""}),
                               ("verify", {}), ("list_files", {})]:
                await any_call(client, tool, {**w, **args})
            bad = await any_call(client, "write_file", {**w, "path": "model_new.py/x.cpp", "content": "x"})
            assert bad.is_error and "model_new.py" in bad.content[0].text
            # a build that fails: the compiler's diagnostics and the build log name every file absolutely
            await any_call(client, "write_file", {**w, "path": "kernels/bad.cpp", "content": "int f( {\n"})
            built = await any_call(client, "compile", w)
            assert not built.structured_content["ok"]
            assert "kernels/bad.cpp" in built.content[0].text + json.dumps(built.structured_content)
            await any_call(client, "read_file", {**w, "path": "build/compile.log", "unit": "chars"})
            with pytest.raises(MCPError) as info:
                await client.read_resource("workspace://ws-000000000000/model.py")
            record(str(info.value))
        finally:
            await call(client, "close_workspace", {"workspace_id": ws})
    assert len(seen) >= 15
    for text in seen:
        for path in secret:
            assert path not in text, (path, text[:3000])
        assert not home_re.search(text), (home, text[:3000])
