"""A whole episode through the real pieces: the openai client over HTTP to a scripted local server,
a real stdio MCP server, the CPU sandbox, the harness's own judgment, the JSONL record and the
conversions and report built from it. Only the model is scripted: it makes the mistakes real
models make (malformed and invalid arguments, an unknown tool, a response cut off at max_tokens)
before writing a correct solution."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from harness.config import AgentConfig, JudgeConfig, ModelConfig, RolloutConfig, SamplingConfig
from harness.export import rl_rows, sft_rows
from harness.report import build_report
from harness.rollout import run_rollout
from harness.trajectory import EpisodeRecord, iter_records
from sandbox.reward import milestone_reward

pytest.importorskip("openai", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "harness"))
from fake_llm import ScriptedLLM  # noqa: E402

SOLUTION = REPO / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"
KERNEL = (SOLUTION / "kernels" / "swish_bias.cpp").read_text()
MODEL_NEW = (SOLUTION / "model_new.py").read_text()


def args(**kw: Any) -> str:
    return json.dumps(kw)


def script(body: dict[str, Any], turn: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [
        {"reasoning": "First the reference, then a kernel.",
         "tool_calls": [("read_file", args(path="model.py")),
                        ("write_file", '{"path": "kernels/swish_bias.cpp", "content": "#include')]},
        {"content": "Trying a shortcut.",
         "tool_calls": [("make_it_fast", "{}"), ("read_file", args(offset=-1))]},
        {"content": "Here is the plan in full detail: first I will write the fused kernel that", "finish_reason":
         "length"},
        {"content": "Writing the kernel and ModelNew.",
         "tool_calls": [("write_file", args(path="kernels/swish_bias.cpp", content=KERNEL)),
                        ("write_file", args(path="model_new.py", content=MODEL_NEW))]},
        {"tool_calls": [("compile", "{}")]},
        {"tool_calls": [("verify", args(trials=2))]},
        {"content": "Done. My kernel is 100x faster than torch.compile."},
    ]
    return steps[turn] if turn < len(steps) else {"content": "nothing left to do"}


@pytest.fixture(scope="module")
def episode(tmp_path_factory, small_task_path) -> tuple[EpisodeRecord, list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("episode")
    with ScriptedLLM(script) as llm:
        cfg = RolloutConfig(
            tasks=[str(small_task_path)], out=out, concurrency=1, progress=False,
            model=ModelConfig(model="fake-model", base_url=[llm.url], api_key="not-a-real-key", return_token_ids=True,
                              max_retries=0),
            sampling=SamplingConfig(temperature=0.0, max_tokens=4096, logprobs=True),
            agent=AgentConfig(backend="cpu", max_turns=20),
            judge=JudgeConfig(verify_trials=2))
        summary = anyio.run(run_rollout, cfg)
        requests = list(llm.requests)
        assert llm.errors == [], llm.errors
    assert summary.ran == 1 and summary.planned == 1
    records = list(iter_records(out / "episodes.jsonl"))
    assert len(records) == 1
    return records[0], requests, out


def test_episode_runs_to_the_models_stop_and_is_judged(episode):
    rec, requests, out = episode
    assert rec.ended == "model_stopped", rec.end_detail
    assert len(rec.turns) == 7 and len(requests) == 7
    assert rec.backend == "cpu" and rec.workspace_id
    j = rec.judgment
    assert j is not None and j.error is None
    assert j.compile.ok and j.verify.ok, (j.compile, j.verify)
    # a loaded 2-core CI machine may leave eager's rounds too far apart to score: still correct, untimed
    assert j.profile.ok or j.profile.reason == "timing_noisy", j.profile
    # the reward is the environment's own, recomputed from its own results
    assert j.reward == milestone_reward(j.compile, j.verify, j.profile)
    assert j.reward.correct and j.reward.reward >= 1
    assert j.settings["verify_trials"] >= 2 and j.settings["compile_mode"] == "default"
    assert j.settings["device"] and j.settings["torch_version"]
    assert rec.task.id == "small_task" and len(rec.task.sha256) == 64
    assert rec.policy["model"] == "fake-model" and rec.sampling["temperature"] == 0.0
    assert "not-a-real-key" not in json.dumps(rec.model_dump(mode="json"))
    assert "not-a-real-key" not in (out / "runs.jsonl").read_text()


def test_mistakes_come_back_to_the_model_as_tool_results(episode):
    rec, requests, _ = episode
    t0, t1, t2 = rec.turns[:3]
    ok, bad = t0.tool_calls
    assert not ok.is_error and "class Model" in ok.result_text and ok.mcp_name == "read_file"
    assert ok.arguments["workspace_id"] == rec.workspace_id  # bound by the harness
    assert bad.is_error and bad.error_kind == "malformed_arguments" and "not valid JSON" in bad.result_text
    assert bad.arguments_raw.endswith('"#include')  # what the model really wrote is kept
    unknown, invalid = t1.tool_calls
    assert unknown.error_kind == "unknown_tool" and "make_it_fast" in unknown.result_text
    assert "read_file" in unknown.result_text  # the model is told what exists
    assert invalid.error_kind == "invalid_arguments" and "path" in invalid.result_text
    assert t2.finish_reason == "length" and not t2.tool_calls
    # every call got exactly one tool message, right after its assistant message
    for turn in rec.turns:
        following = rec.messages[turn.message_index + 1: turn.message_index + 1 + len(turn.tool_calls)]
        assert [m["tool_call_id"] for m in following] == [c.id for c in turn.tool_calls]
    # the truncated response was answered with a note, sent with the next request
    note = rec.messages[rec.turns[2].message_index + 1]
    assert note["role"] == "user" and "cut off" in note["content"]
    assert any("cut off" in (m.get("content") or "") for m in requests[3]["messages"] if m["role"] == "user")
    compiled, verified = rec.turns[4].tool_calls[0], rec.turns[5].tool_calls[0]
    assert compiled.structured["ok"] and verified.structured["ok"]
    assert rec.messages[-1]["content"].startswith("Done.")


def test_requests_carry_history_the_api_accepts(episode):
    _, requests, _ = episode
    second = requests[1]["messages"]
    assistant = [m for m in second if m["role"] == "assistant"][0]
    # malformed arguments are replaced in the history sent back; reasoning is not sent back
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]][1] == "{}"
    assert "reasoning_content" not in assistant
    tools = {t["function"]["name"]: t["function"] for t in requests[0]["tools"]}
    assert "open_task" not in tools and "close_workspace" not in tools and "list_tasks" not in tools
    assert {"read_file", "write_file", "edit_file", "compile", "verify", "profile"} <= set(tools)
    assert "workspace_id" not in json.dumps(tools)
    assert requests[0]["return_token_ids"] is True and requests[0]["logprobs"] is True
    assert requests[0]["messages"][0]["role"] == "system" and "# SKILL" in requests[0]["messages"][0]["content"]
    assert "class Model" in requests[0]["messages"][1]["content"]
    assert all(r["max_tokens"] <= 4096 for r in requests)


def test_timing_usage_and_token_ids_are_recorded(episode):
    rec, _, _ = episode
    assert rec.duration_s >= rec.agent_s > 0
    for t in rec.turns:
        assert t.usage.prompt_tokens == len(t.prompt_token_ids) > 0
        assert t.usage.completion_tokens == len(t.completion_token_ids) == len(t.completion_logprobs)
        assert t.model_s > 0 and t.started_s >= 0
    assert rec.turns[4].tools_s > 0  # the compile
    assert rec.usage.completion_tokens == sum(t.usage.completion_tokens for t in rec.turns)
    assert rec.turns[0].completion_token_ids[:7] == list(b"<think>")


def test_training_rows(episode):
    rec, _, _ = episode
    rows = sft_rows([rec])
    assert len(rows) == 1 and rows[0]["reward"] == rec.reward
    msgs = rows[0]["messages"]
    assert all("is_error" not in m for m in msgs)
    write = [c for m in msgs for c in m.get("tool_calls") or [] if c["function"]["name"] == "write_file"]
    assert isinstance(write[-1]["function"]["arguments"], dict)  # objects, as chat templates expect
    assert isinstance(write[0]["function"]["arguments"], str)  # the malformed one stays as written
    assert rows[0]["tools"] == rec.tools

    rl = rl_rows([rec])
    # turn 0 had reasoning (not rendered back) and malformed arguments (repaired): the chain breaks there
    assert len(rl) == 2 and [r["turns"] for r in rl] == [1, 6]
    for row in rl:
        assert len(row["response_ids"]) == len(row["response_mask"]) == len(row["response_logprobs"])
        assert row["reward"] == rec.reward
    second = rl[1]
    turns = rec.turns[1:]
    assert second["prompt_ids"] == turns[0].prompt_token_ids
    assert sum(second["response_mask"]) == sum(len(t.completion_token_ids) for t in turns)
    # the masked tokens are exactly what came between one completion and the next prompt
    text = bytes(t for t, m in zip(second["response_ids"], second["response_mask"], strict=True) if m == 0).decode()
    assert "<tool>" in text and "cut off" in text and "<think>" not in text
    assert second["prompt_ids"] + second["response_ids"] == turns[-1].prompt_token_ids + turns[-1].completion_token_ids

    datasets = pytest.importorskip("datasets")
    from harness.export import to_dataset

    ds = to_dataset(rows, "sft")
    assert isinstance(ds, datasets.Dataset) and len(ds) == 1
    assert ds[0]["messages"][0]["role"] == "system"
    assert to_dataset(rl, "rl").num_rows == 2


def test_report_of_the_episode(episode):
    rec, _, _ = episode
    report = build_report([rec])
    assert report.overall.problems == 1 and report.overall.pass_rate == 1.0
    assert report.problems[0].speedup_vs_eager == rec.judgment.reward.speedup_vs_eager
    assert report.judge["torch_version"] and report.judge["backends"] == {"cpu": 1}
