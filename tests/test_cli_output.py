"""Output that must not mislead: profile's text gives the whole call's time with its queue, and the docs and
help texts say what the commands are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import sandbox.api as api
from sandbox.present import demo_summary, profile_text
from sandbox.results import ProfileResult, RewardResult, Timing

REPO = Path(__file__).resolve().parent.parent


def _profile(reason: str | None = None, **kw) -> ProfileResult:
    t = Timing(median_ms=1.0, mean_ms=1.0, std_ms=0.01, min_ms=0.99, max_ms=1.02, iqr_ms=0.01, trials=10, input_sets=10)
    return ProfileResult(ok=reason is None, reason=reason, backend="cpu", device="cpu:x86_64:2", torch_version="2.13.0",
                         compile_mode="default", message="too noisy" if reason else "", candidate=t, eager=t, **kw)


def test_profile_text_gives_the_whole_time_and_the_queue():
    r = _profile(duration_s=75.0, queued_s=38.5, phases={"setup_queued": 1.5})
    assert profile_text(r).splitlines()[0].endswith("75.0 s, 40.0 s of it queued for the device)")
    failed = _profile("timing_noisy", duration_s=75.0, queued_s=40.0)
    assert profile_text(failed).startswith("profile FAILED [timing_noisy] (75.0 s, 40.0 s of it queued for the device)")
    assert "queued" not in profile_text(_profile(duration_s=3.0))


def test_a_settled_profile_counts_every_try_and_pause(monkeypatch):
    script = [_profile("timing_noisy", duration_s=30.0, queued_s=10.0, phases={"setup_queued": 2.0}),
              _profile(duration_s=35.5, queued_s=5.0)]
    monkeypatch.setattr(api, "profile_workspace", lambda ws, config=None: script.pop(0))
    monkeypatch.setattr(api, "NOISY_PAUSES_S", (0.25,))
    p = api.profile_settled(None, None, tries=3)
    assert p.ok and p.duration_s == 30.0 + 0.25 + 35.5 and p.queued_s == 10.0 + 2.0 + 5.0
    assert "65.8 s, 17.0 s of it queued for the device)" in profile_text(p)


def test_the_cpu_demo_does_not_speak_of_a_gpu():
    for r in (RewardResult(reward=2, milestone="faster_than_eager", compiled=True, correct=True, speedup_vs_eager=2.0,
                           speedup_vs_compile=0.9), RewardResult(reward=-1, milestone="failed", compiled=False,
                                                                  correct=False)):
        assert "GPU" not in demo_summary(r, "cpu")
    from sandbox.commands import DEMO_WHY

    assert "GPU" not in DEMO_WHY


def test_harness_doc_counts_its_commands_and_python_m_harness_lists_them():
    doc = (REPO / "docs" / "harness.md").read_text()
    m = re.search(r"^(\w+) commands \(also available as `python -m harness \.\.\.`\):\n\n((?:\|.*\n)+)", doc, re.M)
    rows = [line.split("`")[1] for line in m.group(2).splitlines()[2:]]
    words = {"Three": 3, "Four": 4, "Five": 5}
    assert words[m.group(1)] == len(rows), (m.group(1), rows)
    help_text = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True,
                               env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, timeout=120).stdout
    listed = re.findall(r"^│ (\w+) ", help_text, re.M)
    assert [f"cuda-agent {c}" for c in listed] == rows, help_text


def test_readme_names_the_task_each_demo_runs():
    from sandbox.commands import DEMO_TASKS

    readme = (REPO / "README.md").read_text()
    said = readme[readme.index("`demo` creates a workspace"):].split("\n\n")[0]
    assert f"`{DEMO_TASKS['cpu']}` on the CPU" in said and f"`{DEMO_TASKS['cuda']}`" in said
    assert "--backend cuda" in said
