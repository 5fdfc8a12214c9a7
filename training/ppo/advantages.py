"""Advantage estimators, registered by name as in verl's core_algos: `PPOConfig.advantage_estimator` picks one.

Every estimator takes the batch as padded [batch, tokens] tensors (token rewards, values, the action
mask), each row's group (its task) and episode, and the config, and returns (advantages, returns), both
zero off the mask. An estimator registered with `uses_critic=False` gets `values=None`, and the learner
then creates no critic at all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from training.ppo import losses as L

Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
_USES_CRITIC: set[str] = set()


def register_advantage_estimator(name: str, uses_critic: bool) -> Callable[[Estimator], Estimator]:
    def decorator(fn: Estimator) -> Estimator:
        if ADVANTAGE_ESTIMATORS.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({ADVANTAGE_ESTIMATORS[name]})")
        ADVANTAGE_ESTIMATORS[name] = fn
        if uses_critic:
            _USES_CRITIC.add(name)
        return fn

    return decorator


def get_advantage_estimator(name: str) -> Estimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {name!r}: known ones are {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    return ADVANTAGE_ESTIMATORS[name]


def uses_critic(name: str) -> bool:
    get_advantage_estimator(name)
    return name in _USES_CRITIC


@register_advantage_estimator("gae", uses_critic=True)
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, groups: Sequence[Hashable],
                   episodes: Sequence[Hashable], cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE (losses.gae) with the actor's lam; the critic's targets with critic_lam when it is set
    (decoupled GAE); advantages whitened over the batch's model tokens when cfg.whiten_advantages."""
    adv, ret = L.gae(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.critic_lam is not None and cfg.critic_lam != cfg.lam:
        ret = L.gae(rewards, values, mask, cfg.gamma, cfg.critic_lam)[1]
    if cfg.whiten_advantages:
        adv = L.masked_whiten(adv, mask)
    return adv, ret


def group_normalized_scores(scores: torch.Tensor, groups: Sequence[Hashable], episodes: Sequence[Hashable],
                            eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO's outcome advantage per row: (score - mean of its group) / (std of its group + eps), with the
    std unbiased (torch.std) as in verl's compute_grpo_outcome_advantage; norm_by_std=False keeps only the
    mean's subtraction (Dr. GRPO, Liu et al. 2025).

    Rows of one (group, episode) pair are one member of the group: an episode whose context was rewritten
    comes as several rows (segments), and counting each would weigh long episodes more. The episode's
    score is the mean of its rows' scores (they are equal unless a KL penalty is in the rewards).

    A group of one episode gets 0, where verl gives the raw score (mean 0, std 1): one sample has no
    baseline to be better or worse than, and its raw reward would be the only unnormalized advantage in the
    batch, on the reward's scale (> 1 for every correct kernel here), pushing up whatever it happened to do.
    """
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(zip(groups, episodes, strict=True)):
        members[key].append(i)
    episode_score = {key: scores[rows].float().mean() for key, rows in members.items()}
    by_group: dict[Hashable, list[Hashable]] = defaultdict(list)
    for key in episode_score:
        by_group[key[0]].append(key)
    out = torch.zeros(scores.shape, dtype=torch.float32)
    for keys in by_group.values():
        if len(keys) < 2:
            continue
        s = torch.stack([episode_score[k] for k in keys])
        mean, std = s.mean(), s.std()
        for k, v in zip(keys, s, strict=True):
            out[members[k]] = (v - mean) / (std + eps) if norm_by_std else v - mean
    return out


@register_advantage_estimator("grpo", uses_critic=False)
def grpo_advantages(rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor,
                    groups: Sequence[Hashable], episodes: Sequence[Hashable], cfg: Any) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Group-normalized outcome rewards on every model token of the row; no critic. The row's score is the
    sum of its token rewards (the judge's reward, less the KL penalty when it is in the rewards). Not
    whitened again over the batch: that would move the zero advantage of a group whose samples all scored
    alike. The returns are the advantages, as in verl: there is no value model to fit them."""
    m = mask.to(torch.float32)
    scores = (rewards.float() * m).sum(-1)
    adv = group_normalized_scores(scores, groups, episodes, cfg.grpo_epsilon, cfg.norm_adv_by_std_in_grpo)
    adv = adv[:, None] * m
    return adv, adv


def turn_spans(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens in one row: one run per assistant turn, since tool results and
    the template's glue (mask 0) always sit between two turns."""
    spans, start = [], None
    for i, v in enumerate(mask_row.tolist()):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask_row)))
    return spans


def turn_loo_advantages(rewards: torch.Tensor, mask: torch.Tensor, groups: Sequence[Hashable],
                        episodes: Sequence[Hashable], gamma: float = 1.0) -> torch.Tensor:
    """TRLOO (Dr. Kernel, Liu et al. 2026): turn t of episode i gets G_{i,t} - mean_{j != i} G_{j,t}, over the
    other episodes j of its group that have a turn t; G_{i,t} = sum_{t' >= t} gamma^(t' - t) r_{i,t'} is the
    turn's return, r_{i,t'} the sum of the token rewards of turn t'. Every token of the turn carries it.

    Why leave-one-out: GRPO's baseline is the mean over the whole group, the episode's own return included,
    so the advantage is shrunk by (1 - 1/N) and, at turn t, by 1 - 1/N_t where N_t (the episodes still
    running) is small for late turns: the repair turns that only failing episodes reach get the most biased
    credit. Without the own return the baseline is independent of the action, so the estimate is unbiased.
    No division by a std (it would put the own return back into the scale).

    An episode whose context was rewritten comes as several rows: its turns are counted across its rows in
    the order they come. A turn that no other episode of the group reached has no baseline and gets 0, as a
    group of one does under grpo."""
    m = mask.to(torch.float32)
    r = rewards.float() * m
    # per episode: its turns in order, each as (row, start, end, reward of the turn)
    turns: dict[tuple[Hashable, Hashable], list[tuple[int, int, int, float]]] = defaultdict(list)
    for row, key in enumerate(zip(groups, episodes, strict=True)):
        for s, e in turn_spans(m[row]):
            turns[key].append((row, s, e, float(r[row, s:e].sum())))
    returns: dict[tuple[Hashable, Hashable], list[float]] = {}
    for key, ts in turns.items():
        g, out = 0.0, []
        for *_, rew in reversed(ts):
            g = rew + gamma * g
            out.append(g)
        returns[key] = out[::-1]
    by_group: dict[Hashable, list[tuple[Hashable, Hashable]]] = defaultdict(list)
    for key in turns:
        by_group[key[0]].append(key)
    adv = torch.zeros(rewards.shape, dtype=torch.float32)
    for keys in by_group.values():
        for key in keys:
            for t, (row, s, e, _) in enumerate(turns[key]):
                others = [returns[k][t] for k in keys if k != key and len(returns[k]) > t]
                if others:
                    adv[row, s:e] = returns[key][t] - sum(others) / len(others)
    return adv * m


@register_advantage_estimator("trloo", uses_critic=False)
def trloo_advantages(rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor,
                     groups: Sequence[Hashable], episodes: Sequence[Hashable], cfg: Any) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Turn-level leave-one-out baselines (turn_loo_advantages) with the config's gamma per turn; no critic,
    not whitened (as grpo: a batch-wide shift would move the zero of a group that scored alike)."""
    adv = turn_loo_advantages(rewards, mask, groups, episodes, cfg.gamma)
    return adv, adv
