"""The shipped synthesized set is reachable wherever task ids are taken: the MCP server's list_tasks and
open_task (through the SDK's real client), with no task files of the server's disk allowed."""

from __future__ import annotations

import pytest
from mcp import Client

from mcp_server.app import CudaAgentServer
from mcp_server.config import ServerConfig
from tasks import list_tasks, load_task

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_mcp_lists_and_opens_synth_eval_ids(tmp_path):
    evals = [t.id for t in list_tasks("synth:eval")]
    app = CudaAgentServer(ServerConfig(root=tmp_path / "root", backend="cpu", allow_task_files=False))
    async with Client(app.mcp) as client:
        r = await client.call_tool("list_tasks", {"query": "synth:eval/", "limit": 500})
        assert not r.is_error, r.content[0].text
        assert [t["id"] for t in r.structured_content["tasks"]] == evals and evals
        opened = await client.call_tool("open_task", {"task": evals[0]})
        assert not opened.is_error, opened.content[0].text
        assert opened.structured_content["task"]["id"] == evals[0]
        ws = opened.structured_content["workspace_id"]
        model = await client.call_tool("read_file", {"workspace_id": ws, "path": "model.py"})
        assert model.content[0].text.rstrip("\n").endswith(load_task(evals[0]).source.rstrip("\n").splitlines()[-1])
        # only the shipped set's splits: a folder of the server's disk is not a task id
        for bad in (f"synth:{tmp_path}/eval/x", "synth:../eval/x"):
            r = await client.call_tool("open_task", {"task": bad})
            assert r.is_error and "does not open task files" in r.content[0].text
    app.shutdown()


def test_a_split_name_is_the_shipped_split_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    first = list_tasks("synth:eval")[0]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / f"{first.name}.py").write_text("not the task")
    monkeypatch.chdir(tmp_path)
    assert load_task(first.id).source == first.source
