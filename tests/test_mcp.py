"""The MCP server through the SDK's real client: in-process, a stdio subprocess and streamable HTTP.

Extension builds dominate the runtime, so each transport runs one whole episode and the error
cases run on workspaces that are never compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import http_mcp_server
from mcp_server.app import CudaAgentServer
from mcp_server.config import WARM_HELPERS_ENV, ServerConfig
from mcp_server.runner import BUILD_PREFIX
from mcp_server.scheduling import DevicePool
from sandbox.confinement import proctree, template

REPO = Path(__file__).resolve().parent.parent
SMALL_TASK = REPO / "tests" / "fixtures" / "cpu_multi" / "small_task.py"
SOLUTIONS = REPO / "tasks" / "examples" / "solutions" / "swish_bias"
TOKEN_A = "token-a-" + "a" * 24
TOKEN_B = "token-b-" + "b" * 24
EXPECTED_TOOLS = {"list_tasks", "open_task", "close_workspace", "list_files", "read_file", "write_file",
                  "edit_file", "compile", "verify", "profile", "analyze", "read_skill"}

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_app(tmp_path: Path, **overrides: Any) -> CudaAgentServer:
    return CudaAgentServer(ServerConfig(root=tmp_path / "root", backend="cpu", **overrides))


async def call(client: Client, tool: str, args: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    r = await client.call_tool(tool, args or {}, **kw)
    assert not r.is_error, r.content[0].text
    assert r.content and r.content[0].text
    return r.structured_content or {"text": r.content[0].text}


async def tool_error(client: Client, tool: str, args: dict[str, Any]) -> str:
    r = await client.call_tool(tool, args)
    assert r.is_error, f"{tool}({args}) should have failed: {r.content[0].text}"
    return r.content[0].text


async def profiled(client: Client, args: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """A profile's result, profiled again while it is timing_noisy, as the tool's message asks an agent to (with
    pauses of 1 to 16 s): these tests are about the tools, not the 2-core CI machine's neighbours."""
    for pause in (1, 2, 4, 8, 16):
        if p.get("reason") != "timing_noisy":
            break
        await anyio.sleep(pause)
        p = await call(client, "profile", args)
    return p


async def write_solution(client: Client, ws_id: str | None, backend: str) -> None:
    folder = SOLUTIONS / backend
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            args = {"path": path.relative_to(folder).as_posix(), "content": path.read_text()}
            if ws_id is not None:
                args["workspace_id"] = ws_id
            await call(client, "write_file", args)


async def build_and_judge(client: Client, ws_id: str | None, progress: list[str] | None = None,
                          scored: bool = True) -> dict[str, Any]:
    """compile, verify, profile; asserts a correct, timed result. With scored=False a profile still timing_noisy
    after profiled()'s retries passes if it is the whole, structured refusal: the transport tests run a server
    process beside the test's own on a 2-core CI machine, where a minute of neighbours' load once kept all six
    profiles noisy; what they test is that the tools work over the transport, not the machine's quiet."""
    args = {"workspace_id": ws_id} if ws_id else {}

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        if progress is not None:
            progress.append(message or "")

    c = await call(client, "compile", args, progress_callback=on_progress)
    assert c["ok"], c
    v = await call(client, "verify", args)
    assert v["ok"] and len(v["trials"]) == 6 and v["trials"][-1]["variant"] == "signed", v
    p = await profiled(client, args, await call(client, "profile", args))
    assert_timed(p, scored)
    return {"compile": c, "verify": v, "profile": p}


def assert_timed(p: dict[str, Any], scored: bool = True) -> None:
    """A profile that timed both sides and scored a speedup; with scored=False, or the whole structured
    timing_noisy refusal: nothing scored, and it says so (no speedup, the pairing marked noisy, the agent told to
    profile again)."""
    assert p["candidate"]["median_ms"] > 0 and p["eager"]["median_ms"] > 0, p
    if not scored and p["reason"] == "timing_noisy":
        assert not p["ok"] and p["speedup_vs_eager"] is None and p["paired"]["noisy"], p
        assert "profile again" in p["message"], p
        return
    assert p["ok"] and p["speedup_vs_eager"] is not None, p


# ---- in-process ---------------------------------------------------------------------------------

