"""TRLOO (turn-level leave-one-out baselines) beside gae and grpo: its advantages against a hand computation on a
toy batch, a learner without a critic, and `train ppo --set advantage_estimator=trloo` through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the train extra is not installed")

from training.ppo.advantages import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    turn_loo_advantages,
    turn_spans,
    uses_critic,
)
from training.ppo.config import PPOConfig  # noqa: E402
from training.ppo.samples import from_rl_row  # noqa: E402


def _toy() -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """Task a: e1 two turns, reward 1; e2 one turn, reward -1; e3 three turns, reward 2, its context rewritten
    after turn 2 so it comes as two rows. Task b: one episode alone. Rewards sit on each episode's last model
    token; a 9 on a tool token (mask 0) is no action's reward."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 0],     # e1: turns [0, 2) and [4, 5)
                         [0, 1, 1, 1, 0, 0],     # e2: turn [1, 4)
                         [1, 0, 1, 1, 0, 0],     # e3 row 1: turns 1 and 2
                         [0, 0, 1, 1, 1, 0],     # e3 row 2: turn 3
                         [1, 1, 0, 1, 0, 0]],    # b: two turns
                        dtype=torch.float32)
    rewards = torch.zeros(5, 6)
    rewards[0, 4], rewards[1, 3], rewards[3, 4], rewards[4, 3] = 1.0, -1.0, 2.0, 5.0
    rewards[1, 5] = 9.0
    return rewards, mask, ["a", "a", "a", "a", "b"], ["e1", "e2", "e3", "e3", "b1"]


def test_turn_spans_are_the_runs_of_model_tokens():
    assert turn_spans(torch.tensor([1, 1, 0, 0, 1, 0])) == [(0, 2), (4, 5)]
    assert turn_spans(torch.tensor([0, 0, 1, 1])) == [(2, 4)]
    assert turn_spans(torch.tensor([0, 0, 0])) == []


def test_trloo_advantages_by_hand():
    rewards, mask, groups, episodes = _toy()
    adv = turn_loo_advantages(rewards, mask, groups, episodes, gamma=1.0)
    # returns per turn (gamma 1): e1 [1, 1], e2 [-1], e3 [2, 2, 2]
    # turn 1: e1 1 - (-1 + 2)/2 = 0.5, e2 -1 - (1 + 2)/2 = -2.5, e3 2 - (1 - 1)/2 = 2
    # turn 2 (e1 and e3 reached it): e1 1 - 2 = -1, e3 2 - 1 = 1; turn 3 (e3 alone): no baseline, 0
    # task b: one episode, no baseline
    expected = torch.tensor([[0.5, 0.5, 0, 0, -1, 0],
                             [0, -2.5, -2.5, -2.5, 0, 0],
                             [2, 0, 1, 1, 0, 0],
                             [0, 0, 0, 0, 0, 0],
                             [0, 0, 0, 0, 0, 0]])
    assert torch.allclose(adv, expected)
    # gamma 0.5 per turn: e1 [0.5, 1], e2 [-1], e3 [0.5, 1, 2]
    # turn 1: e1 0.5 - (-1 + 0.5)/2 = 0.75, e2 -1 - (0.5 + 0.5)/2 = -1.5, e3 0.5 - (0.5 - 1)/2 = 0.75
    # turn 2: e1 1 - 1 = 0, e3 1 - 1 = 0
    half = turn_loo_advantages(rewards, mask, groups, episodes, gamma=0.5)
    assert half[0].tolist() == pytest.approx([0.75, 0.75, 0, 0, 0, 0])
    assert half[1].tolist() == pytest.approx([0, -1.5, -1.5, -1.5, 0, 0])
    assert half[2].tolist() == pytest.approx([0.75, 0, 0, 0, 0, 0])
    # rows in another order: the same advantages per row (an episode's own rows keep their order)
    perm = [4, 1, 0, 2, 3]
    again = turn_loo_advantages(rewards[perm], mask[perm], [groups[i] for i in perm], [episodes[i] for i in perm])
    assert torch.allclose(again, expected[perm])


def test_the_leave_one_out_baseline_is_grpos_mean_difference_without_its_shrink():
    # one turn per episode, N = 4: the mean over the others is N/(N-1) times Dr. GRPO's mean difference, which
    # holds each sample's own return in its baseline and so shrinks every advantage by (N-1)/N
    scores = [3.0, 1.0, -1.0, 0.0]
    mask = torch.ones(4, 1)
    rewards = torch.tensor(scores)[:, None]
    loo = turn_loo_advantages(rewards, mask, ["t"] * 4, ["a", "b", "c", "d"])[:, 0]
    mean = sum(scores) / 4
    assert loo.tolist() == pytest.approx([4 / 3 * (s - mean) for s in scores])
    assert loo.tolist() == pytest.approx([3 - 0, 1 - 2 / 3, -1 - 4 / 3, 0 - 1])


