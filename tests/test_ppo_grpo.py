"""GRPO beside GAE: the estimator registry, group-normalized advantages by hand, a learner without a critic
(real updates on a tiny Qwen3, CPU), and `--set advantage_estimator=...` through the CLI."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the train extra is not installed")

from training.ppo.advantages import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_normalized_scores,
    uses_critic,
)
from training.ppo.config import PPOConfig  # noqa: E402
from training.ppo.samples import from_rl_row  # noqa: E402

EPS = 1e-6


def test_group_normalized_scores_by_hand():
    # task a: three episodes 1, 0, -1 (mean 0, unbiased std 1); task b: two alike; task c: one alone;
    # task d: episode e1 split into two segments (rows) scoring 3, episode e2 scoring 1
    scores = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.5, 2.0, 3.0, 3.0, 1.0])
    groups = ["a", "a", "a", "b", "b", "c", "d", "d", "d"]
    episodes = ["a1", "a2", "a3", "b1", "b2", "c1", "e1", "e1", "e2"]
    adv = group_normalized_scores(scores, groups, episodes, eps=EPS)
    d = 1 / (2 ** 0.5 + EPS)  # episodes 3 and 1: mean 2, std sqrt(2); counting e1's rows twice would give 7/3
    expected = [1 / (1 + EPS), 0.0, -1 / (1 + EPS), 0.0, 0.0, 0.0, d, d, -d]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)
    # Dr. GRPO: the mean subtracted, no division
    raw = group_normalized_scores(scores, groups, episodes, eps=EPS, norm_by_std=False)
    assert raw.tolist() == pytest.approx([1, 0, -1, 0, 0, 0, 1, 1, -1], abs=1e-7)
    # the same rows in another order get the same advantages
    perm = [8, 3, 0, 6, 2, 5, 1, 7, 4]
    again = group_normalized_scores(scores[perm], [groups[i] for i in perm], [episodes[i] for i in perm], eps=EPS)
    assert again.tolist() == pytest.approx([expected[i] for i in perm], abs=1e-7)


def test_the_grpo_estimator_puts_the_row_advantage_on_model_tokens_only():
    cfg = PPOConfig(advantage_estimator="grpo")
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.zeros(3, 5)
    rewards[0, 4], rewards[1, 1], rewards[2, 3] = 2.0, 0.0, 1.0
    rewards[1, 3] = 9.0  # on a tool token: not an action's reward
    adv, ret = get_advantage_estimator("grpo")(rewards, None, mask, ["t"] * 3, ["x", "y", "z"], cfg)
    # scores 2, 0, 1: mean 1, std 1
    a = 1 / (1 + cfg.grpo_epsilon)
    assert torch.allclose(adv, torch.tensor([[a], [-a], [0.0]]) * mask, atol=1e-7)
    assert torch.equal(adv, ret)


def test_estimators_are_registered_by_name_and_an_unknown_one_is_named_with_the_known_ones():
    assert {"gae", "grpo"} <= set(ADVANTAGE_ESTIMATORS)
    assert uses_critic("gae") and not uses_critic("grpo")
    with pytest.raises(ValueError, match="unknown advantage_estimator 'ppo2'.*gae, grpo"):
        get_advantage_estimator("ppo2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from training.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2, hidden=64, vocab=512)


def _rows(tok) -> list[dict]:
    """Multi-turn RL rows of one task: two episodes, tool results masked; the good one scored 1, the bad -1."""
    prompt = tok.encode("Write a kernel for relu.")
    tool = tok.encode("<tool_response>ok</tool_response>")
    rows = []
    for ep, text, reward in (("e-good", "torch.relu(x) is fused here.", 1.0),
                             ("e-bad", "I refuse to write kernels today.", -1.0)):
        turn = tok.encode(text)
        response = turn + tool + turn
        mask = [1] * len(turn) + [0] * len(tool) + [1] * len(turn)
        rows.append({"prompt_ids": prompt, "response_ids": response, "response_mask": mask,
                     "response_logprobs": [0.0] * len(response), "reward": reward, "task_id": "relu",
                     "episode_id": ep})
    return rows


def _learner(tiny, **kw):
    from training.models import load_tokenizer
    from training.ppo.learner import PPOLearner

    tok = load_tokenizer(str(tiny))
    cfg = PPOConfig(model=str(tiny), device="cpu", **{"actor_lr": 3e-3, "tis_cap": None, **kw})
    torch.manual_seed(0)
    return PPOLearner(cfg, pad_id=tok.pad_token_id), tok


def test_a_grpo_learner_has_no_critic_and_its_update_follows_the_group(tiny, tmp_path, caplog):
    from training.ppo.samples import collate

    with caplog.at_level(logging.WARNING, logger="training.ppo.learner"):
        learner, tok = _learner(tiny, advantage_estimator="grpo", critic_warmup=3, critic_lr=1e-3)
    assert learner.critic is None and learner.critic_opt is None
    assert "ignoring critic_lr=0.001, critic_warmup=3" in caplog.text
    # no value head anywhere: the actor is the only model, and its optimizer holds only the actor's parameters
    names = [n for n, _ in learner.actor.named_parameters()]
    assert not any(n.startswith("score") for n in names)
    assert sum(len(g["params"]) for g in learner.actor_opt.param_groups) == len(names)

    items = learner.prepare([from_rl_row(r) for r in _rows(tok)])
    good, bad = items
    a = 1 / (2 ** 0.5 + EPS)  # scores 1 and -1: mean 0, unbiased std sqrt(2)
    for it, sign in ((good, 1), (bad, -1)):
        m = it["mask"].bool()
        assert torch.allclose(it["advantages"][m], torch.full((int(m.sum()),), sign * a))
        assert (it["advantages"][~m] == 0).all()  # prompt and tool tokens
        assert "values" not in it
    stats = learner.batch_stats(items)
    assert stats["advantage_estimator"] == "grpo" and stats["advantage/zero_samples"] == 0.0
    assert not any(k.startswith("value/") for k in stats)

    def logps():
        with torch.no_grad():
            mb = collate(items, learner.pad_id)
            return learner.actor_forward(learner.actor, mb)[0], mb["mask"]

    before, mask = logps()
    # critic_warmup is ignored: step 1 trains the actor
    metrics = learner.train_step(items, step=1)
    after, _ = logps()
    delta = (after - before) * mask
    assert metrics["actor/frozen"] == 0.0 and "actor/pg_loss" in metrics
    assert not any(k.startswith("critic/") for k in metrics)
    assert float(delta[0].sum()) > 0 and float(delta[1].sum()) < 0
    with pytest.raises(ValueError, match="no critic"):
        learner.fit_values(items)
    learner.save(tmp_path / "ckpt", str(tiny))
    assert (tmp_path / "ckpt" / "actor" / "config.json").is_file() and not (tmp_path / "ckpt" / "critic").exists()
    learner.load_optimizers(tmp_path / "ckpt")


def test_a_group_whose_samples_scored_alike_gives_no_update(tiny):
    learner, tok = _learner(tiny, advantage_estimator="grpo")
    rows = _rows(tok)
    rows[1]["reward"] = rows[0]["reward"]
    items = learner.prepare([from_rl_row(r) for r in rows])
    assert all((it["advantages"] == 0).all() for it in items)
    assert learner.batch_stats(items)["advantage/zero_samples"] == 1.0
    before = [p.detach().clone() for p in learner.actor.parameters()]
    learner.update(items)  # no entropy or KL term: a zero advantage is a zero gradient
    assert all(torch.equal(a, b) for a, b in zip(before, learner.actor.parameters(), strict=True))


def test_gae_stays_the_default_and_reports_its_name(tiny):
    learner, tok = _learner(tiny)
    assert learner.cfg.advantage_estimator == "gae" and learner.critic is not None
    stats = learner.batch_stats(learner.prepare([from_rl_row(r) for r in _rows(tok)]))
    assert stats["advantage_estimator"] == "gae" and "value/explained_variance" in stats


# ---- through the CLI ------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parent.parent
TASK = str(REPO / "tests" / "fixtures" / "cpu_multi" / "small_task.py")


def test_set_advantage_estimator_is_parsed_and_checked():
    import typer

    from training.ppo.cli import ppo_config

    cfg = ppo_config("m", None, ["advantage_estimator=grpo", "norm_adv_by_std_in_grpo=false", "grpo_epsilon=1e-4"])
    assert (cfg.advantage_estimator, cfg.norm_adv_by_std_in_grpo, cfg.grpo_epsilon) == ("grpo", False, 1e-4)
    assert ppo_config("m", None, None).advantage_estimator == "gae"
    with pytest.raises(typer.Exit):
        ppo_config("m", None, ["advantage_estimator=reinforce"])


def _cli(args: list[str]):
    pytest.importorskip("openai", reason="the harness extra is not installed")
    from typer.testing import CliRunner

    from cuda_agent.cli import app

    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_the_cli_refuses_an_unknown_estimator_grpo_with_one_sample_and_critic_pretraining_under_grpo(tmp_path):
    base = ["--model", "m", "--out", str(tmp_path / "o")]
    r = _cli(["train", "warmup", "--tasks", TASK, *base, "--set", "advantage_estimator=reinforce"])
    assert r.exit_code == 2 and "unknown advantage_estimator 'reinforce'" in r.output and "gae, grpo" in r.output
    r = _cli(["train", "warmup", "--tasks", TASK, *base, "--samples", "1", "--set", "advantage_estimator=grpo"])
    assert r.exit_code == 2 and "--samples must be at least 2" in r.output
    r = _cli(["train", "critic", "--data", str(tmp_path), *base, "--set", "advantage_estimator=grpo"])
    assert r.exit_code == 2 and "uses no critic" in r.output
    assert not (tmp_path / "o").exists()


def test_train_warmup_with_grpo_steps_without_a_critic_and_resumes(tiny, tmp_path, monkeypatch):
    import skills

    # SKILL.md is ~11k tokens for this tokenizer; CPU attention over it would dominate the test
    monkeypatch.setattr(skills, "skill_text", lambda: "You write CUDA kernels for PyTorch models.")
    out = tmp_path / "warmup"
    args = ["train", "warmup", "--tasks", TASK, "--model", str(tiny), "--out", str(out), "--samples", "2",
            "--prompts-per-step", "1", "--max-new-tokens", "8", "--backend", "cpu", "--device", "cpu",
            "--save-every", "1", "--no-tensorboard", "--set", "advantage_estimator=grpo"]
    for steps in ("1", "2"):  # the second run resumes from the first one's checkpoint
        r = _cli([*args, "--steps", steps])
        assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["advantage_estimator"] == "grpo" and "actor/pg_loss" in r and r["episodes"] == 2
        assert not any(k.startswith(("critic/", "value/")) for k in r)
    assert json.loads((out / "config.json").read_text())["ppo"]["advantage_estimator"] == "grpo"
    ckpt = out / "checkpoints" / "step-000002"
    assert (ckpt / "actor" / "config.json").is_file() and not (ckpt / "critic").exists()
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow  # a PPO step with episodes over MCP and the judge (about half a minute on 2 cores)
def test_train_ppo_with_grpo_runs_multi_turn_episodes_without_a_critic(tiny, tmp_path, monkeypatch, caplog):
    pytest.importorskip("mcp", reason="the mcp extra is not installed")
    import harness.episode
    from harness.prompts import PREAMBLE

    monkeypatch.setattr(harness.episode, "system_prompt", lambda: PREAMBLE)  # as tests/test_ppo_stages.py
    out = tmp_path / "ppo"
    r = _cli(["train", "ppo", "--tasks", TASK, "--model", str(tiny), "--out", str(out), "--samples", "2",
              "--concurrency", "2", "--backend", "cpu", "--max-turns", "2", "--context-tokens", "8192",
              "--max-response-tokens", "8", "--verify-trials", "1", "--device", "cpu", "--steps", "1",
              "--no-tensorboard", "--set", "advantage_estimator=grpo", "--critic-model", str(tiny)])
    assert r.exit_code == 0, r.output
    assert "ignoring critic_model=" in caplog.text  # the critic given is named as unused
    (row,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["advantage_estimator"] == "grpo" and row["episodes"] == 2 and row["samples"] >= 2
    assert "actor/pg_loss" in row and not any(k.startswith(("critic/", "value/")) for k in row)
    # every episode failed alike: one group with no spread, so no sample carries an advantage
    assert row["reward/std"] == 0.0 and row["advantage/zero_samples"] == 1.0
    ckpt = out / "checkpoints" / "step-000001"
    assert (ckpt / "actor" / "config.json").is_file() and not (ckpt / "critic").exists()