async def test_tools_resources_and_annotations(tmp_path):
    app = make_app(tmp_path)
    async with Client(app.mcp) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == EXPECTED_TOOLS
        ann = {name: t.annotations for name, t in tools.items()}
        assert ann["read_file"].read_only_hint and ann["list_files"].read_only_hint and ann["list_tasks"].read_only_hint
        assert ann["write_file"].destructive_hint and not ann["write_file"].read_only_hint
        assert ann["close_workspace"].destructive_hint
        assert ann["edit_file"].idempotent_hint is False
        assert ann["compile"].read_only_hint is False and ann["compile"].destructive_hint is False
        for name in ("compile", "verify", "profile"):
            assert "ok" in tools[name].output_schema["properties"]
        assert "diagnostics" in tools["compile"].output_schema["properties"]
        assert tools["read_file"].input_schema["properties"]["offset"]["minimum"] == 0

        tasks = await call(client, "list_tasks", {"query": "swish"})
        assert "example/swish_bias" in [t["id"] for t in tasks["tasks"]]
        page = await call(client, "list_tasks", {"limit": 1})
        assert len(page["tasks"]) == 1 and page["next_offset"] == (1 if page["total"] > 1 else None)

        skill = (await client.call_tool("read_skill", {})).content[0].text
        assert skill.startswith("# SKILL")
        resources = (await client.list_resources()).resources
        assert "skill://cuda/SKILL.md" in [str(r.uri) for r in resources]
        assert (await client.read_resource("skill://cuda/SKILL.md")).contents[0].text == skill
        templates = (await client.list_resource_templates()).resource_templates
        assert "workspace://{workspace_id}/model.py" in [t.uri_template for t in templates]
    app.shutdown()


async def test_in_process_episode(tmp_path):
    app = make_app(tmp_path)
    async with Client(app.mcp) as client:
        opened = await call(client, "open_task", {"task": str(SMALL_TASK)})
        ws_id = opened["workspace_id"]
        assert opened["backend"] == "cpu" and "model.py" in opened["files"]
        assert app.helpers._ready == {}, "prewarm defaults to off for the CPU backend"
        assert app._warm_device(app.workspace(ws_id)) is None

        model = await call(client, "read_file", {"workspace_id": ws_id, "path": "model.py", "limit": 3})
        assert model["next_offset"] == 3 and model["content"].startswith("import torch")
        ref = await client.read_resource(f"workspace://{ws_id}/model.py")
        assert ref.contents[0].text == SMALL_TASK.read_text()

        await write_solution(client, ws_id, "cpu")
        edited = await call(client, "edit_file", {"workspace_id": ws_id, "path": "model_new.py",
                                                  "old_text": "import cuda_extension\n",
                                                  "new_text": "import cuda_extension  # built by compile\n"})
        assert edited["replacements"] == 1
        files = await call(client, "list_files", {"workspace_id": ws_id})
        writable = {f["path"]: f["writable"] for f in files["files"]}
        assert writable["kernels/swish_bias.cpp"] and writable["model_new.py"] and not writable["model.py"]

        progress: dict[str, list[str]] = {"compile": [], "verify": [], "profile": []}

        def recorder(op: str):
            async def record(value: float, total: float | None, message: str | None) -> None:
                progress[op].append(message or "")
            return record

        w = {"workspace_id": ws_id}
        assert (await call(client, "compile", w, progress_callback=recorder("compile")))["ok"]
        assert any("compiling" in m for m in progress["compile"]), progress
        # both at once on one workspace: the second waits for the first and says so
        results: dict[str, dict[str, Any]] = {}

        async def judge(op: str) -> None:
            results[op] = await call(client, op, w, progress_callback=recorder(op))

        async with anyio.create_task_group() as tg:
            tg.start_soon(judge, "verify")
            tg.start_soon(judge, "profile")
        assert results["verify"]["ok"] and len(results["verify"]["trials"]) == 6, results["verify"]
        # what this test is about is the tools (queueing, progress, the result's shape), not the machine's quiet:
        # on the 2-core CI machine all six profiles of the 64x256 task (eager a few tens of microseconds) were once
        # timing_noisy over half a minute; the speedup itself is the sandbox tests' to check
        assert_timed(await profiled(client, w, results["profile"]), scored=False)
        assert any(m.startswith("queued") for m in progress["verify"] + progress["profile"]), progress

        log = await call(client, "read_file", {"workspace_id": ws_id, "path": "build/compile.log",
                                               "unit": "chars", "limit": 100})
        assert log["unit"] == "chars" and log["returned"] <= 100

        assert opened["workdir"] == "."  # the client is told no server path (mcp_server/redact.py)
        root = app.workspaces.get(ws_id, None).ws.root
        assert root.is_dir()
        await call(client, "close_workspace", {"workspace_id": ws_id})
        assert not root.exists()
        assert "unknown workspace" in await tool_error(client, "list_files", {"workspace_id": ws_id})
    app.shutdown()
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


