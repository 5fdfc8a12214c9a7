"""Rollouts and eval on a real Ray cluster (CPU backend): two nodes simulated on this host with
ray.cluster_utils.Cluster, as Ray's own tests do. Episodes spread over both nodes' judge actors; a node
removed mid-run costs time, not episodes: every episode is recorded once, judged on the node that is left,
and the summary counts the retries. One cluster serves the module (starting one takes ~10 s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'cuda-agent[ray]')")
pytest.importorskip("openai", reason="the harness extra is not installed")

from harness.trajectory import latest_records  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "harness"
sys.path.insert(0, str(FIXTURES))
from fake_llm import ScriptedLLM  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    c.workers = workers  # type: ignore[attr-defined]
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def read_then_stop(body: dict[str, Any], turn: int) -> dict[str, Any]:
    if turn == 0:
        return {"content": "Looking.", "tool_calls": [("read_file", json.dumps({"path": "model.py"}))]}
    return {"content": "I give up."}


def _suite(tmp_path: Path, small_task_path: Path, names: list[str]) -> Path:
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in names:
        shutil.copy(small_task_path, suite / f"{name}.py")
    return suite


def _status(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def test_dead_address_is_a_clear_error(tmp_path, small_task_path):
    suite = _suite(tmp_path, small_task_path, ["a"])
    r = subprocess.run([sys.executable, "-m", "harness", "rollout", "--tasks", str(suite), "--replay", str(tmp_path),
                        "--backend", "cpu", "--out", str(tmp_path / "run"), "--ray", "127.0.0.1:1"],
                       capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "[unreachable]" in r.stderr and "127.0.0.1:1" in r.stderr
    assert not (tmp_path / "run" / "episodes.jsonl").exists() or not (tmp_path / "run" / "episodes.jsonl").read_text()


@pytest.mark.full  # a two-node Ray cluster; the harness's episodes and rollouts: test_harness_episode.py, test_harness_rollout.py
def test_eval_spreads_over_both_nodes(cluster, tmp_path, small_task_path):
    suite = _suite(tmp_path, small_task_path, ["solved_a", "solved_b", "unsolved_c", "unsolved_d"])
    sols = tmp_path / "solutions"
    sols.mkdir()
    for name in ("solved_a", "solved_b"):
        shutil.copytree(REPO / "tasks" / "examples" / "solutions" / "swish_bias", sols / name)
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "harness", "eval", "--solutions", str(sols), "--tasks", str(suite),
                        "--out", str(out), "--backend", "cpu", "--concurrency", "4", "--verify-trials", "2",
                        "--no-plots", "--ray", cluster.address],
                       capture_output=True, text=True, env=ENV, cwd=REPO, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    overall = json.loads(r.stdout)
    assert overall["problems"] == 4 and overall["correct"] == 2
    records = latest_records(out / "episodes.jsonl")
    assert len(records) == 4
    for key, rec in records.items():
        assert rec.judgment.reward.correct == key.startswith("suite/solved"), (key, rec.judgment.reward)
        assert rec.tool_server["where"].startswith("ray:")
    # spread: both worker nodes judged episodes
    worker_ids = {n.node_id for n in cluster.workers}
    status = _status(out)
    assert status is not None and status["nodes"] == 2 and status["queue"] == 0
    assert {a["node_id"] for a in status["actors"]} == worker_ids
    assert all(a["judgments"] >= 1 for a in status["actors"]), status
    assert sum(a["judgments"] for a in status["actors"]) == 4
    # what each actor counted itself: the judge's compile/verify/profile went through it
    assert all((a["actor_counts"] or {}).get("judge_calls", 0) >= 1 for a in status["actors"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"]["actors"] == status["actors"] and summary["retried"] == 0
    assert "ray: 2/2 actors on 2 nodes" in r.stderr  # the status view in the command's output


@pytest.mark.full  # a two-node Ray cluster (as above)
def test_node_removed_mid_run_loses_no_episode(cluster, tmp_path, small_task_path):
    suite = _suite(tmp_path, small_task_path, ["t1", "t2", "t3"])
    out = tmp_path / "run"
    victim = cluster.workers[1]
    with ScriptedLLM(read_then_stop, delay_s=1.5) as llm:
        log = open(tmp_path / "rollout.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness", "rollout", "--tasks", str(suite), "--base-url", llm.url, "--model",
             "fake-model", "--api-key", "x", "--samples", "2", "--concurrency", "4", "--out", str(out), "--backend",
             "cpu", "--max-turns", "5", "--ray", cluster.address],
            stdout=subprocess.PIPE, stderr=log, text=True, env=ENV, cwd=REPO)
        try:
            deadline = time.monotonic() + 180
            while True:  # until an episode is in flight on the victim's actor
                assert proc.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no episode reached the second node"
                st = _status(out)
                if st and any(a["node_id"] == victim.node_id and a["in_flight"] for a in st["actors"]):
                    break
                time.sleep(0.05)
            cluster.remove_node(victim)
            stdout, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert proc.returncode == 0, (tmp_path / "rollout.log").read_text()[-4000:]
    summary = json.loads(stdout)
    records = latest_records(out / "episodes.jsonl")
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == len(records) == 6, "each episode recorded exactly once"
    assert summary["ran"] == 6 and summary["retried"] >= 1
    assert len(summary["servers_lost"]) == 1
    lost = next(iter(summary["servers_lost"]))
    survivor_where = {a["where"] for a in summary["cluster"]["actors"] if a["actor"] != lost}
    retried_here = 0
    for rec in records.values():
        # the right verdict: judged (the scripted model wrote nothing, so its workspace does not compile)
        assert rec.ended == "model_stopped", (rec.key, rec.ended, rec.end_detail)
        assert rec.judgment.compile is not None and not rec.judgment.compile.ok
        assert rec.judgment.reward.milestone == "failed"
        retried_here += rec.tool_server["where"] in survivor_where
    assert retried_here >= 4  # the survivor took the victim's retried and later episodes
    lost_rows = [a for a in summary["cluster"]["actors"] if a["state"] == "lost"]
    assert [a["node_id"] for a in lost_rows] == [victim.node_id]
    # the cluster gets its second node back for any later test of the module
    cluster.workers[1] = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cuda_agent", *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=timeout)


@pytest.mark.full  # a two-node Ray cluster (as above)
def test_verl_reaches_the_named_pool_by_address(cluster, tmp_path, small_task_path):
    """The documented example (docs/harness.md): `cluster up`, `export --format verl --ray`, then verl's tool
    and reward code over the pool. The tool's workspace is judged where it was built, by the same judge."""
    import hashlib
    import importlib.util

    import anyio
    import yaml

    from harness.verl import WORKSPACE_FIELD, WorkspaceSessions

    addr = cluster.address
    up = _cli("cluster", "up", "--ray", addr, "--backend", "cpu", "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        pool = json.loads(up.stdout)
        assert len(pool["actors"]) == 2 and pool["nodes"] == 2
        again = _cli("cluster", "up", "--ray", addr, "--json")
        assert again.returncode == 2 and json.loads(again.stdout)["error"] == "pool_exists"

        suite = _suite(tmp_path, small_task_path, ["small"])
        out = tmp_path / "verl"
        ex = _cli("export", "--format", "verl", "--ray", addr, "--tasks", str(suite), "--backend", "cpu", "--out",
                  str(out))
        assert ex.returncode == 0, ex.stderr[-3000:]
        cfg = yaml.safe_load((out / "tool_config.yaml").read_text())
        assert all(t["config"]["mcp_urls"] == [f"ray:{addr}"] for t in cfg["tools"])

        source = small_task_path.read_text()
        sha = hashlib.sha256(source.encode()).hexdigest()
        task = {"task_id": "suite/small", "task_source": source, "backend": "cpu"}
        sessions = WorkspaceSessions([f"ray:{addr}"], None)
        sol = REPO / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"

        async def build() -> list[str]:
            return [await sessions.call("req-1", task, "write_file", {
                "path": str(f.relative_to(sol)), "content": f.read_text()}) for f in sorted(sol.rglob("*.*"))]

        replies = anyio.run(build)
        assert all(not r.startswith("error") for r in replies), replies
        url, ws_id = sessions.open["req-1"]
        assert url.startswith(f"ray:{addr}#judge-") and "@" in url  # pinned to the actor's incarnation

        spec = importlib.util.spec_from_file_location("verl_reward", out / "reward.py")
        reward = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reward)
        extra = {**task, WORKSPACE_FIELD: {"url": url, "workspace_id": ws_id}}
        score = reward.compute_score("cuda_agent", "", sha, extra)
        assert score["workspace"] == "episode" and score["milestone"] != "failed" and score["score"] >= 1, score
        # a response whose file calls build nothing that compiles: rebuilt on the pool, and failed by the judge
        bad = '<tool_call>{"name": "write_file", "arguments": {"path": "model_new.py", "content": "x = ("}}</tool_call>'
        score = reward.compute_score("cuda_agent", bad, sha, task)
        assert score["workspace"] == "rebuilt" and score["file_calls_applied"] == 1 and score["score"] == -1.0

        st = _cli("cluster", "status", "--ray", addr, "--json")
        assert st.returncode == 0, st.stderr[-2000:]
        status = json.loads(st.stdout)
        assert sum(a["judge_calls"] for a in status["actors"]) >= 4  # compile, verify, profile; compile
    finally:
        down = _cli("cluster", "down", "--ray", addr, "--json")
        assert down.returncode == 0 and len(json.loads(down.stdout)["stopped"]) == 2


