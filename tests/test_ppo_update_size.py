"""bench.proofs.update_size's bookkeeping on a tiny model: episodes the model itself sampled (their logprobs are its
own), one learner step per learning rate from the same start, and the change of each token's logprob sorted by
the sign of its episode's advantage. A sign slip or a mask that counts the prompt would show here."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the train extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "training"))

from episodes import episode  # noqa: E402
from test_ppo_turns import engine_turns  # noqa: E402

from bench.proofs.update_size import measure  # noqa: E402


def _own_logprobs(model, rec) -> None:
    """The completion logprobs an engine serving `model` would have returned for these tokens."""
    import torch

    for t in rec.turns:
        ids = torch.tensor([t.prompt_token_ids + t.completion_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        at = range(len(t.prompt_token_ids) - 1, ids.shape[1] - 1)
        t.completion_logprobs = [float(logp[i, ids[0, i + 1]]) for i in at]


def test_one_update_raises_the_rewarded_answers_and_lowers_the_failed_ones(tmp_path):
    from transformers import AutoModelForCausalLM

    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.critic import load_samples

    path = make_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, vocab=1024)
    tok, model = load_tokenizer(str(path)), AutoModelForCausalLM.from_pretrained(str(path))
    run = tmp_path / "step-000001"
    run.mkdir()
    with (run / "episodes.jsonl").open("w") as f:
        for i in range(4):  # one task, so one group: two right answers and two wrong ones
            right = i % 2 == 0
            rec = episode([], task="relu", final="y = (v > 0) * v;" if right else "y = -v;", sample=i,
                          milestone="correct" if right else "failed", episode_id=f"e{i}")
            rec.tools = []
            engine_turns(tok, rec)
            _own_logprobs(model, rec)
            f.write(rec.model_dump_json() + "\n")
    samples = load_samples([run])
    actions = sum(int(sum(s.action_mask)) for s in samples)
    args = argparse.Namespace(device="cpu", ppo_epochs=2, minibatches=2, micro_batch=2, estimator="grpo",
                              decision_p=0.9)
    still, moved = (measure(str(path), samples, lr, args) for lr in (1e-12, 1e-2))
    for r in (still, moved):
        # a random model samples nothing with p >= 0.9: every action token is a decision, and only those count
        assert r["decision_tokens"] == actions and r["other_tokens"] == 0 and r["other_abs_dlogp"] is None
    assert abs(still["decision_dlogp_positive_advantage"]) < 1e-4
    assert abs(still["decision_dlogp_negative_advantage"]) < 1e-4
    assert still["approx_kl_old"] == pytest.approx(0.0, abs=1e-4)  # its logprobs were the model's own
    assert moved["decision_dlogp_positive_advantage"] > 0.05 > -0.05 > moved["decision_dlogp_negative_advantage"]
    assert not math.isnan(moved["approx_kl_old"]) and moved["learn_s"] > 0