async def test_mistakes_come_back_as_tool_errors(tmp_path):
    app = make_app(tmp_path, check_tasks=False, max_file_bytes=4096, max_workspaces=2, max_output_chars=2000)
    async with Client(app.mcp) as client:
        assert "workspace_id is required" in await tool_error(client, "list_files", {})
        ws = (await call(client, "open_task", {"source": SMALL_TASK.read_text(), "name": "small"}))["workspace_id"]
        w = {"workspace_id": ws}

        # confinement and protection
        outside = tmp_path / "outside.txt"
        outside.write_text("secret")
        (Path(app.workspaces.get(ws, None).ws.root) / "kernels" / "link.txt").symlink_to(outside)
        for path, words in [("../escape.py", "'..' is not allowed"), ("/etc/passwd", "absolute paths"),
                            ("kernels/link.txt", "outside the workspace"), ("model.py", "protected"),
                            ("binding.cpp", "protected"), ("SKILL.md", "protected"),
                            ("build/cuda_extension.so", "belongs to the sandbox"),
                            (".cuda_agent/reference.py", "belongs to the sandbox")]:
            err = await tool_error(client, "write_file", {**w, "path": path, "content": "x"})
            assert words in err, err
        assert "outside the workspace" in await tool_error(client, "read_file", {**w, "path": "kernels/link.txt"})
        assert "protected" in await tool_error(client, "edit_file", {**w, "path": "model.py", "old_text": "torch",
                                                                     "new_text": "numpy"})
        assert "no such file" in await tool_error(client, "read_file", {**w, "path": "kernels/nope.cu"})
        assert outside.read_text() == "secret"

        # limits
        err = await tool_error(client, "write_file", {**w, "path": "kernels/big.cpp", "content": "x" * 5000})
        assert "over the server's 4096-byte file limit" in err
        second = await call(client, "open_task", {"task": "example/swish_bias"})
        assert "limit of 2 open workspaces" in await tool_error(client, "open_task", {"task": "example/swish_bias"})
        await call(client, "close_workspace", {"workspace_id": second["workspace_id"]})

        page = await client.call_tool("read_file", {**w, "path": "SKILL.md"})
        assert len(page.content[0].text) <= 2000 and page.structured_content["next_offset"] is not None
        assert "continue with offset=" in page.content[0].text

        # edits that do not match exactly once
        await call(client, "write_file", {**w, "path": "kernels/a.cpp", "content": "int a;\nint a;\nint b;\n"})
        assert "occurs 2 times" in await tool_error(client, "edit_file", {**w, "path": "kernels/a.cpp",
                                                                          "old_text": "int a;", "new_text": ""})
        assert "not found" in await tool_error(client, "edit_file", {**w, "path": "kernels/a.cpp",
                                                                     "old_text": "int c;", "new_text": ""})

        # malformed arguments and unknown things
        for tool, args in [("read_file", w), ("read_file", {**w, "path": "model.py", "offset": -1}),
                           ("read_file", {**w, "path": "model.py", "unit": "bytes"}),
                           ("write_file", {**w, "path": "kernels/a.cpp", "content": 12}),
                           ("verify", {**w, "trials": 0}), ("profile", {**w, "compile_mode": "fastest"}),
                           ("list_tasks", {"limit": 0})]:
            assert "validation error" in await tool_error(client, tool, args), (tool, args)
        assert "Unknown tool" in await tool_error(client, "make_it_fast", {})
        for bad_id in ("ws-000000000000", "../../etc", "x" * 300):
            assert "unknown workspace" in await tool_error(client, "list_files", {"workspace_id": bad_id})
        assert "exactly one of" in await tool_error(client, "open_task", {})
        assert "does not define" in await tool_error(client, "open_task", {"source": "import torch\n"})
        assert "neither a task id" in await tool_error(client, "open_task", {"task": "no/such/task.py"})
        # verify before compile is a result the agent reads, not an error
        v = await call(client, "verify", w)
        assert not v["ok"] and v["reason"] == "not_compiled"
    app.shutdown()


