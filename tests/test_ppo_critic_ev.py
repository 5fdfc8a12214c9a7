"""The critic's explained variance: the formula by hand, and critic pretraining (`train critic`'s loop on judged
episodes) learning a value that depends on the task and the chosen answer jointly, measured on held-out
episodes against a fresh value head."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the train extra is not installed")

from training.ppo import losses as L  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ppo_turns import engine_turns  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "training"))
from episodes import episode  # noqa: E402


def test_explained_variance_by_hand():
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    returns = torch.tensor([1.0, -1.0, 1.0, -1.0, 7.0])  # the masked 7 is not a model token: ignored
    assert L.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # a constant, whatever it is, explains nothing (a fresh zero head, or one that learned only the mean)
    assert L.explained_variance(torch.zeros(5), returns, mask) == pytest.approx(0.0)
    assert L.explained_variance(torch.full((5,), 0.3), returns, mask) == pytest.approx(0.0)
    # half the signal: residual variance 0.25 of the returns' 1.0
    assert L.explained_variance(returns / 2, returns, mask) == pytest.approx(0.75)
    # the wrong sign is worse than nothing: residual 2R has variance 4
    assert L.explained_variance(-returns, returns, mask) == pytest.approx(-3.0)
    # garbage on masked positions changes nothing
    garbage = torch.tensor([0.5, -0.5, 0.5, -0.5, -100.0])
    assert L.explained_variance(garbage, returns, mask) == pytest.approx(0.75)
    # nothing to explain when every episode had the same outcome
    assert math.isnan(L.explained_variance(torch.zeros(5), torch.ones(5), mask))


TASKS = ["relu", "abs", "neg", "square"]
EXPRS = ["(v > 0.0f) * v", "fabsf(v)", "-v", "v * v"]


def task_by_choice_episodes(tok, n: int, seed: int) -> list:
    """Single-answer episodes whose outcome is a joint function of the task (in the prompt) and the expression
    chosen (in the answer): each expression is right for one task and wrong for the others, so neither alone
    predicts the return, as in bench.proofs.family."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rng.randrange(len(TASKS))
        e = t if rng.random() < 0.4 else rng.randrange(len(EXPRS))
        answer = f"float v = x[i];\ny[i] = {EXPRS[e]};\nreturn y;"
        rec = episode([], task=TASKS[t], final=answer, sample=i, milestone="correct" if e == t else "failed",
                      episode_id=f"{seed}-{i}")
        rec.messages[1]["content"] = f"Task: {TASKS[t]}. Write the loop body."
        rec.tools = []  # the tools' schemas would be 85% of each prompt and tell the critic nothing here
        engine_turns(tok, rec)
        out.append(rec)
    return out


@pytest.mark.full  # 240 critic steps; the critic's update: test_ppo_learner.py
@pytest.mark.slow  # 240 critic steps of a 2-layer model on short prompts, two held-out evaluations: ~40 s on 2 cores
def test_pretrained_critic_explains_held_out_returns_a_fresh_head_does_not(tmp_path):
    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.config import PPOConfig
    from training.ppo.critic import (
        CriticConfig,
        explained_variance_on,
        load_samples,
        run_critic,
        split_holdout,
    )
    from training.ppo.learner import PPOLearner

    torch.set_num_threads(1)
    tiny = make_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024)
    tok = load_tokenizer(str(tiny))
    data = tmp_path / "episodes.jsonl"
    data.write_text("".join(r.model_dump_json() + "\n" for r in task_by_choice_episodes(tok, 320, 0)))
    ppo = PPOConfig(model=str(tiny), device="cpu", critic_lr=1e-3, lam=1.0, gamma=1.0, micro_batch_size=16)
    torch.manual_seed(0)
    # 240 steps: from a zero value head the same run read 0.16 after 200 steps (the plateau models.py's
    # randomize_fresh_head explains), from the random one 0.38 (0.41 once the prompts lost the tools)
    run_critic(CriticConfig(ppo=ppo, data=[data], out=tmp_path / "critic", steps=240, batch_size=16,
                            save_every=1000, holdout=0.2, eval_every=60, tensorboard=False))
    report = json.loads((tmp_path / "critic" / "critic_eval.json").read_text())
    # the split is by episode: no held-out episode was trained on
    _, heldout = split_holdout(load_samples([data]), 0.2)
    assert report["heldout_episodes"] == len(heldout) >= 40
    pretrained = report["explained_variance_heldout"]
    # a fresh value head predicts 0 everywhere: it explains nothing
    fresh = PPOLearner(ppo, pad_id=tok.pad_token_id, train_actor=False)
    assert explained_variance_on(fresh, heldout) == pytest.approx(0.0, abs=1e-6)
    # the pretrained one, loaded back as `train ppo --critic-model` loads it, explains the held-out returns
    loaded = PPOLearner(PPOConfig(**{**ppo.to_dict(), "critic_model": str(tmp_path / "critic" / "final-critic")}),
                        pad_id=tok.pad_token_id, train_actor=False)
    assert explained_variance_on(loaded, heldout) == pytest.approx(pretrained, abs=1e-4)
    assert pretrained > 0.3, report
