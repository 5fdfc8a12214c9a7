"""PPOConfig: every knob of the learner and of the stages that drive it, in one dataclass (trl style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class PPOConfig:
    # models
    model: str = ""  # actor initialization (a folder or hub id): usually the RFT stage's final/
    critic_model: str | None = None  # None: a value head on a copy of the actor's backbone
    dtype: str = "fp32"  # weights' dtype; keep fp32 master weights and use bf16 autocast
    bf16: bool = False  # autocast forward passes to bfloat16
    device: str | None = None  # None: cuda if visible
    gradient_checkpointing: bool = False
    lora_r: int = 0  # > 0: LoRA adapters on actor and critic; the reference is the actor without them
    lora_alpha: int = 32
    # advantage estimation: a name in training.ppo.advantages (gae: token-level GAE with a critic, the paper's;
    # grpo: each task's samples normalized within their group, no critic created, loaded or trained, so
    # critic_model, critic_lr, critic_warmup, the value loss and whiten_advantages do not apply; trloo: per turn,
    # the turn's return less the mean return of the same turn in the task's other episodes, no critic either)
    advantage_estimator: str = "gae"
    grpo_epsilon: float = 1e-6  # grpo: (r - mean) / (std + eps), verl's epsilon
    norm_adv_by_std_in_grpo: bool = True  # grpo: False subtracts the group mean only (Dr. GRPO), as verl's option
    gamma: float = 1.0
    lam: float = 0.95  # the actor's advantages
    # the critic's targets (None: lam). Decoupled GAE (VC-PPO, Yuan et al. 2025): with critic_lam = 1 the
    # value targets are Monte-Carlo returns, unbiased by the critic's own errors, while the actor's lam < 1
    # puts each token's credit on the value changes it caused, not on the whole response's outcome
    critic_lam: float | None = None
    whiten_advantages: bool = True
    # policy loss
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: symmetric
    dual_clip: float | None = 3.0  # bound on the loss of negative-advantage tokens (None: off)
    entropy_coef: float = 0.0
    # KL to the frozen reference
    kl_coef: float = 0.0  # 0: no reference model is loaded
    kl_estimator: str = "k3"  # k1 (log ratio) or k3 (unbiased, non-negative)
    kl_in_reward: bool = False  # False: a loss term; True: a per-token penalty in the rewards
    # behaviour (engine) vs learner logprobs
    tis_cap: float | None = 2.0  # truncated importance weight cap (None: no correction)
    # the sampling temperature: every logprob and entropy the learner computes is of softmax(logits / T),
    # the distribution the behaviour policy actually sampled from (as verl's actor does); the stages set it
    temperature: float = 1.0
    # value loss
    value_clip: float | None = 0.2
    value_coef: float = 0.5
    # optimization
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch over the batch
    micro_batch_size: int = 1  # sequences per forward/backward (gradient accumulation fills a minibatch)
    max_length: int = 32768  # tokens per sequence (longer ones are cut from the end, rewards kept)
    seed: int = 0
    # the stages' first critic_warmup steps train the critic alone on the initial policy's samples (verl's
    # trainer.critic_warmup): the actor starts learning only once the values can tell a good token from a bad one
    critic_warmup: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PPOConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