async def test_cancelled_compile_leaves_no_process_behind(tmp_path):
    app = make_app(tmp_path, check_tasks=False)
    async with Client(app.mcp) as client:
        ws = (await call(client, "open_task", {"task": str(SMALL_TASK)}))["workspace_id"]
        await write_solution(client, ws, "cpu")
        ws_root = str(app.workspaces.get(ws, None).ws.root)
        before = set(proctree.descendants(os.getpid()))
        seen = await cancel_while_compiling(client, ws, os.getpid())
        assert len(seen - before) >= 3, "expected the helper, ninja and the compiler to have been running"
        await anyio.sleep(0.2)
        assert [p for p in seen - before if proctree.alive(p)] == []
        assert _processes_mentioning(ws_root) == []
        # the workspace is usable again: the lock was released
        assert not (await call(client, "verify", {"workspace_id": ws}))["ok"]
    app.shutdown()


async def cancel_while_compiling(client: Client, ws: str, ancestor: int) -> set[int]:
    """Start a compile and cancel it once the compiler runs; return the processes seen below `ancestor`. The
    source gets a line of its own first: the judge's object cache would reuse an object compiled before."""
    await call(client, "edit_file", {"workspace_id": ws, "path": "kernels/swish_bias.cpp", "old_text": "#include <cmath>",
                                     "new_text": f"#include <cmath>\n// {uuid.uuid4().hex}"})
    seen: set[int] = set()
    compiling = anyio.Event()

    async def watch() -> None:
        while True:
            for pid in proctree.descendants(ancestor):
                seen.add(pid)
                try:
                    if b"kernels/swish_bias.cpp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        compiling.set()
                except OSError:
                    pass
            await anyio.sleep(0.05)

    async def compile_() -> None:
        await client.call_tool("compile", {"workspace_id": ws})
        raise AssertionError("the compile finished before it could be cancelled")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(compile_)
            await compiling.wait()
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
    return seen


