"""Parallel rollouts through the command line: kill one midway, resume it, and every episode is
recorded exactly once. The scripted model only reads a file and stops, so nothing is compiled
and the judge fails each workspace quickly (no sources), which keeps this test cheap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.trajectory import latest_records, repair_tail

pytest.importorskip("openai", reason="the harness extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "harness"))
from fake_llm import ScriptedLLM  # noqa: E402


def read_then_stop(body: dict[str, Any], turn: int) -> dict[str, Any]:
    if turn == 0:
        return {"content": "Looking at the reference.", "tool_calls": [("read_file", json.dumps({"path": "model.py"}))]}
    return {"content": "I give up."}


@pytest.fixture
def task_folder(tmp_path, small_task_path) -> Path:
    folder = tmp_path / "suite"
    folder.mkdir()
    for name in ("a_task", "b_task", "c_task"):
        shutil.copy(small_task_path, folder / f"{name}.py")
    return folder


def rollout_cmd(llm: ScriptedLLM, tasks: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "harness", "rollout", "--tasks", str(tasks), "--base-url", llm.url,
            "--model", "fake-model", "--api-key", "x", "--samples", "2", "--concurrency", "2", "--out", str(out),
            "--backend", "cpu", "--max-turns", "5", *extra]


def test_killed_rollout_resumes_and_runs_each_episode_once(tmp_path, task_folder):
    out = tmp_path / "run"
    episodes = out / "episodes.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with ScriptedLLM(read_then_stop, delay_s=0.5) as llm:
        log = open(tmp_path / "first.log", "w")
        proc = subprocess.Popen(rollout_cmd(llm, task_folder, out), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (episodes.is_file() and episodes.read_bytes().count(b"\n") >= 2):
                assert proc.poll() is None, (tmp_path / "first.log").read_text()
                assert time.monotonic() < deadline, "no episode finished in time"
                time.sleep(0.1)
        finally:
            # the whole process group: the rollout and the MCP server it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
        repair_tail(episodes)
        first = latest_records(episodes)
        assert 2 <= len(first) < 6, "the kill should land midway"

        # without --resume the folder is refused rather than mixed
        again = subprocess.run(rollout_cmd(llm, task_folder, out), capture_output=True, text=True, env=env,
                               cwd=REPO, timeout=120)
        assert again.returncode == 2 and "--resume" in again.stderr

        done = subprocess.run(rollout_cmd(llm, task_folder, out, "--resume"), capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert summary["skipped"] == len(first) and summary["ran"] == 6 - len(first)

        # resuming a finished run does nothing
        idle = subprocess.run(rollout_cmd(llm, task_folder, out, "--resume"), capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=120)
        assert idle.returncode == 0 and json.loads(idle.stdout)["ran"] == 0

    lines = [json.loads(line) for line in episodes.read_text().splitlines()]
    keys = [r["key"] for r in lines]
    expected = {f"suite/{t}#{s}" for t in ("a_task", "b_task", "c_task") for s in (0, 1)}
    assert sorted(keys) == sorted(expected), keys  # each exactly once
    for r in lines:
        assert r["ended"] == "model_stopped" and len(r["turns"]) == 2
        assert r["judgment"]["reward"]["milestone"] == "failed"
        assert r["judgment"]["compile"]["reason"] == "compile_error"  # nothing was written
    # the records kept from before the kill are untouched
    assert all(latest_records(episodes)[k].episode_id == rec.episode_id for k, rec in first.items())
    assert len(list((out / "runs.jsonl").read_text().splitlines())) == 3  # the refused run wrote nothing


def test_torn_last_line_is_cut(tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert repair_tail(path)
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert not repair_tail(path)
    path.write_bytes(b'{"no newline at all"')
    assert repair_tail(path) and path.read_bytes() == b""
