"""The PPO learner: `prepare` turns samples into a batch with advantages (learner logprobs, reference
logprobs, values, the configured advantage estimator), `update` runs the clipped-surrogate and value
updates over it, `fit_values` trains the critic alone. Losses are token means over the model's tokens of
a whole minibatch, so gradient accumulation over micro-batches gives the same gradient as one big batch.
With an estimator that needs no critic (grpo) there is no critic: no value model, optimizer or loss."""

from __future__ import annotations

import contextlib
import logging
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from training.ppo import losses as L
from training.ppo.advantages import get_advantage_estimator, uses_critic
from training.ppo.config import PPOConfig
from training.ppo.models import load_actor, load_critic, merged_state_dict, save_model
from training.ppo.samples import Sample, collate

log = logging.getLogger(__name__)

class PPOLearner:
    def __init__(self, cfg: PPOConfig, actor_path: str | None = None, critic_path: str | None = None,
                 pad_id: int = 0, train_actor: bool = True):
        if not cfg.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the learner's policy is softmax(logits / T)), got {cfg.temperature}")
        self.cfg = cfg
        self.pad_id = pad_id
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        actor_path = actor_path or cfg.model
        self.actor = load_actor(actor_path, cfg, trainable=train_actor)
        self.critic = None
        if uses_critic(cfg.advantage_estimator):
            self.critic = load_critic(critic_path or cfg.critic_model or actor_path, cfg)
        else:
            _say_what_is_ignored(cfg)
        # with LoRA the reference is the actor with its adapters switched off: no second copy
        self.ref = None
        if cfg.kl_coef > 0 and cfg.lora_r == 0:
            self.ref = load_actor(cfg.model or actor_path, cfg, trainable=False)
        self.device = next(self.actor.parameters()).device
        self.actor_opt = torch.optim.AdamW([p for p in self.actor.parameters() if p.requires_grad],
                                           lr=cfg.actor_lr, weight_decay=cfg.weight_decay) if train_actor else None
        self.critic_opt = None
        if self.critic is not None:
            self.critic_opt = torch.optim.AdamW([p for p in self.critic.parameters() if p.requires_grad],
                                                lr=cfg.critic_lr, weight_decay=cfg.weight_decay)

    # ---- forward passes ---------------------------------------------------------------------
    def _autocast(self) -> Any:
        if not self.cfg.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _to(self, mb: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) for k, v in mb.items()}

    def actor_forward(self, model: Any, mb: dict[str, Any], entropy: bool = False) -> tuple[Any, Any]:
        with self._autocast():
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
        if self.cfg.temperature != 1.0:  # the policy is the tempered distribution the samples came from
            logits = logits.float() / self.cfg.temperature
        logp = L.token_logprobs(logits, mb["input_ids"][:, 1:])
        ent = L.entropy_from_logits(logits) if entropy else None
        return logp, ent

    def critic_forward(self, mb: dict[str, Any]) -> Any:
        with self._autocast():
            out = self.critic(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        # the value of the state before target token t+1 is read at position t
        return out[:, :-1, 0].float()

    def _ref_logp(self, mb: dict[str, Any]) -> Any:
        if self.ref is not None:
            return self.actor_forward(self.ref, mb)[0]
        with self.actor.disable_adapter():
            return self.actor_forward(self.actor, mb)[0]

    # ---- preparing a batch ------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, samples: list[Sample]) -> list[dict[str, Any]]:
        """Per-sample tensors (target-aligned) with old_logp, ref_logp, values (with a critic), rewards,
        advantages, returns and the importance weights against the behaviour policy. A sample's group for
        grpo is its meta's task_id (samples without one form one group), its episode the meta's episode_id."""
        cfg = self.cfg
        items = []
        for s in samples:
            s = s.truncated(cfg.max_length)
            ids = torch.tensor(s.input_ids, dtype=torch.long)
            items.append({"input_ids": ids, "mask": torch.tensor(s.action_mask[1:], dtype=torch.float32),
                          "behaviour_logp": torch.tensor(s.behaviour_logprobs[1:], dtype=torch.float32),
                          "score": torch.tensor(float(s.score))})
        models = [self.actor] + ([self.critic] if self.critic is not None else [])
        was_training = [m.training for m in models]
        for m in models:
            m.eval()
        use_kl = cfg.kl_coef > 0
        for i in range(0, len(items), cfg.micro_batch_size):
            chunk = items[i: i + cfg.micro_batch_size]
            mb = self._to(collate(chunk, self.pad_id))
            old = self.actor_forward(self.actor, mb)[0].cpu()
            values = self.critic_forward(mb).cpu() if self.critic is not None else None
            ref = self._ref_logp(mb).cpu() if use_kl else None
            for j, it in enumerate(chunk):
                n = it["mask"].numel()
                it["old_logp"] = old[j, :n]
                if values is not None:
                    it["values"] = values[j, :n] * it["mask"]
                if ref is not None:
                    it["ref_logp"] = ref[j, :n]
        for m, was in zip(models, was_training, strict=True):
            m.train(was)
        for it in items:
            m = it["mask"][None]
            rewards = L.place_rewards(it["score"][None], m)
            if use_kl and cfg.kl_in_reward:
                kl = L.kl_penalty(it["old_logp"][None], it["ref_logp"][None], cfg.kl_estimator)
                rewards = rewards - cfg.kl_coef * kl * m
            it["rewards"] = rewards[0]
            # truncated importance sampling: the engine sampled, the learner is the proximal policy
            ratio = torch.exp((it["old_logp"] - it["behaviour_logp"]).clamp(-20, 20))
            it["is_weights"] = ratio.clamp(max=cfg.tis_cap) if cfg.tis_cap else torch.ones_like(ratio)

        def padded(key: str) -> torch.Tensor:
            return torch.nn.utils.rnn.pad_sequence([it[key] for it in items], batch_first=True)

        groups = [s.meta.get("task_id") for s in samples]
        # a sample with no episode id is an episode of its own (single-turn samples are)
        episodes = [s.meta.get("episode_id") or f"#{i}" for i, s in enumerate(samples)]
        adv, ret = self.estimator(padded("rewards"), padded("values") if self.critic is not None else None,
                                  padded("mask"), groups, episodes, cfg)
        for i, it in enumerate(items):
            n = it["mask"].numel()
            it["advantages"], it["returns"] = adv[i, :n], ret[i, :n]
        return items

    def batch_stats(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Which advantage estimator ran and what it gave, logprob mismatch between learner and engine, and
        value quality (with a critic), over the model's tokens."""
        m = torch.cat([it["mask"] for it in items])
        old = torch.cat([it["old_logp"] for it in items])
        beh = torch.cat([it["behaviour_logp"] for it in items])
        adv = torch.cat([it["advantages"] for it in items])
        diff = old - beh
        out: dict[str, Any] = {
            "advantage_estimator": self.cfg.advantage_estimator,
            "advantage/mean": float(L.masked_mean(adv, m)),
            "advantage/abs_mean": float(L.masked_mean(adv.abs(), m)),
            # samples the update cannot move: under grpo, those of groups whose samples all scored alike
            "advantage/zero_samples": sum(bool((it["advantages"] == 0).all()) for it in items) / len(items),
            "mismatch/abs_logp_diff": float(L.masked_mean(diff.abs(), m)),
            "mismatch/max_abs_logp_diff": float((diff.abs() * m).max()) if m.any() else 0.0,
            "mismatch/kl_k3": float(L.masked_mean(L.kl_penalty(beh, old, "k3"), m)),
            "mismatch/is_weight_mean": float(L.masked_mean(torch.cat([it["is_weights"] for it in items]), m)),
            "tokens/model": float(m.sum())}
        if "values" in items[0]:
            values = torch.cat([it["values"] for it in items])
            returns = torch.cat([it["returns"] for it in items])
            out.update({"value/explained_variance": L.explained_variance(values, returns, m),
                        "value/mean": float(L.masked_mean(values, m)),
                        "return/mean": float(L.masked_mean(returns, m))})
        if "ref_logp" in items[0]:
            ref = torch.cat([it["ref_logp"] for it in items])
            out["kl/ref"] = float(L.masked_mean(L.kl_penalty(old, ref, "k3"), m))
        return out

    # ---- updates ----------------------------------------------------------------------------
    def _minibatches(self, items: list[dict[str, Any]], rng: random.Random) -> list[list[dict[str, Any]]]:
        order = list(range(len(items)))
        rng.shuffle(order)
        n = max(1, min(self.cfg.minibatches, len(items)))
        return [[items[i] for i in order[k::n]] for k in range(n)]

    def update(self, items: list[dict[str, Any]], train_actor: bool = True, train_critic: bool = True,
               step: int = 0) -> dict[str, float]:
        """PPO epochs over the prepared batch; returns the token-averaged losses and statistics."""
        cfg = self.cfg
        train_critic = train_critic and self.critic is not None
        rng = random.Random(cfg.seed * 100003 + step)
        sums: dict[str, float] = defaultdict(float)
        for _ in range(cfg.ppo_epochs):
            for mbatch in self._minibatches(items, rng):
                tokens = float(sum(float(it["mask"].sum()) for it in mbatch)) or 1.0
                if train_actor:
                    self.actor_opt.zero_grad(set_to_none=True)
                if train_critic:
                    self.critic_opt.zero_grad(set_to_none=True)
                for i in range(0, len(mbatch), cfg.micro_batch_size):
                    mb = self._to(collate(mbatch[i: i + cfg.micro_batch_size], self.pad_id))
                    if train_actor:
                        self._actor_backward(mb, tokens, sums)
                    if train_critic:
                        self._critic_backward(mb, tokens, sums)
                sums["tokens"] += tokens
                if train_actor:
                    sums["actor/grad_norm"] += float(torch.nn.utils.clip_grad_norm_(
                        self.actor.parameters(), cfg.max_grad_norm))
                    self.actor_opt.step()
                if train_critic:
                    sums["critic/grad_norm"] += float(torch.nn.utils.clip_grad_norm_(
                        self.critic.parameters(), cfg.max_grad_norm))
                    self.critic_opt.step()
                sums["optimizer_steps"] += 1
        steps = sums.pop("optimizer_steps") or 1
        tok = sums.pop("tokens") or 1.0
        out = {}
        for k, v in sums.items():
            out[k.replace("_sum", "")] = v / steps if "grad_norm" in k else v / tok
        return out

    def train_step(self, items: list[dict[str, Any]], step: int) -> dict[str, float]:
        """A stage's update for its step (1-based): the critic alone during the first cfg.critic_warmup
        steps, then PPO on both (without a critic, PPO on the actor from the first step)."""
        if self.critic is not None and step <= self.cfg.critic_warmup:
            return {**self.fit_values(items, step=step), "actor/frozen": 1.0}
        return {**self.update(items, step=step), "actor/frozen": 0.0}

    def _actor_backward(self, mb: dict[str, Any], tokens: float, sums: dict[str, float]) -> None:
        cfg = self.cfg
        logp, ent = self.actor_forward(self.actor, mb, entropy=True)
        mask = mb["mask"]
        loss, info = L.policy_loss(logp, mb["old_logp"], mb["advantages"], mask, cfg.clip_eps,
                                   cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps,
                                   cfg.dual_clip, mb["is_weights"] if cfg.tis_cap else None)
        ent_sum = (ent * mask).sum()
        total = loss - cfg.entropy_coef * ent_sum
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            kl_sum = (L.kl_penalty(logp, mb["ref_logp"], cfg.kl_estimator) * mask).sum()
            total = total + cfg.kl_coef * kl_sum
            sums["actor/kl_sum"] += float(kl_sum.detach())
        (total / tokens).backward()
        sums["actor/pg_loss_sum"] += float(loss.detach())
        sums["actor/entropy_sum"] += float(ent_sum.detach())
        sums["actor/clip_frac_sum"] += info["clip_frac_sum"]
        sums["actor/ratio_sum"] += info["ratio_sum"]
        sums["actor/approx_kl_old_sum"] += float((L.kl_penalty(mb["old_logp"], logp.detach(), "k3") * mask).sum())

    def _critic_backward(self, mb: dict[str, Any], tokens: float, sums: dict[str, float]) -> None:
        cfg = self.cfg
        values = self.critic_forward(mb)
        loss, info = L.value_loss(values, mb["values"], mb["returns"], mb["mask"], cfg.value_clip)
        (cfg.value_coef * loss / tokens).backward()
        sums["critic/value_loss_sum"] += float(loss.detach())
        sums["critic/vf_clip_frac_sum"] += info["vf_clip_sum"]

    def fit_values(self, items: list[dict[str, Any]], step: int = 0) -> dict[str, float]:
        """Critic pretraining: regress the returns with the actor frozen (no value clipping: the
        targets are fixed and there is no policy to stay close to)."""
        if self.critic is None:
            raise ValueError(f"advantage_estimator={self.cfg.advantage_estimator!r} uses no critic: "
                             "there are no values to fit")
        clip = self.cfg.value_clip
        self.cfg.value_clip = None
        try:
            return self.update(items, train_actor=False, train_critic=True, step=step)
        finally:
            self.cfg.value_clip = clip

    # ---- checkpoints and sync ---------------------------------------------------------------
    def engine_state_dict(self) -> dict[str, Any]:
        return merged_state_dict(self.actor)

    def save(self, path: Path, tokenizer_from: str | None = None) -> None:
        save_model(self.actor, path / "actor", tokenizer_from)
        if self.critic is not None:
            save_model(self.critic, path / "critic", tokenizer_from)
        torch.save({"actor": self.actor_opt.state_dict() if self.actor_opt else None,
                    "critic": self.critic_opt.state_dict() if self.critic_opt else None}, path / "optimizers.pt")

    def load_optimizers(self, path: Path) -> None:
        state = torch.load(path / "optimizers.pt", map_location="cpu", weights_only=False)
        if self.actor_opt is not None and state.get("actor"):
            self.actor_opt.load_state_dict(state["actor"])
        # a checkpoint of a run without a critic has none: a critic added on resume starts fresh
        if self.critic_opt is not None and state.get("critic"):
            self.critic_opt.load_state_dict(state["critic"])


def _say_what_is_ignored(cfg: PPOConfig) -> None:
    """One log line naming the critic settings a run without a critic was given and does not use."""
    default = PPOConfig()
    given = [f"{k}={getattr(cfg, k)!r}" for k in ("critic_model", "critic_lr", "critic_warmup", "critic_lam",
                                                     "value_coef", "value_clip")
             if getattr(cfg, k) != getattr(default, k)]
    if given:
        log.warning("advantage_estimator=%s trains and loads no critic: ignoring %s", cfg.advantage_estimator,
                    ", ".join(given))