async def test_idle_workspaces_are_closed(tmp_path):
    # seconds, not tenths: on a loaded 2-core machine the sweep right after open_task came 0.2 s late once
    app = make_app(tmp_path, check_tasks=False, idle_timeout_s=2.0)
    async with Client(app.mcp) as client:
        ws = (await call(client, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        assert await app.sweep_idle() == []
        await anyio.sleep(2.2)
        assert await app.sweep_idle() == [ws]
        assert "unknown workspace" in await tool_error(client, "read_file", {"workspace_id": ws, "path": "model.py"})
    app.shutdown()


async def test_default_workspace_needs_no_id(tmp_path):
    app = make_app(tmp_path, check_tasks=False)
    with pytest.raises(Exception, match="not a cuda-agent workspace"):
        app.open_default(workdir=tmp_path)
    app.open_default(task=str(SMALL_TASK))
    async with Client(app.mcp) as client:
        assert "model.py" in [f["path"] for f in (await call(client, "list_files"))["files"]]
        await call(client, "write_file", {"path": "kernels/k.cpp", "content": "// k\n"})
        assert (await call(client, "read_file", {"path": "kernels/k.cpp"}))["content"] == "// k\n"
        assert "stays open" in await tool_error(client, "close_workspace", {"workspace_id": "default"})
    app.shutdown()


async def test_overdue_call_is_stopped_with_a_clear_error(tmp_path):
    app = make_app(tmp_path, open_timeout_s=0.5)
    before = set(proctree.descendants(os.getpid()))
    async with Client(app.mcp) as client:
        err = await tool_error(client, "open_task", {"task": str(SMALL_TASK)})
        assert "did not finish within the server's 0.5 s limit" in err
        # the helper and every worker it had are gone; the server's own template (started before the task
        # check, to fork its worker) stays, as after any open
        own = template.owned()
        await all_gone_but(before | ({own.proc.pid} if own is not None else set()))
        assert list((tmp_path / "root").iterdir()) == []
    app.shutdown()
    await all_gone_but(before)


async def test_a_hanging_kernel_costs_the_servers_trial_timeout(tmp_path):
    # an RL server sets what a kernel that never returns may hold its GPU for; each of the first input set's two
    # calls has that timeout, so the verify ends after one of them
    app = make_app(tmp_path, trial_timeout_s=3)
    multi = REPO / "tests" / "fixtures" / "cpu_multi"
    async with Client(app.mcp) as client:
        ws = (await call(client, "open_task", {"task": str(SMALL_TASK)}))["workspace_id"]
        files = {"kernels/variants.cpp": (multi / "kernels" / "variants.cpp").read_text(),
                 "model_new.py": (multi / "model_new.py").read_text().replace("VARIANT", "spin_forever")}
        for path, text in files.items():
            await call(client, "write_file", {"workspace_id": ws, "path": path, "content": text})
        assert (await call(client, "compile", {"workspace_id": ws}))["ok"]
        v = await call(client, "verify", {"workspace_id": ws, "trials": 1})
        assert not v["ok"] and v["reason"] == "timeout", v
        assert "ModelNew.forward on input set 1" in v["message"] and "within 3 s" in v["message"], v["message"]
    app.shutdown()


def test_the_trial_timeout_reaches_the_server_from_the_command_line(monkeypatch):
    from typer.testing import CliRunner

    from cuda_agent.cli import app
    from mcp_server import serve

    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve, "main", lambda **kw: seen.update(kw) or 0)
    r = CliRunner().invoke(app, ["serve", "--trial-timeout", "7.5"])
    assert r.exit_code == 0, r.output
    assert seen["trial_timeout_s"] == 7.5
    with pytest.raises(ValueError):
        ServerConfig(trial_timeout_s=0)


async def test_device_pool_shares_verifies_and_serialises_profiles():
    pool = DevicePool.for_gpus(["0", "1"])
    queued: list[str] = []
    order: list[str] = []

    async def on_queued(message: str) -> None:
        queued.append(message)

    async def use(label: str, exclusive: bool, hold: anyio.Event) -> None:
        async with pool.use(exclusive=exclusive, label=label, on_queued=on_queued) as dev:
            order.append(f"{label}@{dev.name}")
            await hold.wait()

    holds = {name: anyio.Event() for name in ("p1", "v1", "p2", "v2")}
    async with anyio.create_task_group() as tg:
        tg.start_soon(use, "p1", True, holds["p1"])
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(use, "v1", False, holds["v1"])
        await anyio.wait_all_tasks_blocked()
        assert order == ["p1@gpu0", "v1@gpu1"] and pool.devices[1].env == {"CUDA_VISIBLE_DEVICES": "1"}
        tg.start_soon(use, "p2", True, holds["p2"])
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(use, "v2", False, holds["v2"])
        await anyio.wait_all_tasks_blocked()
        # p2 waits for a device of its own and holds its place: v2 may not jump the queue
        assert order == ["p1@gpu0", "v1@gpu1"] and len(queued) == 2 and "queued" in queued[0]
        holds["v1"].set()
        await anyio.wait_all_tasks_blocked()
        assert order[2] == "p2@gpu1"
        holds["p1"].set()
        await anyio.wait_all_tasks_blocked()
        assert order[3] == "v2@gpu0"
        holds["p2"].set()
        holds["v2"].set()
    assert all(d.exclusive is None and not d.shared for d in pool.devices)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd and proctree.alive(int(name)):
                found.append(int(name))
    return found


# ---- stdio ----------------------------------------------------------------------------------------

def _stdio_params(*args: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "cuda_agent", "serve", *args],
                                 env=dict(os.environ), cwd=str(REPO))


@pytest.mark.full  # a stdio server's whole episode (~60 s); in the default tier: a judged episode over a real transport (test_http_episode), a stdio server under a real client (test_mcp_clients.py's Inspector tests), a cancelled compile leaving no process (test_cancelled_compile_leaves_no_process_behind)
async def test_stdio_episode_and_cancel(tmp_path):
    root = tmp_path / "root"
    async with Client(_stdio_params("--backend", "cpu", "--root", str(root))) as client:
        assert {t.name for t in (await client.list_tools()).tools} == EXPECTED_TOOLS
        ws = (await call(client, "open_task", {"task": "tests/fixtures/cpu_multi/small_task.py"}))["workspace_id"]
        await write_solution(client, ws, "cpu")
        await build_and_judge(client, ws, scored=False)

        # cancel a rebuild from the client: the server must stop ninja and the compiler
        await call(client, "edit_file", {"workspace_id": ws, "path": "kernels/swish_bias.cpp",
                                         "old_text": "#include <cmath>", "new_text": "#include <cmath>\n#include <vector>"})
        server_pid = _child_running("cuda_agent")
        await cancel_while_compiling(client, ws, server_pid)
        for _ in range(50):
            if not _below_but_template(server_pid):
                break
            await anyio.sleep(0.1)
        assert _below_but_template(server_pid) == []
        assert _processes_mentioning(str(root / ws)) == []
    assert not list(root.iterdir()), "workspaces are deleted when the server exits"


