"""The other ways in: tools from a running MCP server over streamable HTTP (with a bearer token),
the Anthropic Messages API as the model, and an episode that runs out of time. The scripted
models only read a file, so nothing is compiled."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import http_mcp_server
from harness.config import (
    AgentConfig,
    JudgeConfig,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    ToolServerConfig,
)
from harness.rollout import run_rollout
from harness.servers import ToolServerStartError
from harness.trajectory import iter_records

pytest.importorskip("openai", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "harness"))
from fake_llm import ScriptedLLM  # noqa: E402

TOKEN = "harness-test-token-" + "t" * 20


def read_then_stop(body: dict[str, Any], turn: int) -> dict[str, Any]:
    if turn == 0:
        return {"reasoning": "look first", "content": "Reading.",
                "tool_calls": [("read_file", json.dumps({"path": "model.py", "limit": 5}))]}
    return {"content": "Stopping here."}


@pytest.fixture(scope="module")
def http_mcp(tmp_path_factory):
    root = tmp_path_factory.mktemp("http-mcp")
    log = root.parent / "http-mcp.log"
    with http_mcp_server(root / "ws", log, [TOKEN]) as (url, proc):
        yield url
        proc.terminate()
        proc.wait(timeout=30)


def config(out: Path, llm: ScriptedLLM, **kw: Any) -> RolloutConfig:
    small = REPO / "tests" / "fixtures" / "cpu_multi" / "small_task.py"
    base: dict[str, Any] = dict(tasks=[str(small)], out=out, progress=False,
                                model=ModelConfig(model="fake-model", base_url=[llm.url], api_key="k", max_retries=0),
                                agent=AgentConfig(backend="cpu", max_turns=4), judge=JudgeConfig(verify_trials=1))
    base.update(kw)
    return RolloutConfig(**base)


def test_tools_from_an_http_server_and_an_episode_that_times_out(tmp_path, http_mcp):
    tools = ToolServerConfig(urls=[http_mcp], token=TOKEN)
    with ScriptedLLM(read_then_stop) as llm:
        summary = anyio.run(run_rollout, config(tmp_path / "ok", llm, tools=tools, samples=2, concurrency=2))
    assert summary.ran == 2 and summary.ended == {"model_stopped": 2}
    recs = list(iter_records(tmp_path / "ok" / "episodes.jsonl"))
    for rec in recs:
        assert rec.tool_server["where"] == http_mcp and rec.tool_server["alias"] == "http0"
        assert "class Model" in rec.turns[0].tool_calls[0].result_text
        assert rec.judgment.compile is not None and rec.judgment.compile.reason == "compile_error"
    assert len({r.workspace_id for r in recs}) == 2

    # the model answers after the episode's time is up: the episode ends, and is still judged
    with ScriptedLLM(read_then_stop, delay_s=3.0) as llm:
        slow = config(tmp_path / "slow", llm, tools=tools, agent=AgentConfig(backend="cpu", episode_timeout_s=1.0))
        summary = anyio.run(run_rollout, slow)
    assert summary.ended == {"timeout": 1}
    rec = next(iter_records(tmp_path / "slow" / "episodes.jsonl"))
    assert rec.ended == "timeout" and rec.turns == [] and rec.agent_s < 3.0
    assert rec.judgment.compile is not None and rec.judgment.reward.milestone == "failed"

    # a wrong token is refused before any episode starts
    bad = ToolServerConfig(urls=[http_mcp], token="wrong-token-" + "w" * 20, startup_timeout_s=20)
    with ScriptedLLM(read_then_stop) as llm, pytest.raises(ToolServerStartError, match="cannot use the MCP server"):
        anyio.run(run_rollout, config(tmp_path / "bad", llm, tools=bad))


def test_anthropic_messages_api(tmp_path):
    pytest.importorskip("anthropic")
    with ScriptedLLM(read_then_stop) as llm:
        model = ModelConfig(provider="anthropic", model="claude-test", base_url=[llm.url.removesuffix("/v1")],
                            api_key="k", max_retries=0)
        cfg = config(tmp_path, llm, model=model, sampling=SamplingConfig(temperature=0.5, max_tokens=2000))
        summary = anyio.run(run_rollout, cfg)
        requests = list(llm.requests)
        assert llm.errors == []
    assert summary.ended == {"model_stopped": 1}
    rec = next(iter_records(tmp_path / "episodes.jsonl"))
    assert rec.policy["provider"] == "anthropic" and len(rec.turns) == 2
    first = rec.messages[2]
    assert first["reasoning_content"] == "look first" and first["thinking_blocks"][0]["signature"] == "sig1"
    assert rec.turns[0].tool_calls[0].mcp_name == "read_file" and not rec.turns[0].tool_calls[0].is_error
    second = requests[1]
    assert second["system"].startswith("You are an expert") and second["max_tokens"] <= 2000
    assistant = second["messages"][1]
    assert assistant["role"] == "assistant" and assistant["content"][0]["type"] == "thinking"
    results = second["messages"][2]["content"]
    assert results[0]["type"] == "tool_result" and "class Model" in results[0]["content"]
    assert rec.usage.prompt_tokens > 0 and rec.turns[0].finish_reason == "tool_calls"


def test_a_tool_server_that_goes_away_loses_no_episode(tmp_path):
    """Two hosts' HTTP servers; the second dies once the run has started (killed from inside the scripted
    model's first answer). Its episodes run again on the first: every episode ends as the policy made it
    end, none with tool_server_error, and the summary names the lost server and counts the retries."""
    from training.ppo.agentic import trainable

    with http_mcp_server(tmp_path / "a", tmp_path / "a.log", [TOKEN]) as (url_a, _), \
            http_mcp_server(tmp_path / "b", tmp_path / "b.log", [TOKEN]) as (url_b, proc_b):
        def kill_b_then_read(body: dict[str, Any], turn: int) -> dict[str, Any]:
            if proc_b.poll() is None:
                proc_b.kill()
                proc_b.wait(timeout=30)
            return read_then_stop(body, turn)

        tools = ToolServerConfig(urls=[url_a, url_b], token=TOKEN)
        with ScriptedLLM(kill_b_then_read) as llm:
            summary = anyio.run(run_rollout, config(tmp_path / "out", llm, tools=tools, samples=4, concurrency=4))
    assert summary.ran == 4 and summary.ended == {"model_stopped": 4}, summary
    assert list(summary.servers_lost) == ["http1"] and summary.retried >= 1
    recs = list(iter_records(tmp_path / "out" / "episodes.jsonl"))
    assert {r.tool_server["alias"] for r in recs} == {"http0"} and len({r.key for r in recs}) == 4
    assert trainable(recs) == recs


def test_episodes_that_ended_in_an_infrastructure_error_are_not_trained_on(tmp_path):
    from harness.trajectory import ERROR_ENDS
    from training.ppo.agentic import record_metrics, trainable

    with ScriptedLLM(read_then_stop) as llm:
        anyio.run(run_rollout, config(tmp_path / "ok", llm, samples=1))
    rec = next(iter_records(tmp_path / "ok" / "episodes.jsonl"))
    broken = [rec.model_copy(update={"ended": end, "reward": None}) for end in sorted(ERROR_ENDS)]
    assert trainable([rec, *broken]) == [rec]
    assert record_metrics([rec, *broken])["episodes/untrainable"] == len(ERROR_ENDS)
