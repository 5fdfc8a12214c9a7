"""Actor, critic and reference: how the learner loads, saves and exports its models.

The critic is transformers' token-classification model with one label over the actor's
architecture (`AutoModelForTokenClassification(num_labels=1)`): one value per token, initialized
from the actor's checkpoint (the backbone loads, the `score` head starts at zero), saved and loaded
with save_pretrained/from_pretrained like any model and LoRA-able with peft's TOKEN_CLS task,
without a hand-written value-head class to maintain across architectures.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from training.models import load_tokenizer, pick_device, pick_dtype
from training.ppo.config import PPOConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_wrap(model: Any, cfg: PPOConfig, task_type: str) -> Any:
    from peft import LoraConfig, get_peft_model

    extra = {"modules_to_save": ["score"]} if task_type == "TOKEN_CLS" else {}
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=LORA_TARGETS,
                                            task_type=task_type, **extra))


def _is_adapter(path: str) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_actor(path: str, cfg: PPOConfig, trainable: bool = True) -> Any:
    from transformers import AutoModelForCausalLM

    device = pick_device(cfg.device)
    if _is_adapter(path):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, is_trainable=trainable,
                                                         dtype=pick_dtype(cfg.dtype, device))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(cfg.dtype, device))
        if trainable and cfg.lora_r > 0:
            model = _peft_wrap(model, cfg, "CAUSAL_LM")
    return _finish(model, cfg, device, trainable)


def load_critic(path: str, cfg: PPOConfig) -> Any:
    from transformers import AutoConfig, AutoModelForTokenClassification

    device = pick_device(cfg.device)
    if _is_adapter(path):
        from peft import AutoPeftModelForTokenClassification

        model = AutoPeftModelForTokenClassification.from_pretrained(path, is_trainable=True, num_labels=1,
                                                                    dtype=pick_dtype(cfg.dtype, device))
    else:
        # no dropout on the value head (transformers' default is 0.1): it would make values noisy targets
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model, info = AutoModelForTokenClassification.from_pretrained(path, config=config, output_loading_info=True,
                                                                      dtype=pick_dtype(cfg.dtype, device))
        if any(k.startswith("score.") for k in info["missing_keys"]):
            _zero_head(model.score)
        if cfg.lora_r > 0:
            model = _peft_wrap(model, cfg, "TOKEN_CLS")
    return _finish(model, cfg, device, True)


def _zero_head(head: Any) -> None:
    """A fresh value head predicts 0 for every token. A randomly initialized one predicts a different
    value per position, and since every response shares most of its tokens' positions with the
    others (the same boilerplate), R - V(t) then pushes those shared tokens up or down by the noise
    of V(t) alone, in every sample alike: the first updates degrade text that all rewards agree on.
    With V = 0 the first advantages are the returns, whitened over the batch."""
    import torch

    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


def value_heads(model: Any) -> list[Any]:
    """The critic's `score` layer(s): the plain one, or peft's trained copy and its original."""
    return [m for name, m in model.named_modules() if name.split(".")[-1] == "score" and hasattr(m, "weight")]


def randomize_fresh_head(model: Any) -> bool:
    """Critic pretraining starts a fresh (all-zero) value head from small random weights, the model's own
    initializer_range (transformers' init). With the actor frozen no advantage is taken from it, so the
    reason for the zero start (see _zero_head) does not apply, and the zero start is a saddle: with w = 0 no
    gradient reaches the backbone, and features that do not yet tell outcomes apart give w little to learn
    from. On a task-by-choice value (tests/test_ppo_critic_ev.py) the zero head sat at explained variance 0
    for 100-200 optimizer steps, a random one left the plateau in half that. Returns whether it changed."""
    import torch

    heads = value_heads(model)
    if not heads or any(bool(h.weight.detach().abs().sum() > 0) for h in heads):
        return False
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        for h in heads:
            h.weight.normal_(0.0, std)
    return True


def _finish(model: Any, cfg: PPOConfig, device: str, trainable: bool) -> Any:
    model.to(device)
    model.config.use_cache = False
    if trainable and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    else:
        model.train()
    return model


def merged_state_dict(model: Any) -> dict[str, Any]:
    """Plain weights for the engine (LoRA adapters merged into a copy; the learner keeps its adapters)."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload().state_dict()
    return model.state_dict()


def save_model(model: Any, path: Path, tokenizer_from: str | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer_from:
        load_tokenizer(tokenizer_from).save_pretrained(path)
