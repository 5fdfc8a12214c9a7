"""The PPO learner's arithmetic and one real update on a tiny Qwen3 model (CPU)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the train extra is not installed")

from training.ppo import losses as L  # noqa: E402
from training.ppo.config import PPOConfig  # noqa: E402
from training.ppo.samples import Sample, from_rl_row  # noqa: E402


def test_gae_steps_over_tool_spans_and_matches_a_hand_computation():
    # prompt (2 tokens), turn 1 (2 model tokens), a tool result (2 tokens), turn 2 (3 model tokens)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.float32)
    values = torch.tensor([[0.7, 0.7, 0.1, 0.2, 0.9, 0.9, 0.3, 0.4, 0.5]])
    rewards = L.place_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 1.0]]
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand over the five model tokens (values .1 .2 .3 .4 .5, reward 1 at the end, gamma*lam = .72):
    # deltas: .5, .9*.5-.4=.05, .9*.4-.3=.06, .9*.3-.2=.07 (the next value skips the tool span), .9*.2-.1=.08
    a5 = 0.5
    a4 = 0.05 + 0.72 * a5
    a3 = 0.06 + 0.72 * a4
    a2 = 0.07 + 0.72 * a3
    a1 = 0.08 + 0.72 * a2
    expected = [0, 0, a1, a2, 0, 0, a3, a4, a5]
    assert adv[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert ret[0].tolist() == pytest.approx([a + v if m else 0 for a, v, m in
                                             zip(expected, values[0].tolist(), mask[0].tolist(), strict=True)],
                                            abs=1e-6)
    # gamma = lam = 1: every model token's return is the episode's reward, across the tool span
    _, ret1 = L.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert ret1[0][mask[0].bool()].tolist() == pytest.approx([1.0] * 5)
    # a reward put on a tool token is not an action's reward and is ignored
    _, ret2 = L.gae(rewards + torch.tensor([[0, 0, 0, 0, 5.0, 0, 0, 0, 0]]), values, mask, 1.0, 1.0)
    assert torch.equal(ret2, ret1)


def test_whitening_uses_only_model_tokens_and_the_dual_clip_bounds_negative_advantages():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1.0, 1.0, 1.0, 0.0])
    w = L.masked_whiten(x, m)
    assert w[3] == 0 and float(w[:3].mean()) == pytest.approx(0, abs=1e-6)
    assert float(w[:3].std(unbiased=False)) == pytest.approx(1, abs=1e-4)
    # ratio 10 on a negative advantage: the plain clip would charge 10 * |A|, the dual clip 3 * |A|
    logp, old, adv = torch.tensor([0.0]), torch.tensor([-float(torch.log(torch.tensor(10.0)))]), torch.tensor([-1.0])
    loss, _ = L.policy_loss(logp, old, adv, torch.ones(1), 0.2, 0.2, dual_clip=3.0)
    assert float(loss) == pytest.approx(3.0)
    loss, _ = L.policy_loss(logp, old, adv, torch.ones(1), 0.2, 0.2, dual_clip=None)
    assert float(loss) == pytest.approx(10.0, rel=1e-5)
    # k3 is non-negative and zero only where the distributions agree
    assert float(L.kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.0]), "k3")) == 0
    assert float(L.kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "k3")) > 0
    # a token pushed down 8 nats below the reference: exp(8) unbounded, 10 per token at most (verl's low_var_kl)
    assert float(L.kl_penalty(torch.tensor([-8.5]), torch.tensor([-0.5]), "k3")) == pytest.approx(L.K3_MAX)
    assert float(L.kl_penalty(torch.tensor([-0.5]), torch.tensor([-8.5]), "k3")) == pytest.approx(7.0003, abs=1e-3)


def test_rl_rows_become_samples_with_tool_tokens_masked():
    row = {"prompt_ids": [1, 2], "response_ids": [3, 4, 9, 9, 5], "response_mask": [1, 1, 0, 0, 1],
           "response_logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3], "reward": 0.5, "task_id": "t"}
    s = from_rl_row(row)
    assert s.input_ids == [1, 2, 3, 4, 9, 9, 5] and s.action_mask == [0, 0, 1, 1, 0, 0, 1]
    assert s.behaviour_logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.3] and s.score == 0.5
    cut = s.truncated(4)
    assert cut.input_ids == [1, 2, 3, 4] and cut.meta["truncated"] and cut.score == 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from training.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2, hidden=64, vocab=512)


def _samples(tok, good_score=1.0, bad_score=-1.0) -> list[Sample]:
    prompt = tok.encode("Write a kernel for relu.")
    good = tok.encode("torch.relu(x) is fused here.")
    bad = tok.encode("I refuse to write kernels today.")
    tool = tok.encode("<tool_response>ok</tool_response>")
    # a multi-turn sample: model tokens, a tool result (masked), model tokens again
    seq_good = prompt + good + tool + good
    mask_good = [0] * len(prompt) + [1] * len(good) + [0] * len(tool) + [1] * len(good)
    seq_bad = prompt + bad + tool + bad
    mask_bad = [0] * len(prompt) + [1] * len(bad) + [0] * len(tool) + [1] * len(bad)
    return [Sample(seq_good, mask_good, [0.0] * len(seq_good), good_score),
            Sample(seq_bad, mask_bad, [0.0] * len(seq_bad), bad_score)]


def _learner(tiny, **kw):
    from training.models import load_tokenizer
    from training.ppo.learner import PPOLearner

    tok = load_tokenizer(str(tiny))
    cfg = PPOConfig(model=str(tiny), device="cpu", **{"actor_lr": 3e-3, "critic_lr": 3e-3, "tis_cap": None, **kw})
    torch.manual_seed(0)
    return PPOLearner(cfg, pad_id=tok.pad_token_id), tok


def _logps(learner, items):
    from training.ppo.samples import collate

    with torch.no_grad():
        mb = collate(items, learner.pad_id)
        return learner.actor_forward(learner.actor, mb)[0], mb["mask"]


def test_one_update_raises_positive_and_lowers_negative_advantage_tokens(tiny):
    learner, tok = _learner(tiny, gamma=1.0, lam=1.0, ppo_epochs=1, minibatches=1, micro_batch_size=1,
                            kl_coef=0.0)
    items = learner.prepare(_samples(tok))
    good, bad = items
    assert (good["advantages"][good["mask"].bool()] > 0).all()
    assert (bad["advantages"][bad["mask"].bool()] < 0).all()
    assert (good["advantages"][~good["mask"].bool()] == 0).all()
    before, mask = _logps(learner, items)
    metrics = learner.update(items)
    after, _ = _logps(learner, items)
    delta = (after - before) * mask
    assert float(delta[0].sum()) > 0 and float(delta[1].sum()) < 0
    assert float((delta[0][mask[0].bool()] > 0).float().mean()) > 0.7
    assert float((delta[1][mask[1].bool()] < 0).float().mean()) > 0.7
    for key in ("actor/pg_loss", "actor/entropy", "actor/clip_frac", "critic/value_loss", "actor/grad_norm"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN


def test_samples_drawn_at_a_temperature_are_on_policy_for_a_learner_at_that_temperature(tiny):
    from training.ppo.generate import sample
    from training.ppo.samples import collate, from_completion

    learner, tok = _learner(tiny, temperature=0.5, tis_cap=2.0)
    prompt = tok.encode("Write a kernel for relu.")
    torch.manual_seed(1)
    outs = sample(learner.actor, tok, [prompt, prompt], max_new_tokens=12, temperature=0.5)
    samples = [from_completion(prompt, ids, lps, score) for (ids, lps, _), score in zip(outs, (1.0, -1.0), strict=True)]
    items = learner.prepare(samples)
    stats = learner.batch_stats(items)
    # the sampler's logprobs are of softmax(logits / 0.5), and so are the learner's: the importance
    # weights and the first PPO ratio are 1 (a learner scoring the raw logits would be far off)
    assert stats["mismatch/abs_logp_diff"] < 1e-4
    assert stats["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    metrics = learner.update(items)  # one epoch, one minibatch: the ratio is taken before any step
    assert metrics["actor/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["actor/clip_frac"] == 0
    # the same samples scored by a learner at temperature 1 differ by far more than numerics
    raw, _ = _learner(tiny, temperature=1.0, tis_cap=2.0)
    assert raw.batch_stats(raw.prepare(samples))["mismatch/abs_logp_diff"] > 0.05
    # and the entropy term is the tempered distribution's (sharper: lower than the raw one's)
    mb = collate(items, learner.pad_id)
    with torch.no_grad():
        ent_t = learner.actor_forward(learner.actor, mb, entropy=True)[1]
        ent_1 = raw.actor_forward(raw.actor, mb, entropy=True)[1]
    assert float((ent_t * mb["mask"]).sum()) < float((ent_1 * mb["mask"]).sum())
    with pytest.raises(ValueError, match="temperature"):
        _learner(tiny, temperature=0.0)


def test_masked_tokens_get_no_gradient(tiny):
    from training.ppo.samples import collate

    learner, tok = _learner(tiny, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    items = learner.prepare(_samples(tok))
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = learner.actor.lm_head.register_forward_hook(keep)
    mb = collate(items, learner.pad_id)
    learner.actor_opt.zero_grad()
    learner._actor_backward(mb, float(mb["mask"].sum()), defaultdict(float))
    handle.remove()
    grad = captured["logits"].grad[:, :-1]  # logits at t predict target t
    per_pos = grad.abs().sum(-1)
    m = mb["mask"].bool()
    assert float(per_pos[~m].max()) == 0.0
    assert float(per_pos[m].min()) > 0.0
    # what sits on masked positions (advantages, old and engine logprobs) cannot change the gradient
    g1 = [p.grad.clone() for p in learner.actor.parameters() if p.grad is not None]
    noisy = collate(items, learner.pad_id)
    for key in ("advantages", "old_logp", "behaviour_logp", "is_weights", "ref_logp"):
        noisy[key] = torch.where(m, noisy[key], torch.full_like(noisy[key], 7.0))
    learner.actor_opt.zero_grad()
    learner._actor_backward(noisy, float(m.sum()), defaultdict(float))
    g2 = [p.grad for p in learner.actor.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g1, g2, strict=True))


def test_critic_pretraining_lowers_the_value_loss(tiny):
    # lr 1e-3: at 1e-2 Adam overshot (0.625 -> 1.2 -> 0.54 in 15 steps) or not depending on the tiny
    # tokenizer (which changed with every docs edit until its corpus was pinned); at 1e-3 five tokenizers
    # (vocab and seed varied) all ended at 3-7% of the start in 20 steps
    learner, tok = _learner(tiny, gamma=1.0, lam=1.0, whiten_advantages=False, critic_lr=1e-3)
    samples = _samples(tok, good_score=1.0, bad_score=-0.5)

    def value_mse() -> float:
        items = learner.prepare(samples)
        m = torch.cat([it["mask"] for it in items])
        v = torch.cat([it["values"] for it in items])
        r = torch.cat([it["returns"] for it in items])
        return float(L.masked_mean((v - r) ** 2, m))

    actor_before = [p.detach().clone() for p in learner.actor.parameters()]
    start = value_mse()
    for step in range(20):
        metrics = learner.fit_values(learner.prepare(samples), step=step)
    end = value_mse()
    assert end < 0.25 * start, (start, end)
    assert "critic/value_loss" in metrics and "actor/pg_loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(actor_before, learner.actor.parameters(), strict=True))


def test_lora_learner_uses_the_adapter_free_actor_as_reference_and_syncs_merged_weights(tiny):
    from training.engine.hf import TransformersBackend

    learner, tok = _learner(tiny, lora_r=4, lora_alpha=8, kl_coef=0.1, gamma=1.0, lam=1.0, actor_lr=1e-2)
    assert learner.ref is None  # no second copy: the reference is the actor without its adapters
    items = learner.prepare(_samples(tok))
    # LoRA starts as a no-op, so the reference and the actor agree exactly at first
    assert all(torch.allclose(it["old_logp"], it["ref_logp"]) for it in items)
    before, mask = _logps(learner, items)
    learner.update(items)
    after, _ = _logps(learner, items)
    assert float(((after - before) * mask)[0].sum()) > 0
    with learner.actor.disable_adapter():
        ref_after, _ = _logps(learner, items)
    assert torch.allclose(ref_after, before, atol=1e-5)  # the base weights did not move
    # the engine takes the merged weights and then gives the learner's logprobs
    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32")
    backend.update_state_dict(learner.engine_state_dict(), version=1)
    ids = torch.tensor([items[0]["input_ids"].tolist()])
    with torch.no_grad():
        served = torch.log_softmax(backend.model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(served, after[0, : served.numel()], atol=1e-4)


def test_a_fresh_value_head_starts_at_zero_and_a_trained_one_loads_as_saved(tiny, tmp_path):
    from training.ppo.models import load_critic

    cfg = PPOConfig(model=str(tiny), device="cpu")
    critic = load_critic(str(tiny), cfg)  # from the actor's checkpoint: no score head there
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert critic(input_ids=ids).logits.abs().max() == 0
        critic.score.weight.fill_(0.01)
        critic.score.bias.fill_(0.5)
    critic.save_pretrained(tmp_path / "critic")
    again = load_critic(str(tmp_path / "critic"), cfg)
    assert torch.equal(again.score.weight, critic.score.weight) and float(again.score.bias) == 0.5


def test_decoupled_gae_gives_the_critic_monte_carlo_targets_and_the_actor_lam_advantages(tiny):
    # gamma 1, critic_lam 1: every model token's target is the episode's score, whatever the values;
    # the actor's advantages are GAE with its own lam = 0.5 over the same values
    learner, tok = _learner(tiny, gamma=1.0, lam=0.5, critic_lam=1.0, whiten_advantages=False)
    with torch.no_grad():  # values that differ per token, so that lam matters
        learner.critic.score.bias.fill_(0.3)
        learner.critic.score.weight.normal_(0, 0.5)
    items = learner.prepare(_samples(tok, good_score=1.0, bad_score=-0.5))
    for it, score in zip(items, (1.0, -0.5), strict=True):
        m = it["mask"].bool()
        assert torch.allclose(it["returns"][m], torch.full((int(m.sum()),), score)), it["returns"][m]
        adv, _ = L.gae(it["rewards"][None], it["values"][None], it["mask"][None], 1.0, 0.5)
        assert torch.allclose(it["advantages"], adv[0])
        assert not torch.allclose(it["advantages"][m], (it["returns"] - it["values"])[m])  # not lam = 1


def test_critic_warmup_steps_train_the_critic_alone_then_both(tiny):
    learner, tok = _learner(tiny, gamma=1.0, lam=1.0, critic_warmup=1)
    samples = _samples(tok)

    def snapshot(model):
        return [p.detach().clone() for p in model.parameters()]

    actor0, critic0 = snapshot(learner.actor), snapshot(learner.critic)
    m1 = learner.train_step(learner.prepare(samples), step=1)
    assert m1["actor/frozen"] == 1.0 and "actor/pg_loss" not in m1
    assert all(torch.equal(a, b) for a, b in zip(actor0, learner.actor.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(critic0, learner.critic.parameters(), strict=True))
    m2 = learner.train_step(learner.prepare(samples), step=2)
    assert m2["actor/frozen"] == 0.0 and "actor/pg_loss" in m2
    assert not all(torch.equal(a, b) for a, b in zip(actor0, learner.actor.parameters(), strict=True))
