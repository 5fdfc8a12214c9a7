"""The harness's pure parts: task specs, tool schemas and arguments, API message conversions, solution
discovery and load_inline conversion, and the command line's settings."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import anyio
import pytest
from mcp_types import Tool
from typer.testing import CliRunner

from harness.anthropic_client import from_anthropic, to_anthropic
from harness.cli import app, build_rollout_config
from harness.config import ModelConfig, RolloutConfig, SamplingConfig
from harness.inline_convert import ConversionError, convert_load_inline
from harness.mcp_tools import EpisodeTools, ToolServer
from harness.openai_client import OpenAIChatPolicy, parse_response
from harness.policy import EpisodeContext, api_history
from harness.solutions import PLACEHOLDER, find_solution
from harness.specs import level_of, select_tasks
from harness.tool_schemas import ArgumentError, make_spec, parse_arguments, sanitize_name, validate_arguments
from tasks import Task, TaskError

REPO = Path(__file__).resolve().parent.parent

READ_FILE_SCHEMA = {
    "type": "object", "title": "read_fileArguments",
    "properties": {"path": {"type": "string", "minLength": 1}, "workspace_id": {"anyOf": [{"type": "string"},
                                                                                       {"type": "null"}]},
                   "offset": {"type": "integer", "minimum": 0, "default": 0},
                   "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["path", "workspace_id"], "$defs": {"Unit": {"enum": ["lines", "chars"], "type": "string"}}}


# ---- task specs ---------------------------------------------------------------------------------

def test_specs_files_folders_and_ids(tmp_path, small_task_path):
    folder = tmp_path / "suite"
    folder.mkdir()
    for name in ("2_b", "10_c", "1_a"):
        (folder / f"{name}.py").write_text(small_task_path.read_text())
    assert [t.id for t in select_tasks(str(folder))] == ["suite/1_a", "suite/2_b", "suite/10_c"]
    tasks = select_tasks([str(small_task_path), "example/swish_bias," + str(small_task_path)])
    assert [t.id for t in tasks] == ["small_task", "example/swish_bias"]  # each once, in order
    with pytest.raises(TaskError):
        select_tasks("no/such/task.py")
    assert level_of("kernelbench/level2/1_Conv") == "level2" and level_of("suite/1_a") == "suite"
    assert level_of("small_task") == "other"


def test_specs_kernelbench_ranges(small_kernelbench):
    tasks = select_tasks("kernelbench:level1:1-3,19")
    assert [t.id.split("/")[-1].split("_")[0] for t in tasks] == ["1", "2", "3", "19"]
    assert select_tasks("kernelbench/level1/19")[0].id == "kernelbench/level1/19_ReLU"
    with pytest.raises(TaskError, match="no problem numbered 999"):
        select_tasks("kernelbench:level1:999")
    with pytest.raises(TaskError, match="not a problem number"):
        select_tasks("kernelbench:level1:x")


# ---- tool schemas and arguments -----------------------------------------------------------------

def test_names_are_sanitized_without_collisions():
    taken: set[str] = set()
    assert sanitize_name("read_file", taken) == "read_file"
    assert sanitize_name("fs.read file", taken) == "fs_read_file"
    assert sanitize_name("fs.read.file", taken) == "fs_read_file_2"
    long = sanitize_name("x" * 100, taken)
    assert len(long) == 64 and len(sanitize_name("x" * 100, taken)) == 64


def test_model_schema_hides_bound_args_and_inlines_refs():
    spec = make_spec("read_file", "read_file", "s0", " Read a file. ", READ_FILE_SCHEMA, {"workspace_id": "ws-1"})
    assert spec.parameters["required"] == ["path"]
    assert "workspace_id" not in spec.parameters["properties"] and "$defs" not in json.dumps(spec.parameters)
    assert spec.parameters["properties"]["unit"]["enum"] == ["lines", "chars"]
    assert spec.openai()["function"]["description"] == "Read a file."
    assert spec.anthropic()["input_schema"] == spec.parameters
    full = validate_arguments(spec, {"path": "model.py", "workspace_id": "someone-elses"})
    assert full == {"path": "model.py", "workspace_id": "ws-1"}  # the model cannot pick the workspace
    with pytest.raises(ArgumentError, match="'path' is a required property"):
        validate_arguments(spec, {})
    with pytest.raises(ArgumentError, match="offset"):
        validate_arguments(spec, {"path": "a", "offset": -1})
    with pytest.raises(ArgumentError, match="not valid JSON"):
        parse_arguments('{"path": ')
    with pytest.raises(ArgumentError, match="JSON object"):
        parse_arguments("[1, 2]")
    assert parse_arguments("") == {} and parse_arguments({"a": 1}) == {"a": 1}


def test_episode_tools_refuse_before_reaching_the_server():
    tools = [Tool(name=n, description=n, input_schema=READ_FILE_SCHEMA) for n in ("read_file", "open_task")]
    server = ToolServer("s0", client=None, tools=tools, where="nowhere")  # never called below
    et = EpisodeTools([server], {"workspace_id": "ws-1"}, hidden={"open_task"}, timeout_s=5, max_chars=1000)
    assert [s.name for s in et.specs] == ["read_file"]

    async def calls():
        return [await et.call("open_task", "{}"), await et.call("read_file", "{oops"),
                await et.call("read_file", "{}")]

    hidden, malformed, invalid = anyio.run(calls)
    assert hidden.error_kind == "unknown_tool" and "read_file" in hidden.text
    assert malformed.error_kind == "malformed_arguments"
    assert invalid.error_kind == "invalid_arguments" and invalid.text.startswith("error:")


# ---- the OpenAI-compatible client ---------------------------------------------------------------

def test_parse_response_reads_vllm_extras():
    ctx = EpisodeContext(task=Task(id="t", source=""), sample=0, backend="cpu", workspace_id="ws")
    data = {"id": "r1", "prompt_token_ids": [1, 2, 3],
            "choices": [{"finish_reason": "tool_calls", "token_ids": [7, 8],
                         "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]},
                         "message": {"content": None, "reasoning": "hmm",
                                     "tool_calls": [{"function": {"name": "compile", "arguments": {"x": 1}}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 1}}}
    turn = parse_response(data, 0.25, ctx)
    assert turn.message["reasoning_content"] == "hmm"
    call = turn.message["tool_calls"][0]
    assert call["id"] == "call_0_0" and call["function"]["arguments"] == '{"x": 1}'
    assert turn.prompt_token_ids == [1, 2, 3] and turn.completion_token_ids == [7, 8]
    assert turn.completion_logprobs == [-0.5, -1.0] and turn.usage.reasoning_tokens == 1


def test_requests_and_history_for_openai_compatible_servers():
    pytest.importorskip("openai", reason="the harness extra is not installed")
    model = ModelConfig(model="m", base_url=["http://127.0.0.1:9/v1"], api_key="k", return_token_ids=True)
    policy = OpenAIChatPolicy(model, SamplingConfig(temperature=0.6, top_k=20, max_tokens=100, logprobs=True,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "reasoning_content": "think",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
               {"role": "tool", "tool_call_id": "c", "content": "error", "is_error": True}]
    body, extra = policy.request(history, [], 50, "http://127.0.0.1:9/v1")
    assert body["max_tokens"] == 50 and body["temperature"] == 0.6 and body["logprobs"] is True
    assert "tools" not in body
    assert extra == {"chat_template_kwargs": {"enable_thinking": True}, "top_k": 20, "return_token_ids": True}
    sent = body["messages"]
    assert "reasoning_content" not in sent[1] and sent[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert "is_error" not in sent[2]
    assert history[1]["tool_calls"][0]["function"]["arguments"] == "{bad"  # the record keeps the original
    body, _ = policy.request(history, [], 50, None)
    assert "max_completion_tokens" in body  # api.openai.com wants the newer name
    assert api_history(history, keep_reasoning=True)[1]["reasoning_content"] == "think"
    anyio.run(policy.aclose)


# ---- Anthropic conversions ----------------------------------------------------------------------

def test_anthropic_round_trip():
    thinking = [{"type": "thinking", "thinking": "plan", "signature": "sig"}]
    messages = [{"role": "system", "content": "manual"}, {"role": "user", "content": "task"},
                {"role": "assistant", "content": "calling", "thinking_blocks": thinking,
                 "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
                                {"id": "t2", "type": "function", "function": {"name": "b", "arguments": "{bad"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "ok"},
                {"role": "tool", "tool_call_id": "t2", "content": "error: bad", "is_error": True},
                {"role": "user", "content": "[harness] note"}]
    system, out = to_anthropic(messages)
    assert system == "manual" and [m["role"] for m in out] == ["user", "assistant", "user"]
    blocks = out[1]["content"]
    assert blocks[0] == thinking[0] and blocks[1] == {"type": "text", "text": "calling"}
    assert blocks[2]["input"] == {"x": 1} and blocks[3]["input"] == {}
    results = out[2]["content"]
    assert [b["type"] for b in results] == ["tool_result", "tool_result", "text"]
    assert results[1]["is_error"] is True and results[0]["tool_use_id"] == "t1"

    message, finish, usage = from_anthropic({
        "content": [{"type": "thinking", "thinking": "more", "signature": "s2"}, {"type": "text", "text": "ok "},
                    {"type": "tool_use", "id": "u1", "name": "compile", "input": {}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 90}})
    assert finish == "tool_calls" and usage.prompt_tokens == 100 and usage.completion_tokens == 5
    assert message["tool_calls"][0]["function"] == {"name": "compile", "arguments": "{}"}
    assert message["reasoning_content"] == "more" and message["thinking_blocks"][0]["signature"] == "s2"
    assert from_anthropic({"content": [], "stop_reason": "max_tokens"})[1] == "length"


def test_anthropic_request_shape():
    pytest.importorskip("anthropic")
    from harness.anthropic_client import AnthropicPolicy

    policy = AnthropicPolicy(ModelConfig(provider="anthropic", model="claude", api_key="k",
                                         anthropic_thinking_budget=2048), SamplingConfig(top_k=5, stop=["END"]))
    spec = make_spec("read_file", "read_file", "s0", "Read.", READ_FILE_SCHEMA, {"workspace_id": "w"})
    body = policy.request([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], [spec], None)
    assert body["system"] == "s" and body["max_tokens"] == 8192 and body["top_k"] == 5
    assert body["stop_sequences"] == ["END"] and body["thinking"]["budget_tokens"] == 2048
    assert body["tools"][0]["name"] == "read_file" and "workspace_id" not in json.dumps(body["tools"])
    anyio.run(policy.aclose)


# ---- solutions ----------------------------------------------------------------------------------

INLINE = '''"""A docstring."""
from __future__ import annotations
import torch
import torch.nn as nn
import torch.utils.cpp_extension
from torch.utils import cpp_extension as ce

HEADER = "#include <cstdint>\\n"
cuda_src = HEADER + """
__global__ void k(float* y) { y[0] = 1.f; }
torch::Tensor one(torch::Tensor x) { return x; }
"""
cpp_src = ["torch::Tensor one(torch::Tensor x);"]

first = torch.utils.cpp_extension.load_inline("first", cpp_src, cuda_sources=cuda_src, functions={"one": "doc"})
second = ce.load_inline(name="second", cpp_sources="""
torch::Tensor two(torch::Tensor x) { return x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("two", &two); }
""")


class ModelNew(nn.Module):
    def forward(self, x):
        return second.two(first.one(x))
'''


def test_load_inline_files_become_workspaces():
    conv = convert_load_inline(INLINE)
    files = conv.files
    assert set(files) == {"model_new.py", "kernels/first.cu", "kernels/first_binding.cpp", "kernels/second_binding.cpp"}
    assert "__global__ void k" in files["kernels/first.cu"] and files["kernels/first.cu"].count("#include <cstdint>")
    b1, b2 = files["kernels/first_binding.cpp"], files["kernels/second_binding.cpp"]
    assert 'm.def("one", &one, "one");' in b1 and "REGISTER_BINDING(first, cuda_agent_register_first);" in b1
    assert "static void cuda_agent_register_second(pybind11::module& mod)" in b2 and "PYBIND11_MODULE" not in b2
    model = files["model_new.py"]
    tree = ast.parse(model)
    assert isinstance(tree.body[0], ast.Expr) and "from __future__" in model.splitlines()[1]
    assert model.splitlines()[2].startswith("import cuda_extension")
    assert "load_inline" not in model and "cpp_extension" not in model
    assert "first = cuda_extension" in model and "second = cuda_extension" in model
    assert "import torch\n" in model  # `import torch.utils.cpp_extension` bound torch; it still is

    from sandbox.scan.static_scan import scan_model_new

    assert scan_model_new(model) == []

    with pytest.raises(ConversionError, match="no load_inline"):
        convert_load_inline("import torch\n")
    with pytest.raises(ConversionError, match="not a string constant"):
        convert_load_inline("from torch.utils.cpp_extension import load_inline\n"
                            "src = open('k.cu').read()\next = load_inline('x', src, functions=['f'])\n")


def test_find_solution_layouts(tmp_path):
    task = Task(id="kernelbench/level1/19_ReLU", source="")
    root = tmp_path / "a"
    (root / "level1" / "19_ReLU" / "cuda" / "kernels").mkdir(parents=True)
    (root / "level1" / "19_ReLU" / "cuda" / "model_new.py").write_text("x = 1\n")
    (root / "level1" / "19_ReLU" / "cuda" / "kernels" / "k.cu").write_text("//\n")
    (root / "level1" / "19_ReLU" / "cuda" / "kernels" / "notes.txt").write_text("not a source\n")
    sol = find_solution(root, task, "cuda")
    assert sol.form == "workspace" and set(sol.files) == {"model_new.py", "kernels/k.cu"}
    assert find_solution(root, Task(id="kernelbench/level2/19_Other", source=""), "cuda") is None

    root = tmp_path / "b"
    (root / "run").mkdir(parents=True)
    (root / "run" / "level_1_problem_19_sample_1_kernel.py").write_text("import torch\n")
    (root / "run" / "level_1_problem_19_sample_0_kernel.py").write_text(INLINE)
    (root / "run" / "level_2_problem_19_sample_0_kernel.py").write_text("import torch\n")
    sol = find_solution(root, task, "cuda")
    assert sol.form == "load_inline" and sol.origin.endswith("sample_0_kernel.py")

    root = tmp_path / "c"
    root.mkdir()
    (root / "19.py").write_text("class ModelNew: pass\n")  # no load_inline: goes in as it is
    sol = find_solution(root, task, "cuda")
    assert sol.form == "single_file" and PLACEHOLDER in sol.files and "not converted" in sol.notes[0]


# ---- command line -------------------------------------------------------------------------------

def test_cli_builds_configs_from_flags_and_files(tmp_path):
    base = tmp_path / "cfg.json"
    base.write_text(json.dumps({"model": {"model": "from-file", "base_url": ["http://a/v1"]}, "samples": 3,
                                "agent": {"max_turns": 7}, "out": str(tmp_path / "o")}))
    data = build_rollout_config(base, model="from-flag", temperature=0.2, max_turns=None, gpus="0, 1",
                                token_ids=True, extra_body='{"x": 1}', resume=True)
    cfg = RolloutConfig.model_validate(data)
    assert cfg.model.model == "from-flag" and cfg.model.base_url == ["http://a/v1"] and cfg.model.return_token_ids
    assert cfg.samples == 3 and cfg.agent.max_turns == 7 and cfg.sampling.temperature == 0.2
    assert cfg.tools.gpus == ["0", "1"] and cfg.sampling.logprobs and cfg.sampling.extra_body == {"x": 1}
    assert cfg.resume and cfg.agent.context_budget_tokens == 128_000
    replay = RolloutConfig.model_validate(build_rollout_config(None, replay=tmp_path, out=tmp_path / "o"))
    assert replay.replay == tmp_path and replay.model is None


def test_cli_refuses_bad_usage(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["rollout", "--tasks", "x.py", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "give a model" in r.output
    r = runner.invoke(app, ["rollout", "--model", "m", "--base-url", "http://h/v1", "--tasks", "x.py"])
    assert r.exit_code == 2 and "--out is required" in r.output
    r = runner.invoke(app, ["rollout", "--model", "m", "--base-url", "http://h/v1", "--out", str(tmp_path),
                            "--tasks", "no/such/task.py"])
    assert r.exit_code == 2 and "task file not found" in r.output
    r = runner.invoke(app, ["rollout", "--model", "m", "--out", str(tmp_path), "--samples", "0"])
    assert r.exit_code == 2 and "samples" in r.output
    r = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "x.jsonl"), "--format", "rl"])
    assert r.exit_code == 2 and "no rl rows" in r.output


# ---- the episode loop's endings, with a stub policy and stub tools -------------------------------

class StubTools:
    """Stands in for EpisodeTools: every call succeeds with a fixed text."""

    specs: list = []

    async def call(self, name, raw):
        from harness.mcp_tools import ToolCallOutcome

        return ToolCallOutcome(text="x" * 300, is_error=False, mcp_name=name)


class StubPolicy:
    def __init__(self, replies):
        self.replies = list(replies)
        self.max_tokens_seen: list[int | None] = []

    async def complete(self, ctx, messages, tools, max_tokens):
        from harness.policy import ModelError, ModelTurn
        from harness.trajectory import Usage

        self.max_tokens_seen.append(max_tokens)
        reply = self.replies.pop(0) if self.replies else {"content": "done"}
        if isinstance(reply, Exception):
            raise reply
        if reply == "context":
            raise ModelError("400: This model's maximum context length is 8192 tokens", context_exceeded=True)
        calls = [{"id": "c", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}] \
            if reply.get("call") else []
        message = {"role": "assistant", "content": reply.get("content")}
        if calls:
            message["tool_calls"] = calls
        return ModelTurn(message=message, finish_reason=reply.get("finish", "tool_calls" if calls else "stop"),
                         usage=Usage(prompt_tokens=reply.get("prompt", 0), completion_tokens=reply.get("completion", 0)))


def run_loop(replies, **agent):
    from harness.config import AgentConfig
    from harness.episode import LoopState, agent_loop

    policy = StubPolicy(replies)
    state = LoopState(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    ctx = EpisodeContext(task=Task(id="t", source=""), sample=0, backend="cpu", workspace_id="w")
    anyio.run(agent_loop, policy, ctx, StubTools(), AgentConfig(**agent), 4096, state, 0.0)
    return state, policy


def test_loop_endings():
    state, _ = run_loop([{"call": True}, {"call": True}, {"content": "finished"}])
    assert state.ended == "model_stopped" and len(state.turns) == 3

    state, _ = run_loop([{"call": True}] * 5, max_turns=3)
    assert state.ended == "max_turns" and len(state.turns) == 3

    # cut off three times in a row without a tool call: notes in between, then the episode ends
    state, _ = run_loop([{"content": "par", "finish": "length"}] * 3, max_consecutive_truncations=3)
    assert state.ended == "truncated" and sum("cut off" in m["content"] for m in state.messages
                                              if m["role"] == "user") == 2

    # usage reported by the server drives the budget: 1500 + 300 characters of tool output leave no room
    state, policy = run_loop([{"call": True, "prompt": 1500, "completion": 100}, {"call": True}],
                             context_budget_tokens=1800)
    assert state.ended == "context_budget" and len(state.turns) == 1
    assert policy.max_tokens_seen[0] <= 1800

    state, _ = run_loop(["context"])
    assert state.ended == "context_budget" and "maximum context length" in state.detail

    from harness.policy import ModelError

    state, _ = run_loop([ModelError("502: bad gateway")])
    assert state.ended == "model_error" and state.turns == []


def test_server_pool_bounds_episodes_per_server():
    from harness.servers import ServerPool

    servers = [ToolServer(f"gpu{i}", client=None, tools=[], where="stdio", gpu=str(i)) for i in range(2)]
    pool = ServerPool(servers, capacity=2)
    peak: dict[str, int] = {}
    order: list[str] = []

    async def episode(i: int) -> None:
        async with pool.lease() as s:
            order.append(s.alias)
            peak[s.alias] = max(peak.get(s.alias, 0), pool.load[s.alias])
            await anyio.sleep(0.05)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(episode, i)

    anyio.run(main)
    assert max(peak.values()) == 2 and order.count("gpu0") == order.count("gpu1") == 4
    assert pool.load == {"gpu0": 0, "gpu1": 0}


def test_a_turn_stopped_midway_keeps_the_conversation_well_formed():
    from harness.config import AgentConfig
    from harness.episode import LoopState, agent_loop, close_open_calls

    class SlowTools(StubTools):
        async def call(self, name, raw):
            await anyio.sleep(30)

    class TwoCalls(StubPolicy):
        async def complete(self, ctx, messages, tools, max_tokens):
            turn = await super().complete(ctx, messages, tools, max_tokens)
            turn.message["tool_calls"] = [dict(c, id=f"c{i}") for i, c in enumerate(turn.message["tool_calls"] * 2)]
            return turn

    state = LoopState(messages=[{"role": "user", "content": "u"}])
    ctx = EpisodeContext(task=Task(id="t", source=""), sample=0, backend="cpu", workspace_id="w")

    async def main():
        with anyio.move_on_after(0.2):
            await agent_loop(TwoCalls([{"call": True}]), ctx, SlowTools(), AgentConfig(), None, state, 0.0)

    anyio.run(main)
    close_open_calls(state, "out of time")
    assert [m["role"] for m in state.messages] == ["user", "assistant", "tool", "tool"]
    assert [c.error_kind for c in state.turns[0].tool_calls] == ["cancelled", "cancelled"]
    assert [m["tool_call_id"] for m in state.messages[2:]] == ["c0", "c1"]
