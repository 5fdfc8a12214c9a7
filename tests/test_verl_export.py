"""`cuda-agent export --format verl` against a real `cuda-agent serve --transport http` on loopback:
the parquet has verl's RL dataset columns, every tool schema passes verl's schema models (copied
below from verl/tools/schemas.py at b178a3c), workspaces are per request, and the reward function
judges. No verl needed; tests/test_verl_real.py runs the installed verl's own code on the same export."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed")
pa = pytest.importorskip("pyarrow")
yaml = pytest.importorskip("yaml")

from pydantic import BaseModel, Field  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from conftest import http_mcp_server  # noqa: E402
from harness.cli import app  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASK = REPO / "tests" / "fixtures" / "cpu_multi" / "small_task.py"
TOKEN = "verl-token-" + "v" * 24


# verl/tools/schemas.py (volcengine/verl b178a3c): what verl validates each tool schema against
class OpenAIFunctionPropertySchema(BaseModel):
    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: str
    function: OpenAIFunctionSchema


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-mcp")
    with http_mcp_server(root / "ws", root / "mcp.log", [TOKEN]) as (url, _proc):
        yield url


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_MCP_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def exported(server, tmp_path_factory):
    import os

    out = tmp_path_factory.mktemp("verl") / "setup"
    os.environ["CUDA_AGENT_MCP_TOKEN"] = TOKEN
    try:
        r = CliRunner().invoke(app, ["export", "--format", "verl", "--tasks", str(TASK), "--mcp-url", server,
                                     "--backend", "cpu", "--out", str(out)], catch_exceptions=False)
    finally:
        os.environ.pop("CUDA_AGENT_MCP_TOKEN", None)
    assert r.exit_code == 0, r.output
    return out, json.loads(r.output.strip().splitlines()[-1])


def test_the_parquet_has_verls_rl_dataset_columns(exported):
    import pyarrow.parquet as pq

    out, summary = exported
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == summary["train"] == 1 and (out / "val.parquet").is_file()
    row = rows[0]
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"} <= set(row)
    assert row["agent_name"] == "tool_agent"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "Task:" in row["prompt"][1]["content"] and "class Model" in row["prompt"][1]["content"]
    import hashlib

    assert row["reward_model"] == {"style": "rule", "ground_truth": hashlib.sha256(TASK.read_bytes()).hexdigest()}
    extra = row["extra_info"]
    assert extra["need_tools_kwargs"] and set(extra["tools_kwargs"]) == set(summary["tools"])
    assert extra["tools_kwargs"]["compile"]["create_kwargs"]["task_source"] == TASK.read_text()


def test_the_tool_config_passes_verls_schema_where_the_raw_mcp_listing_does_not(exported, server):
    from pydantic import ValidationError

    from harness.mcp_tools import connect_http_server

    out, summary = exported
    cfg = yaml.safe_load((out / "tool_config.yaml").read_text())
    names = []
    for tool in cfg["tools"]:
        assert tool["class_name"] == "harness.verl_tool.CudaAgentTool" and tool["config"]["type"] == "native"
        assert tool["config"]["mcp_urls"] == [server]
        schema = OpenAIFunctionToolSchema.model_validate(tool["tool_schema"])
        assert "workspace_id" not in schema.function.parameters.properties
        names.append(schema.function.name)
    assert set(names) == {"list_files", "read_file", "write_file", "edit_file", "compile", "verify", "profile",
                          "analyze", "read_skill"}
    assert (REPO / "harness" / "verl_tool.py").is_file()

    async def raw() -> list:
        async with connect_http_server("t", server, TOKEN) as s:
            return [t for t in s.tools if t.name == "read_file"]

    tool = anyio.run(raw)[0]  # verl's own `type: mcp` loader would validate this and fail
    with pytest.raises(ValidationError):
        OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": tool.name, "description": tool.description or "", "parameters": {
                **tool.input_schema, "required": tool.input_schema.get("required", [])}}})


def test_each_request_gets_its_own_workspace(server):
    from harness.verl import WorkspaceSessions

    task = {"task_id": "small", "task_source": TASK.read_text(), "backend": "cpu"}
    sessions = WorkspaceSessions([server], TOKEN)

    async def go() -> tuple[str, str, str]:
        await sessions.call("r1", task, "write_file", {"path": "kernels/a.cpp", "content": "// one\n"})
        mine = await sessions.call("r1", task, "read_file", {"path": "kernels/a.cpp"})
        other = await sessions.call("r2", task, "read_file", {"path": "kernels/a.cpp"})
        bad = await sessions.call("r1", task, "write_file", '{"path": "model.py"')
        return mine, other, bad

    mine, other, bad = anyio.run(go)
    assert "// one" in mine and "// one" not in other and "error" in bad.lower()
    assert sessions.open["r1"][1] != sessions.open["r2"][1]


def test_parallel_calls_of_a_new_request_share_one_workspace(server):
    from harness.verl import WorkspaceSessions

    task = {"task_id": "small", "task_source": TASK.read_text(), "backend": "cpu"}
    sessions = WorkspaceSessions([server], TOKEN)

    async def go() -> str:  # verl runs a turn's calls with asyncio.gather (max_parallel_calls > 1)
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(sessions.call, "par", task, "write_file", {"path": f"kernels/p{i}.cpp", "content": "//\n"})
        return await sessions.call("par", task, "list_files", {})

    listing = anyio.run(go)
    assert all(f"kernels/p{i}.cpp" in listing for i in range(3)), listing


def _reward_module(out: Path):
    spec = importlib.util.spec_from_file_location("cuda_agent_verl_reward", out / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_of_a_response_without_files_is_the_judges_failure(exported):
    import hashlib

    out, _ = exported
    reward = _reward_module(out)
    extra = {"task_id": "small", "task_source": TASK.read_text(), "backend": "cpu"}
    sha = hashlib.sha256(TASK.read_bytes()).hexdigest()
    score = reward.compute_score("cuda_agent", "I think it is done.", sha, extra)
    assert score["score"] == -1.0 and score["milestone"] == "failed" and score["file_calls_applied"] == 0
    with pytest.raises(ValueError, match="ground truth"):
        reward.compute_score("cuda_agent", "x", "0" * 64, extra)


def test_file_calls_skip_tool_results():
    from harness.verl import file_calls

    text = ('assistant\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "1"}}\n</tool_call>'
            'tool\n<tool_response>\n<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": "2"}}'
            '</tool_call></tool_response>\n<tool_call>{"name": "compile", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "edit_file", "arguments": "{\\"path\\": \\"a\\", \\"old\\": \\"1\\", \\"new\\": \\"3\\"}"}'
            '</tool_call><tool_call>{"name": "write_file", "arguments": {"path": "b", "content": "#incl')
    assert file_calls(text) == [("write_file", {"path": "a", "content": "1"}),
                                ("edit_file", {"path": "a", "old": "1", "new": "3"})]
    # verl's reward manager decodes with skip_special_tokens: where the tokenizer marks the tags special
    # they are gone, and the calls are the bare JSON objects
    stripped = ('assistant\n{"name": "write_file", "arguments": {"path": "a", "content": "1"}}\nuser\nwrote a\n'
                '{"name": "compile", "arguments": {}} {"name": "edit_file", "arguments": {"path": "a", "old": "1"')
    assert file_calls(stripped) == [("write_file", {"path": "a", "content": "1"})]


@pytest.mark.full  # builds the CPU extension; the export itself: the tests above
@pytest.mark.slow  # builds the CPU extension (about 40 s)
def test_the_reward_rebuilds_the_workspace_from_the_file_calls_and_judges_it(exported):
    import hashlib

    out, _ = exported
    fixture = REPO / "tests" / "fixtures" / "cpu_multi"
    files = {"kernels/variants.cpp": (fixture / "kernels" / "variants.cpp").read_text(),
             "model_new.py": (fixture / "model_new.py").read_text().replace("VARIANT", "correct")}
    calls = "".join("<tool_call>\n" + json.dumps({"name": "write_file", "arguments": {"path": p, "content": c}})
                    + "\n</tool_call>" for p, c in files.items())
    text = f"Writing the kernel.{calls}\ntool\n<tool_response>\nwrote\n</tool_response>\nDone."
    extra = {"task_id": "small", "task_source": TASK.read_text(), "backend": "cpu"}
    score = _reward_module(out).compute_score("cuda_agent", text, hashlib.sha256(TASK.read_bytes()).hexdigest(), extra)
    assert score["file_calls_applied"] == 2 and score["milestone"] != "failed" and score["score"] > 0, score
