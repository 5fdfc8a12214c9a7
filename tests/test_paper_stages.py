"""bench.proofs.stages end to end at the smallest size: each of the paper's stages runs for real (a tiny
random model, the CPU sandbox, the harness's episodes and judge, trl's RFT) and consumes the previous
stage's output folder. A random model fails every task, so what is checked is the chaining, not learning:
which folder each stage read, and that its output is what the next one needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the train extra is not installed")
pytest.importorskip("mcp", reason="the mcp extra is not installed")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.full  # minutes of PPO, RFT and critic steps; each stage alone: test_paper_stages_plan.py, test_ppo_*.py
@pytest.mark.slow  # two PPO steps, a warm-up step, four episodes, RFT and critic steps: minutes on 2 cores
def test_each_stage_consumes_the_previous_stages_output(tmp_path):
    from training.models import make_tiny_model

    out = tmp_path / "stages"
    # the fine-tuned starting point is given (a random tiny model): demonstrations are ppo_repair's business
    make_tiny_model(out / "sft", layers=1, hidden=32, heads=2, kv_heads=1, vocab=1024)
    cmd = [sys.executable, "-m", "bench.proofs.stages", "--out", str(out), "--device", "cpu",
           "--backend", "cpu", "--tasks", "1", "--rows", "64", "--samples", "1", "--warmup-steps", "1",
           "--rollout-samples", "3", "--max-turns", "2", "--max-response-tokens", "8", "--context-tokens", "4096",
           "--min-milestone", "failed", "--rft-keep-truncated", "--rft-epochs", "1", "--critic-steps", "2",
           "--holdout", "0.34", "--steps", "1", "--concurrency", "2", "--micro-batch", "2", "--minutes", "30"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    stages = {s["stage"]: s for s in json.loads((out / "stages.json").read_text())["stages"]}
    assert all(s["complete"] for s in stages.values()), stages
    cfg = lambda name: json.loads((out / name / "config.json").read_text())  # noqa: E731
    # 1. single-turn PPO from the fine-tuned model
    assert cfg("1-warmup")["ppo"]["model"] == str(out / "sft")
    assert (out / "1-warmup" / "final" / "config.json").is_file()
    # 2. the warm-up's actor, served by the engine, played judged multi-turn episodes with token ids
    episodes = [json.loads(ln) for ln in (out / "2-rollouts" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 and all(e["judgment"] and e["turns"][0]["completion_token_ids"] for e in episodes)
    # 3. RFT selected from those episodes and fine-tuned the warm-up's actor
    selection = json.loads((out / "3-rft" / "selection.json").read_text())
    assert selection["total"] == 3 and selection["kept"] >= 1
    assert (out / "3-rft" / "final" / "config.json").is_file()
    # 4. the critic learned on the same episodes, its backbone the RFT actor, one episode held out
    assert cfg("4-critic")["ppo"]["model"] == str(out / "3-rft" / "final")
    assert cfg("4-critic")["data"] == [str(out / "2-rollouts")]
    report = json.loads((out / "4-critic" / "critic_eval.json").read_text())
    assert report["heldout_episodes"] == 1 and "explained_variance_heldout_fresh_head" in report
    # 5. multi-turn PPO from the RFT actor, with the pretrained critic and with a fresh value head
    assert cfg("5-ppo")["ppo"]["model"] == str(out / "3-rft" / "final")
    assert cfg("5-ppo")["ppo"]["critic_model"] == str(out / "4-critic" / "final-critic")
    assert cfg("5-ppo-fresh-critic")["ppo"]["critic_model"] is None
    for name in ("5-ppo", "5-ppo-fresh-critic"):
        rows = [json.loads(ln) for ln in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 1 and "solved_first_turn" in rows[0] and "tool_calls/errors" in rows[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ppo_pretrained_critic"]["steps"] == 1 and summary["ppo_fresh_critic"]["steps"] == 1
    # a second call finds every stage complete and runs nothing
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and json.loads((out / "stages.json").read_text())["ran_this_call"] == []