def _below_but_template(pid: int) -> list[int]:
    """The processes below `pid` but for the template that the server's workers are forked from (it lives as
    long as the server; a worker it forked would be listed)."""
    def is_template(p: int) -> bool:
        try:
            return b"sandbox.worker\0template\0" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return False

    return [p for p in proctree.descendants(pid) if not is_template(p)]


def _child_running(marker: str) -> int:
    for pid in proctree.descendants(os.getpid()):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            pass
    raise AssertionError(f"no child process running {marker}")


@pytest.mark.gpu
async def test_gpu_stdio_episode(tmp_path):
    async with Client(_stdio_params("--backend", "cuda", "--root", str(tmp_path / "root"))) as client:
        opened = await call(client, "open_task", {"task": "example/swish_bias"})
        assert opened["backend"] == "cuda"
        await write_solution(client, opened["workspace_id"], "cuda")
        results = await build_and_judge(client, opened["workspace_id"])
        assert results["verify"]["device"] and results["profile"]["device"] != "cpu"
        # prewarm is on by default for cuda: the verify's set-up did not include importing torch. Its workers
        # were forked from the server's template, which had imported it (import_torch 0), or, started by exec,
        # a prewarmed helper had imported it before the verify was asked for (longer than the whole set-up)
        phases = results["verify"]["phases"]
        assert phases["import_torch"] == 0.0 or phases["setup"] < phases["import_torch"], phases


# ---- streamable HTTP ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """A real server process on a free loopback port, accepting two tokens (two clients)."""
    root = tmp_path_factory.mktemp("http-root")
    log = root.parent / "http-server.log"
    with http_mcp_server(root, log, [TOKEN_A, TOKEN_B]) as (url, proc):
        yield url
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()
    assert not list(root.iterdir()), "workspaces are deleted when the server exits"


def http_client(url: str, token: str) -> Client:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    return Client(streamable_http_client(url, http_client=http))


async def test_http_episode(http_server):
    async with http_client(http_server, TOKEN_A) as client:
        assert {t.name for t in (await client.list_tools()).tools} == EXPECTED_TOOLS
        # over HTTP the server does not read task files from its disk by default
        assert "does not open task files" in await tool_error(client, "open_task", {"task": str(SMALL_TASK)})
        ws = (await call(client, "open_task", {"source": SMALL_TASK.read_text(), "name": "small"}))["workspace_id"]
        await write_solution(client, ws, "cpu")
        await build_and_judge(client, ws, scored=False)
        await call(client, "close_workspace", {"workspace_id": ws})


async def test_http_wrong_or_missing_token_is_refused(http_server):
    async with httpx2.AsyncClient() as http:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                        {"Authorization": f"Bearer {TOKEN_A}x"}):
            r = await http.post(http_server, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.status_code)
    with pytest.raises(BaseException) as info:
        async with http_client(http_server, "not-the-token-0123456789") as client:
            await client.list_tools()
    assert "error" in repr(info.value).lower()


async def test_http_clients_are_isolated(http_server):
    async def session(token: str, marker: str, opened: dict[str, str], seen: dict[str, list[str]]) -> None:
        async with http_client(http_server, token) as client:
            ws = (await call(client, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
            opened[marker] = ws
            await call(client, "write_file", {"workspace_id": ws, "path": f"kernels/{marker}.cpp",
                                              "content": f"// {marker}\n"})
            await anyio.sleep(0.5)  # both sessions are open at once
            seen[marker] = [f["path"] for f in (await call(client, "list_files", {"workspace_id": ws}))["files"]]

    opened: dict[str, str] = {}
    seen: dict[str, list[str]] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, TOKEN_A, "alpha", opened, seen)
        tg.start_soon(session, TOKEN_B, "beta", opened, seen)
    assert opened["alpha"] != opened["beta"]
    assert "kernels/alpha.cpp" in seen["alpha"] and "kernels/beta.cpp" not in seen["alpha"]
    assert "kernels/beta.cpp" in seen["beta"] and "kernels/alpha.cpp" not in seen["beta"]

    # a workspace answers only to the token that opened it
    async with http_client(http_server, TOKEN_B) as client:
        for tool, args in [("list_files", {}), ("read_file", {"path": "kernels/alpha.cpp"}),
                           ("write_file", {"path": "kernels/x.cpp", "content": ""}), ("compile", {}),
                           ("close_workspace", {})]:
            err = await tool_error(client, tool, {"workspace_id": opened["alpha"], **args})
            assert "unknown workspace" in err
        with pytest.raises(MCPError, match="unknown workspace"):
            await client.read_resource(f"workspace://{opened['alpha']}/model.py")
    async with http_client(http_server, TOKEN_A) as client:
        for marker in ("alpha",):
            await call(client, "close_workspace", {"workspace_id": opened[marker]})
    async with http_client(http_server, TOKEN_B) as client:
        await call(client, "close_workspace", {"workspace_id": opened["beta"]})


def test_http_settings_are_checked():
    def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k != "CUDA_AGENT_MCP_TOKEN"}
        return subprocess.run([sys.executable, "-m", "cuda_agent", "serve", "--transport", "http", *args],
                              capture_output=True, text=True, timeout=60, env={**base, **(env or {})}, cwd=REPO)

    r = serve()
    assert r.returncode == 2 and "needs a bearer token" in r.stderr
    r = serve("--no-auth", "--host", "0.0.0.0")
    assert r.returncode == 2 and "only on a loopback host" in r.stderr
    r = serve("--token", "short")
    assert r.returncode == 2 and "at least 16 characters" in r.stderr
    # the token may come from the environment; a bad task then fails before serving
    r = serve("--task", "no/such/task.py", env={"CUDA_AGENT_MCP_TOKEN": TOKEN_A})
    assert r.returncode == 2 and "task" in r.stderr


