"""The PPO learner on a GPU: bf16 autocast, gradient checkpointing and the batched warm-up sampler."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the train extra is not installed")


@pytest.mark.gpu
def test_a_bf16_checkpointed_update_moves_logprobs_by_advantage_sign(tmp_path):
    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.config import PPOConfig
    from training.ppo.generate import sample
    from training.ppo.learner import PPOLearner
    from training.ppo.samples import Sample, collate, from_completion

    path = make_tiny_model(tmp_path / "m", layers=2, hidden=128, vocab=1024)
    tok = load_tokenizer(str(path))
    cfg = PPOConfig(model=str(path), device="cuda", bf16=True, gradient_checkpointing=True, actor_lr=3e-3,
                    critic_lr=3e-3, gamma=1.0, lam=1.0, kl_coef=0.05, micro_batch_size=2)
    learner = PPOLearner(cfg, pad_id=tok.pad_token_id)
    prompt = tok.encode("Write a relu kernel.")
    outs = sample(learner.actor, tok, [prompt, prompt], max_new_tokens=16, temperature=1.0)
    assert all(len(ids) == len(lps) > 0 for ids, lps, _ in outs)
    samples: list[Sample] = [from_completion(prompt, ids, lps, score) for (ids, lps, _), score
                             in zip(outs, (1.0, -1.0), strict=True)]
    items = learner.prepare(samples)
    stats = learner.batch_stats(items)
    assert stats["mismatch/abs_logp_diff"] < 0.05  # sampler (bf16 off) vs learner (bf16 autocast)
    with torch.no_grad():
        mb = {k: v.cuda() for k, v in collate(items, tok.pad_token_id).items()}
        before = learner.actor_forward(learner.actor, mb)[0]
    learner.update(items)
    with torch.no_grad():
        after = learner.actor_forward(learner.actor, mb)[0]
    delta = ((after - before) * mb["mask"]).sum(-1)
    assert float(delta[0]) > 0 and float(delta[1]) < 0
