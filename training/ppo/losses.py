"""The PPO arithmetic on padded [batch, tokens] tensors, with `mask` = 1 on the model's own tokens.

Position t of every tensor is the t-th *target* token of a sequence (the token predicted from the
prefix before it). Tool results, prompts and template glue have mask 0: they are not actions, so
they take no part in the losses, and GAE steps over them (see `gae`).
"""

from __future__ import annotations

from typing import Any

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance over the unmasked entries; masked entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the action tokens of each row, in order.

    Masked positions (tool results, prompts) are not time steps: the value after the last token of
    one assistant turn is the value at the first token of the next turn, so the episode's return
    reaches every turn, discounted only per model token. Rewards on masked positions are ignored
    (put them on a model token). The step after a row's last action token is terminal (value 0).
    Returns (advantages, returns), both zero where mask is 0.
    """
    adv = torch.zeros_like(values)
    batch, length = values.shape
    for b in range(batch):
        idx = torch.nonzero(mask[b], as_tuple=False).flatten()
        if idx.numel() == 0:
            continue
        r, v = rewards[b, idx].float(), values[b, idx].float()
        nxt = torch.cat([v[1:], v.new_zeros(1)])
        deltas = r + gamma * nxt - v
        a = torch.zeros_like(v)
        running = v.new_zeros(())
        for t in range(idx.numel() - 1, -1, -1):
            running = deltas[t] + gamma * lam * running
            a[t] = running
        adv[b, idx] = a.to(adv.dtype)
    returns = (adv + values) * mask.to(values.dtype)
    return adv, returns


def place_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards: each row's score on its last model token, 0 elsewhere."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0, as_tuple=False).flatten()
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


K3_MAX = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimates from samples of pi: k1 = log ratio, k3 = (r - 1) - log r with
    r = ref/pi (non-negative, unbiased; Schulman's note on KL approximations), here capped at K3_MAX per token."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        # bounded per token, as verl's low_var_kl is: a token the update pushed down by many nats gives
        # exp(gap) (e^8 ~ 3000 for one token), the likely reason a CPU run's actor/kl read ~6 per token
        # while the KL to the old policy read 0.009
        log_ratio = log_ratio.clamp(-20, 20)
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r} (k1 or k3)")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float, clip_high: float, dual_clip: float | None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped surrogate (PPO) with the dual clip of Ye et al. 2020 for negative advantages. Summed over
    tokens; the caller divides by the token count of the whole minibatch. `is_weights` (detached)
    correct for the behaviour policy having been the engine, not the learner."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if dual_clip is not None:
        bound = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    if is_weights is not None:
        loss = loss * is_weights
    m = mask.to(loss.dtype)
    return (loss * m).sum(), {"clip_frac_sum": float((clipped * m).sum()),
                              "ratio_sum": float((ratio.detach() * m).sum())}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """0.5 * squared error, with PPO's value clipping around the rollout-time values. Summed over tokens."""
    err = (values - returns) ** 2
    clipped_frac = torch.zeros((), device=values.device)
    if clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        clipped_frac = ((err_clipped > err).float() * mask).sum()
        err = torch.maximum(err, err_clipped)
    return 0.5 * (err * mask.to(err.dtype)).sum(), {"vf_clip_sum": float(clipped_frac)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the unmasked entries (1: perfect, 0: no better than
    the mean, negative: worse)."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    # constant returns (every episode failed) leave nothing to explain
    return float(1 - var_d / var_r) if float(var_r) > 1e-8 else float("nan")