async def all_gone_but(before: set[int], within_s: float = 20) -> None:
    """Every process started since `before` was taken exits within `within_s`."""
    def new() -> list[int]:
        return [p for p in set(proctree.descendants(os.getpid())) - before if proctree.alive(p)]

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and new():
        await anyio.sleep(0.2)
    assert new() == []


def waited_for_no_import(phases: dict[str, float]) -> bool:
    """The call's workers were ready before it came: forked from the server's template (which imported torch
    before), or started ahead by a warm helper."""
    own = template.owned()
    if own is not None:
        return phases["import_torch"] == 0 and phases["worker_wait"] < own.channel.info()["import_torch_s"]
    return phases["setup"] < phases["import_torch"]


def judge_helpers(app) -> set[int]:
    return {p.pid for (warm, _), ps in app.helpers._ready.items() if not warm.startswith(BUILD_PREFIX) for p in ps}


def build_helpers(app) -> set[int]:
    return {p.pid for (warm, _), ps in app.helpers._ready.items() if warm.startswith(BUILD_PREFIX) for p in ps}


# the default tier: fork (the default start); exec (~36 s, the start where forking is off) runs in the full suite,
# and exec starts stay in the default tier in test_template.py
@pytest.mark.parametrize("start", ["fork", pytest.param("exec", marks=pytest.mark.full)])
async def test_prewarmed_helpers_serve_one_call_each(tmp_path, monkeypatch, start):
    monkeypatch.setenv(template.FORK_ENV, "on" if start == "fork" else "off")
    app = make_app(tmp_path, prewarm=True)
    before = set(proctree.descendants(os.getpid()))
    async with Client(app.mcp) as client:
        ws_id = (await call(client, "open_task", {"task": str(SMALL_TASK)}))["workspace_id"]
        # opening the workspace starts the first helpers (a judgment's, a compile's), so even the first verify
        # and the first compile find one waiting
        opened = judge_helpers(app)
        assert len(opened) == 1 and all(proctree.alive(p) for p in opened)
        builder = build_helpers(app)
        assert len(builder) == 1 and all(proctree.alive(p) for p in builder)
        await write_solution(client, ws_id, "cpu")
        assert (await call(client, "compile", {"workspace_id": ws_id}))["ok"]
        assert judge_helpers(app) == opened, "compile keeps the judgment's waiting helper"
        assert not any(proctree.alive(p) for p in builder), "the compile ran in the waiting compile helper"
        after = build_helpers(app)
        assert len(after) == 1 and not after & builder and all(proctree.alive(p) for p in after), "and one waits again"
        await anyio.sleep(8)  # an agent's turn: the waiting helper's workers finish importing torch
        first = await call(client, "verify", {"workspace_id": ws_id, "trials": 1})
        assert first["ok"]
        # its workers imported torch before the call came, so the call's set-up did not wait for that
        assert waited_for_no_import(first["phases"]), first["phases"]
        assert (template.owned() is not None) == (start == "fork")
        assert not any(proctree.alive(p) for p in opened), "a helper serves one call"
        ready = judge_helpers(app)
        assert len(ready) == 1 and not ready & opened and all(proctree.alive(p) for p in ready)
        await anyio.sleep(8)
        second = await call(client, "verify", {"workspace_id": ws_id, "trials": 1})
        assert second["ok"] and waited_for_no_import(second["phases"]), second["phases"]
        assert not any(proctree.alive(p) for p in ready)
        assert all(p.returncode is None for ps in app.helpers._ready.values() for p in ps)
    app.shutdown()
    await all_gone_but(before)