@pytest.mark.full  # a two-node Ray cluster (as above)
def test_executor_runs_a_dead_actors_call_again_elsewhere(cluster):
    """train warmup's and synth's judgments (plain functions on the actors): an actor killed mid-call costs a
    retry on the other one, and each call's result comes back once."""
    import subprocess as sp

    from harness.cluster.executor import RayExecutor

    ex = RayExecutor(cluster.address, "cpu", per_actor=2)
    try:
        assert len(ex.actors) == 2 and ex.status()["nodes"] == 2
        futures = [ex.submit(sp.getoutput, f"sleep 3; echo call-{i}") for i in range(4)]
        time.sleep(1.0)
        victim, _ = ex.actors["ray0"]
        ray.kill(victim, no_restart=False)  # dies with its calls in flight; Ray restarts it
        assert [f.result(timeout=120) for f in futures] == [f"call-{i}" for i in range(4)]
        st = ex.status()
        assert st["retried"] >= 1 and [a["actor"] for a in st["actors"] if a["state"] == "lost"] == ["ray0"]
        assert sum(a["judgments"] for a in st["actors"]) == 4
        with pytest.raises(ValueError):  # the function's own error is its answer, not a lost actor
            ex.submit(int, "not a number").result(timeout=60)
    finally:
        ex.shutdown()
