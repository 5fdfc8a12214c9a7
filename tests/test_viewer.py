"""The HTML viewer on a real recorded rollout: the scripted model (the one fake: no capable LLM here)
talks HTTP to the openai client, works a real MCP server and the CPU sandbox, and smuggles markup into
its reasoning, messages and tool arguments. Unit tests read the generated file; the browser tests open
it in headless Chromium over the DevTools protocol and check what a reader would see."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from harness.config import AgentConfig, JudgeConfig, ModelConfig, RolloutConfig, SamplingConfig
from harness.rollout import run_rollout
from harness.trajectory import iter_records
from harness.viewer import build_view, render, script_json, write_html
from harness.viewer.data import ViewerError, load_training_metrics

pytest.importorskip("openai", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "harness"))
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "viewer"))
from cdp import Chromium, find_chromium  # noqa: E402
from fake_llm import ScriptedLLM  # noqa: E402

SOLUTION = REPO / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"
KERNEL = (SOLUTION / "kernels" / "swish_bias.cpp").read_text()
MODEL_NEW = (SOLUTION / "model_new.py").read_text()
# markup a model might write; if any of it ran, window.__pwned would be set
EVIL = ('<script>window.__pwned = "script"</script></script><script>window.__pwned = "close"</script>'
        '<img src=x onerror="window.__pwned = \'img\'"><!-- \u2028 &amp;')


def args(**kw: Any) -> str:
    return json.dumps(kw)


def script(body: dict[str, Any], turn: int) -> dict[str, Any]:
    task_prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
    if "beta_task" in task_prompt:  # the second task's episode gives up: a failed row in the table
        return {"content": "I cannot do this one. " + EVIL}
    steps: list[dict[str, Any]] = [
        {"reasoning": "Reference first. " + EVIL, "content": "Reading " + EVIL,
         "tool_calls": [("read_file", args(path="model.py")), ("read_file", args(path=EVIL))]},
        {"content": "Writing the kernel and ModelNew.",
         "tool_calls": [("write_file", args(path="kernels/swish_bias.cpp", content=KERNEL)),
                        ("write_file", args(path="model_new.py", content=MODEL_NEW + "# " + EVIL + "\n"))]},
        {"tool_calls": [("edit_file", args(path="model_new.py", old_text="# " + EVIL, new_text="# tidy"))]},
        {"tool_calls": [("compile", "{}")]},
        {"tool_calls": [("verify", args(trials=2))]},
        {"content": "Done. " + EVIL},
    ]
    return steps[turn] if turn < len(steps) else {"content": "nothing left to do"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_task_path) -> Path:
    suite = tmp_path_factory.mktemp("suite")
    for name in ("alpha_task", "beta_task"):
        shutil.copy(small_task_path, suite / f"{name}.py")
    out = tmp_path_factory.mktemp("run")
    with ScriptedLLM(script) as llm:
        cfg = RolloutConfig(
            tasks=[str(suite)], out=out, concurrency=2, progress=False,
            model=ModelConfig(model="fake-model", base_url=[llm.url], api_key="x", max_retries=0),
            sampling=SamplingConfig(temperature=0.0, max_tokens=4096), agent=AgentConfig(backend="cpu", max_turns=20),
            judge=JudgeConfig(verify_trials=2))
        summary = anyio.run(run_rollout, cfg)
        assert llm.errors == [], llm.errors
    assert summary.ran == 2 and summary.correct == 1, summary
    # what training/ writes: one JSON object per step
    with open(out / "metrics.jsonl", "w") as fh:
        for step in range(5):
            fh.write(json.dumps({"step": step, "reward_mean": 0.1 * step, "kl": 0.01 * step, "note": "text"}) + "\n")
        fh.write("not json\n")
    return out


@pytest.fixture(scope="module")
def page(run_dir) -> Path:
    return write_html(run_dir)


def test_script_json_cannot_close_its_element_and_round_trips():
    value = {"s": EVIL, "u": "\u2028\u2029", "n": [1, 2.5, None]}
    text = script_json(value)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == value


def test_page_is_self_contained_and_holds_every_episode(page, run_dir):
    html = page.read_text()
    assert page == run_dir / "report.html"
    # nothing fetched from elsewhere: no src/href to other places, no imports
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "@import" not in html and "fetch(" not in html
    ids = re.findall(r'<script type="application/json" id="(ep-\d+)">', html)
    assert ids == ["ep-0", "ep-1"]
    # the only executable scripts are the page's own two; the model's markup stays inside JSON, escaped
    assert len(re.findall(r"<script>", html)) == 2
    assert "window.__pwned" in html  # it is there, as data
    assert '<script>window.__pwned' not in html and "<img src=x" not in html
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]


def test_view_data_follows_the_trajectory(run_dir):
    view = build_view(run_dir)
    recs = sorted(iter_records(run_dir / "episodes.jsonl"), key=lambda r: r.task.id)
    idx = view["index"]
    assert [e["task"] for e in idx["episodes"]] == [r.task.id for r in recs]
    assert [r.task.id.rsplit("/", 1)[-1] for r in recs] == ["alpha_task", "beta_task"]
    assert idx["report"]["overall"]["correct"] == 1 and idx["report"]["overall"]["pass_rate"] == 0.5
    # the solved episode's milestone depends on how fast the machine runs it against eager
    assert idx["episodes"][0]["milestone"] in ("correct", "faster_than_eager", "faster_than_compile")
    assert [e["milestone"] for e in idx["episodes"]] == [r.judgment.reward.milestone for r in recs]
    assert idx["episodes"][1]["milestone"] == "failed"
    body = view["bodies"][0]
    calls = [c for m in body["messages"] for c in m.get("calls", [])]
    assert [c["name"] for c in calls] == ["read_file", "read_file", "write_file", "write_file", "edit_file",
                                          "compile", "verify"]
    assert calls[1]["is_error"] and json.loads(calls[1]["args"])["path"] == EVIL
    assert "workspace_id" not in calls[0]["args"]  # the harness's binding is not the model's argument
    # the edit replays on top of the write: the final model_new.py is the edited one, shown as a diff
    assert body["files"]["model_new.py"] == MODEL_NEW + "# tidy\n"
    assert body["files"]["kernels/swish_bias.cpp"] == KERNEL
    assert "-# " + EVIL in calls[4]["edit"]["diff"] and "+# tidy" in calls[4]["edit"]["diff"]
    assert calls[5]["structured"]["ok"] and calls[6]["structured"]["ok"]
    # token ids are left out; the long system prompt is stored once for the run
    assert "prompt_token_ids" not in json.dumps(body)
    assert len(idx["prompts"]) == 1 and body["messages"][0]["prompt_ref"] in idx["prompts"]
    assert idx["training"][4] == {"step": 4.0, "reward_mean": pytest.approx(0.4), "kl": pytest.approx(0.04)}


def test_training_metrics_keep_numbers_only(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "loss": 0.5, "ok": true, "name": "x", "bad": NaN}\n[1, 2]\n{"step": 2}\n')
    assert load_training_metrics(p) == [{"step": 1.0, "loss": 0.5}, {"step": 2.0}]


def test_cli_writes_the_page_and_refuses_a_folder_without_episodes(run_dir, tmp_path):
    from typer.testing import CliRunner

    from cuda_agent.cli import app

    out = tmp_path / "x" / "view.html"
    res = CliRunner().invoke(app, ["view", str(run_dir), "--out", str(out), "--title", "<b>mine</b>"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "\\u003cb\\u003emine" in out.read_text()
    bad = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert bad.exit_code == 2 and "episodes.jsonl" in bad.output
    with pytest.raises(ViewerError):
        build_view(tmp_path)


def test_serve_answers_on_loopback_with_the_written_page(run_dir, tmp_path):
    import subprocess
    import urllib.request

    out = tmp_path / "served" / "report.html"
    proc = subprocess.Popen([sys.executable, "-m", "cuda_agent", "view", str(run_dir), "--out", str(out), "--serve",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/report\.html", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        with urllib.request.urlopen(url.group(0), timeout=30) as resp:
            assert resp.status == 200 and resp.read() == out.read_bytes()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_render_scales_to_thousands_of_episodes(run_dir):
    view = build_view(run_dir)
    rows, bodies = view["index"]["episodes"], view["bodies"]
    many = {"index": {**view["index"], "episodes": [dict(rows[i % 2], task=f"t{i}") for i in range(3000)]},
            "bodies": [bodies[i % 2] for i in range(3000)]}
    html = render(many)
    assert html.count('<script type="application/json" id="ep-') == 3000


# ---------- in a real browser ----------
CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium; "
                                   "or set CHROMIUM=/path/to/chrome)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install -e '.[test]')")
    b = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@needs_browser
def test_browser_shows_the_overview_table_and_filters(browser, page, tmp_path):
    browser.goto(page.as_uri())
    assert browser.eval("document.querySelectorAll('#episodes tbody tr').length") == 2
    assert "50.0%pass rate" in browser.eval("document.querySelector('#cards').textContent")
    assert browser.eval("document.querySelectorAll('.chart svg').length") >= 8
    browser.eval("(() => { const f = document.getElementById('filter'); f.value = 'beta';"
                 " f.dispatchEvent(new Event('input')); })()")
    rows = browser.eval("[...document.querySelectorAll('#episodes tbody tr')].map(r => r.cells[0].textContent.split('/').pop())")
    assert rows == ["beta_task"]
    assert browser.eval("document.getElementById('count').textContent") == "1 of 2 episodes"
    browser.eval("(() => { const f = document.getElementById('filter'); f.value = '';"
                 " f.dispatchEvent(new Event('input')); })()")
    assert browser.eval("document.querySelectorAll('#episodes tbody tr').length") == 2
    browser.eval("(() => { const s = document.getElementById('f-milestone'); s.value = 'failed';"
                 " s.dispatchEvent(new Event('change')); })()")
    rows = browser.eval("[...document.querySelectorAll('#episodes tbody tr')].map(r => r.cells[0].textContent.split('/').pop())")
    assert rows == ["beta_task"]
    # sorting: a click on the task header turns the order around (the milestone filter reset first)
    browser.eval("(() => { const s = document.getElementById('f-milestone'); s.value = '';"
                 " s.dispatchEvent(new Event('change')); })()")
    browser.eval("document.querySelector('th[data-key=task]').click()")
    rows = browser.eval("[...document.querySelectorAll('#episodes tbody tr')].map(r => r.cells[0].textContent.split('/').pop())")
    assert rows == ["beta_task", "alpha_task"]
    shot = browser.screenshot(tmp_path / "overview.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _keep(shot, "viewer-overview.png")


@needs_browser
def test_browser_episode_shows_tool_calls_and_runs_no_injected_markup(browser, page, tmp_path):
    browser.goto(page.as_uri() + "#ep/0")
    browser.wait_for("!!document.getElementById('conversation')")
    names = browser.eval("[...document.querySelectorAll('.call .name')].map(e => e.textContent)")
    assert names == ["read_file", "read_file", "write_file", "write_file", "edit_file", "compile", "verify"]
    # results are folded; verdicts and the diff are visible
    assert browser.eval("[...document.querySelectorAll('details.result')].every(d => !d.open)")
    assert browser.eval("document.querySelectorAll('.diff .add').length") > 0
    assert browser.eval("document.querySelectorAll('.tok-kw').length") > 0  # the highlighted final kernels
    text = browser.eval("document.body.innerText")
    assert "window.__pwned" in text and "<script>" in text  # shown as text, verbatim
    assert browser.eval("typeof window.__pwned") == "undefined"
    assert browser.eval("document.querySelectorAll('img').length") == 0
    assert browser.eval("document.querySelectorAll('script').length") == 2 + 1 + 2  # own two, index, two bodies
    browser.eval("document.querySelector('.msg.assistant').scrollIntoView()")
    shot = browser.screenshot(tmp_path / "episode.png")
    _keep(shot, "viewer-episode.png")


@needs_browser
def test_browser_shows_training_charts(browser, page):
    browser.goto(page.as_uri() + "#training")
    browser.wait_for("!!document.getElementById('training-charts')")
    titles = browser.eval("[...document.querySelectorAll('#training-charts .t')].map(e => e.textContent)")
    assert titles == ["reward_mean", "kl"]
    assert browser.eval("document.querySelectorAll('#training-charts polyline').length") == 2


@needs_browser
def test_browser_shows_torch_compiles_kernels_in_an_analysis(browser, page):
    """An analysis that carries torch.compile's kernels (from a cached baseline: sandbox/analyze/analysis.py) shows
    them under their own heading, beside the fallback's table; one without them shows no heading."""
    browser.goto(page.as_uri())
    browser.wait_for("typeof analyzeView === 'function'")
    shown = browser.eval("analyzeView({ok: false, unavailable: 'cpu_backend', message: '', fallback: [{name: 'forward "
                         "(whole call)', total_us: 40.0, calls: 1}], compiled_kernels: [{name: 'triton_poi_fused_mul_0',"
                         " total_us: 12.5, calls: 1}]}).map(e => e.textContent).join('|')")
    assert "torch.compile's kernels (the cached baseline's)" in shown and "triton_poi_fused_mul_012.5 us" in shown, shown
    without = browser.eval("analyzeView({ok: false, unavailable: 'cpu_backend', message: '', fallback: []})"
                           ".map(e => e.textContent).join('|')")
    assert "torch.compile" not in without, without


def _keep(shot: Path, name: str) -> None:
    """With CUDA_AGENT_SCREENSHOTS=DIR the screenshots are kept there (how docs/ got its pictures)."""
    folder = os.environ.get("CUDA_AGENT_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(folder) / name)
