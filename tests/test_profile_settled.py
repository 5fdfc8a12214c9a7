"""One-shot commands profile again while the verdict is timing_noisy (Judge VI, item 8).

A machine too noisy to time cannot be made on demand, so the profiles here are scripted: each test replaces
sandbox.api's profile_workspace with a sequence of verdicts and checks what profile_settled, the `profile`
and `reward` commands and the demo make of it. The judge itself is unchanged and exercised elsewhere.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import sandbox.api as api
from sandbox.commands import ONE_SHOT_TRIES, app
from sandbox.results import ProfileResult


def _result(reason: str | None) -> ProfileResult:
    return ProfileResult(ok=reason is None, reason=reason, backend="cpu", compile_mode="default", duration_s=0.1,
                         message="too noisy to score" if reason else "timed", speedup_vs_eager=1.5 if not reason else None)


@pytest.fixture
def scripted(monkeypatch):
    """Install a script of verdicts; returns the list of calls made."""
    calls: list[int] = []

    def install(*reasons):
        script = list(reasons)

        def fake(ws, config=None):
            calls.append(1)
            return _result(script.pop(0) if script else reasons[-1])

        monkeypatch.setattr(api, "profile_workspace", fake)
        monkeypatch.setattr(api, "NOISY_PAUSES_S", (0.0,))
        return calls
    return install


def test_noisy_profiles_are_run_again_until_scored(scripted):
    calls = scripted("timing_noisy", "timing_noisy", None)
    p = api.profile_settled(None, None, tries=3)
    assert p.ok and len(calls) == 3
    assert any("profiled 3 times" in n for n in p.sandbox_notes), p.sandbox_notes


def test_the_number_of_profiles_is_bounded(scripted):
    calls = scripted("timing_noisy")
    p = api.profile_settled(None, None, tries=3)
    assert p.reason == "timing_noisy" and len(calls) == 3


@pytest.mark.parametrize("reason", ["timing_unverified", "value_mismatch", None])
def test_any_other_verdict_returns_at_once(scripted, reason):
    calls = scripted(reason, None)
    p = api.profile_settled(None, None, tries=3)
    assert p.reason == reason and len(calls) == 1 and p.sandbox_notes == []


def test_the_profile_command_settles_a_noisy_verdict(scripted, cpu_ws):
    calls = scripted("timing_noisy", None)
    r = CliRunner().invoke(app, ["profile", str(cpu_ws.root), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] and len(calls) == 2
    assert ONE_SHOT_TRIES >= 2