def test_trloo_is_registered_without_a_critic_and_returns_its_advantages_as_returns():
    assert {"gae", "grpo", "trloo"} <= set(ADVANTAGE_ESTIMATORS) and not uses_critic("trloo")
    rewards, mask, groups, episodes = _toy()
    adv, ret = get_advantage_estimator("trloo")(rewards, None, mask, groups, episodes, PPOConfig(gamma=1.0))
    assert torch.equal(adv, ret) and torch.allclose(adv, turn_loo_advantages(rewards, mask, groups, episodes))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from training.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2, hidden=64, vocab=512)


def test_a_trloo_learner_has_no_critic_and_credits_each_turn_against_the_same_turn_of_the_others(tiny):
    from training.models import load_tokenizer
    from training.ppo.learner import PPOLearner

    tok = load_tokenizer(str(tiny))
    cfg = PPOConfig(model=str(tiny), device="cpu", advantage_estimator="trloo", actor_lr=3e-3, tis_cap=None)
    learner = PPOLearner(cfg, pad_id=tok.pad_token_id)
    assert learner.critic is None
    prompt, tool = tok.encode("Write a kernel for relu."), tok.encode("<tool_response>FAILED</tool_response>")
    a, b = tok.encode("torch.relu(x) fused."), tok.encode("Done.")
    rows = []
    # a repair (two turns, 1), a give-up (two turns, -1), a first-try success (one turn, 1)
    for ep, turns, reward in (("fix", [a, a], 1.0), ("quit", [a, b], -1.0), ("first", [a], 1.0)):
        response, mask = list(turns[0]), [1] * len(turns[0])
        for t in turns[1:]:
            response += tool + t
            mask += [0] * len(tool) + [1] * len(t)
        rows.append({"prompt_ids": prompt, "response_ids": response, "response_mask": mask,
                     "response_logprobs": [0.0] * len(response), "reward": reward, "task_id": "relu",
                     "episode_id": ep})
    items = learner.prepare([from_rl_row(r) for r in rows])
    firsts, seconds = [], []
    for it in items:
        spans = turn_spans(it["mask"])
        firsts.append(float(it["advantages"][spans[0][0]]))
        seconds.append(float(it["advantages"][spans[1][0]]) if len(spans) > 1 else None)
        assert (it["advantages"][it["mask"] == 0] == 0).all()
        for s, e in spans:  # one value per turn
            assert (it["advantages"][s:e] == it["advantages"][s]).all()
    # turn 1: 1 - (-1 + 1)/2 = 1, -1 - (1 + 1)/2 = -2, 1 - (1 - 1)/2 = 1; turn 2: the repair against the give-up
    assert firsts == pytest.approx([1.0, -2.0, 1.0]) and seconds[:2] == pytest.approx([2.0, -2.0])
    assert seconds[2] is None
    assert learner.batch_stats(items)["advantage_estimator"] == "trloo"
    metrics = learner.train_step(items, step=1)
    assert "actor/pg_loss" in metrics and not any(k.startswith("critic/") for k in metrics)


REPO = Path(__file__).resolve().parent.parent
TASK = str(REPO / "tests" / "fixtures" / "cpu_multi" / "small_task.py")


@pytest.mark.full  # a PPO step over MCP and the judge, as test_ppo_grpo.py's; TRLOO's advantages: the tests above
@pytest.mark.slow  # a PPO step with episodes over MCP and the judge (about half a minute on 2 cores)
def test_train_ppo_with_trloo_runs_multi_turn_episodes_without_a_critic(tiny, tmp_path, monkeypatch):
    pytest.importorskip("mcp", reason="the mcp extra is not installed")
    pytest.importorskip("openai", reason="the harness extra is not installed")
    from typer.testing import CliRunner

    import harness.episode
    from cuda_agent.cli import app
    from harness.prompts import PREAMBLE

    monkeypatch.setattr(harness.episode, "system_prompt", lambda: PREAMBLE)  # as tests/test_ppo_stages.py
    out = tmp_path / "ppo"
    r = CliRunner().invoke(app, ["train", "ppo", "--tasks", TASK, "--model", str(tiny), "--out", str(out),
                                 "--samples", "2", "--concurrency", "2", "--backend", "cpu", "--max-turns", "2",
                                 "--context-tokens", "8192", "--max-response-tokens", "8", "--verify-trials", "1",
                                 "--device", "cpu", "--steps", "1", "--no-tensorboard",
                                 "--set", "advantage_estimator=trloo"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (row,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["advantage_estimator"] == "trloo" and row["episodes"] == 2 and row["samples"] >= 2
    assert "actor/pg_loss" in row and not any(k.startswith(("critic/", "value/")) for k in row)
    assert json.loads((out / "config.json").read_text())["ppo"]["advantage_estimator"] == "trloo"
    assert (out / "final" / "config.json").is_file()
