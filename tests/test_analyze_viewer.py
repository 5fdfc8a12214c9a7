"""analyze where agents and people see it: the harness's prompt names the tool, a rollout's trajectory keeps the
analysis's structured result, and the HTML viewer shows it in the call and beside the judgment's profile. A scripted
model (the one fake: no capable LLM here) works a real MCP server and the CPU sandbox, where the analysis is the
torch profiler's table with the reason ncu could not run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from harness.config import AgentConfig, JudgeConfig, ModelConfig, RolloutConfig, SamplingConfig
from harness.prompts import system_prompt
from harness.rollout import run_rollout
from harness.trajectory import iter_records
from harness.viewer import build_view, write_html

pytest.importorskip("openai", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "harness"))
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "viewer"))
from cdp import Chromium, find_chromium  # noqa: E402
from fake_llm import ScriptedLLM  # noqa: E402

SOLUTION = REPO / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"


def script(body: dict[str, Any], turn: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [
        {"tool_calls": [("write_file", json.dumps({"path": "kernels/swish_bias.cpp",
                                                   "content": (SOLUTION / "kernels" / "swish_bias.cpp").read_text()})),
                        ("write_file", json.dumps({"path": "model_new.py",
                                                   "content": (SOLUTION / "model_new.py").read_text()}))]},
        {"tool_calls": [("compile", "{}")]},
        {"tool_calls": [("verify", json.dumps({"trials": 1}))]},
        {"tool_calls": [("analyze", "{}")]},
        {"content": "Done."},
    ]
    return steps[turn] if turn < len(steps) else {"content": "nothing left to do"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_task_path) -> Path:
    suite = tmp_path_factory.mktemp("suite")
    shutil.copy(small_task_path, suite / "analyzed_task.py")
    out = tmp_path_factory.mktemp("run")
    with ScriptedLLM(script) as llm:
        cfg = RolloutConfig(
            tasks=[str(suite)], out=out, concurrency=1, progress=False,
            model=ModelConfig(model="fake-model", base_url=[llm.url], api_key="x", max_retries=0),
            sampling=SamplingConfig(temperature=0.0, max_tokens=4096), agent=AgentConfig(backend="cpu", max_turns=10),
            judge=JudgeConfig(verify_trials=1))
        summary = anyio.run(run_rollout, cfg)
        assert llm.errors == [], llm.errors
    assert summary.ran == 1, summary
    return out


def test_the_default_prompt_names_the_tool():
    prompt = system_prompt()
    assert "analyze (Nsight Compute's roofline and bottleneck" in prompt
    assert "## 10. Reading an analysis (roofline and bottlenecks)" in prompt  # SKILL.md's section, behind it


@pytest.mark.full  # a whole CPU rollout (~75 s on 2 cores); the analysis tool through a real client is test_analyze.py::test_the_mcp_tool_through_the_sdks_client, rollouts' trajectories test_harness_rollout.py, the viewer test_viewer.py
def test_the_trajectory_keeps_the_analysis_and_the_viewer_shows_it(run_dir):
    (rec,) = list(iter_records(run_dir / "episodes.jsonl"))
    analyses = [c for t in rec.turns for c in t.tool_calls if c.name == "analyze"]
    assert len(analyses) == 1
    st = analyses[0].structured
    assert st is not None and st["unavailable"] == "cpu_backend" and st["fallback"], st
    assert "torch profiler's table of ModelNew's forward instead" in analyses[0].result_text
    assert rec.judgment.profile is not None  # the reward still comes from the judge's own profile alone
    body = build_view(run_dir)["bodies"][0]
    calls = [c for m in body["messages"] for c in m.get("calls", [])]
    shown = next(c for c in calls if c["name"] == "analyze")
    assert shown["structured"] == st
    html = write_html(run_dir).read_text()
    assert "function analyzeView" in html and "last-analysis" in html


CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium; or set CHROMIUM=...)")
@pytest.mark.full  # the same rollout as above; the viewer in a browser stays in the default tier in test_viewer.py
def test_the_browser_shows_the_analysis_beside_the_profile(run_dir, tmp_path):
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install -e '.[test]')")
    page = write_html(run_dir)
    browser = Chromium(CHROMIUM, tmp_path / "chromium-profile")
    try:
        browser.goto(page.as_uri() + "#ep/0")
        browser.wait_for("!!document.getElementById('last-analysis')")
        beside = browser.eval("document.getElementById('last-analysis').innerText")
        assert "cpu_backend" in beside and "torch profiler's table" in beside
        assert browser.eval("[...document.querySelectorAll('.call .name')].map(e => e.textContent)").count("analyze") == 1
    finally:
        browser.close()