async def test_a_burst_of_judgments_finds_as_many_helpers_warm_as_the_server_keeps(tmp_path, monkeypatch):
    """warm_helpers=3: three workspaces verified at once each take a helper whose workers were ready before the
    call (with one kept, two of them would start theirs cold, under the burst), and three wait again after."""
    monkeypatch.setenv(template.FORK_ENV, "on")
    app = make_app(tmp_path, prewarm=True, warm_helpers=3)
    before = set(proctree.descendants(os.getpid()))
    async with Client(app.mcp) as client:
        ids = [(await call(client, "open_task", {"task": str(SMALL_TASK)}))["workspace_id"] for _ in range(3)]
        opened = judge_helpers(app)
        assert len(opened) == 3 and len(build_helpers(app)) == 3, "more workspaces start no more than the depth"
        for ws_id in ids:
            await write_solution(client, ws_id, "cpu")
            assert (await call(client, "compile", {"workspace_id": ws_id}))["ok"]
        assert judge_helpers(app) == opened
        await anyio.sleep(8)  # an agent's turn: the waiting helpers' workers are ready
        results: dict[str, dict] = {}

        async def verify(ws_id: str) -> None:
            results[ws_id] = await call(client, "verify", {"workspace_id": ws_id, "trials": 1})

        async with anyio.create_task_group() as tg:
            for ws_id in ids:
                tg.start_soon(verify, ws_id)
        for ws_id, r in results.items():
            assert r["ok"] and waited_for_no_import(r["phases"]), (ws_id, r["phases"])
        assert not any(proctree.alive(p) for p in opened), "each of the burst's verifies took a waiting helper"
        ready = judge_helpers(app)
        assert len(ready) == 3 and not ready & opened and all(proctree.alive(p) for p in ready)
    app.shutdown()
    await all_gone_but(before)


def test_warm_helpers_default_from_the_environment(monkeypatch):
    monkeypatch.setenv(WARM_HELPERS_ENV, "4")
    assert ServerConfig().warm_helpers == 4
    monkeypatch.setenv(WARM_HELPERS_ENV, "many")
    assert ServerConfig().warm_helpers == 1
    monkeypatch.delenv(WARM_HELPERS_ENV)
    assert ServerConfig().warm_helpers == 1 and ServerConfig(warm_helpers=8).warm_helpers == 8


@pytest.mark.parametrize("prewarm", [True, None])
async def test_a_server_that_keeps_helpers_warm_starts_its_template_with_itself(tmp_path, monkeypatch, prewarm):
    """Not at the first open_task: the first burst of task checks would wait for its torch import. A CPU
    server (no prewarm by default) starts none until a workspace opens, as before."""
    monkeypatch.setenv(template.FORK_ENV, "on")
    template.disable()
    app = make_app(tmp_path, prewarm=prewarm)
    before = set(proctree.descendants(os.getpid()))
    info = app.start_template_early()
    own = template.owned()
    assert (own is not None) == bool(prewarm)
    if own is not None:
        # it returned once the template had imported torch, and the channel the server forks through is intact
        assert info is not None and info["import_s"] > 0 and info["problems"] == [], info
        assert own.alive() and own.proc.pid in proctree.descendants(os.getpid())
        assert own.channel.info()["forks"] == 0
    else:
        assert info is None
    app.shutdown()
    assert template.owned() is None
    await all_gone_but(before)


async def test_prewarm_defaults_on_for_cuda_workspaces(tmp_path):
    app = CudaAgentServer(ServerConfig(root=tmp_path / "root", backend="cuda", check_tasks=False))
    before = set(proctree.descendants(os.getpid()))
    async with Client(app.mcp) as client:
        opened = await call(client, "open_task", {"task": "example/swish_bias"})
        assert opened["backend"] == "cuda"
        assert app._warm_device(app.workspace(opened["workspace_id"])) == "cuda"
        # one waiting helper per GPU of the pool, each pinned to its GPU
        envs = sorted(str(env) for (warm, env) in app.helpers._ready if not warm.startswith(BUILD_PREFIX))
        assert envs == sorted(str(tuple(sorted(d.env.items()))) for d in app.scheduler.gpu_pool.devices)
    app.shutdown()
    await all_gone_but(before)
