"""The transformers backend: the library's own `generate`, one request at a time on one model.

Logprobs are of each generated token under the model's raw distribution (log-softmax of the
logits `generate` returns with output_logits, before temperature or top-p), the same numbers a
forward pass of the model gives, which is what a learner compares against. Requests are served
one at a time under a lock that weight updates also take, so no response mixes two versions.
Continuous batching is vLLM's job; this backend is for CPU CI and machines without vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.engine.chat import Generation, RequestError, Sampling
from training.models import ModelSpec, load_model

# test-only: given the prompt's token ids, the completion to force (token ids) or None to sample freely
ForceFn = Callable[[list[int]], list[int] | None]


class TransformersBackend:
    def __init__(self, model: str, *, device: str | None = None, dtype: str = "auto", name: str | None = None,
                 max_context: int | None = None, force: ForceFn | None = None):
        self.model, self.tokenizer = load_model(ModelSpec(model, dtype=dtype, device=device))
        self.model_name = name or Path(model).name
        self.version = 0
        cfg_max = getattr(self.model.config, "max_position_embeddings", None) or 32768
        self.max_context = min(max_context or cfg_max, cfg_max)
        self.force = force
        self.lock = threading.Lock()
        self.stop_ids = {i for i in [self.tokenizer.eos_token_id] if i is not None}

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        import torch

        forced = self.force(prompt_ids) if self.force else None
        kwargs: dict[str, Any] = {}
        if forced is not None:
            n_prompt = len(prompt_ids)
            end = sorted(self.stop_ids)

            def allowed(_batch: int, ids: Any) -> list[int]:
                step = ids.shape[-1] - n_prompt
                return [forced[step]] if step < len(forced) else end

            kwargs["prefix_allowed_tokens_fn"] = allowed
        do_sample = sampling.temperature > 0 and forced is None
        if do_sample:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or 0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self.lock, torch.inference_mode():
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            inputs = torch.tensor([prompt_ids], device=self.device)
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                      max_new_tokens=sampling.max_tokens, eos_token_id=sorted(self.stop_ids),
                                      pad_token_id=self.tokenizer.pad_token_id, output_logits=True,
                                      return_dict_in_generate=True, **kwargs)
        new = out.sequences[0, len(prompt_ids):].tolist()
        logits = torch.stack(out.logits, dim=1)[0, : len(new)].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(new, device=logits.device)[:, None])
        finish = "stop" if new and new[-1] in self.stop_ids else "length"
        return Generation(token_ids=new, logprobs=logprobs[:, 0].tolist(), finish_reason=finish)

    def load_weights(self, path: str, version: int | None = None) -> int:
        """Loads a checkpoint folder (save_pretrained: *.safetensors) or one .safetensors/.pt file into the
        served model in place, and returns the new version."""
        return self.update_state_dict(read_state_dict(Path(path)), version)

    def update_state_dict(self, state: dict[str, Any], version: int | None = None) -> int:
        """In-process weight sync (a colocated learner passes its state dict)."""
        with self.lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = set(getattr(self.model, "_tied_weights_keys", None) or [])  # a list or a dict by version
            real_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
            if unexpected or real_missing:
                raise RequestError(f"the weights do not fit the served model: missing {real_missing[:5]}, "
                                   f"unexpected {list(unexpected)[:5]}")
            self.version = version if version is not None else self.version + 1
            return self.version


def read_state_dict(path: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    if not path.exists():
        raise RequestError(f"no such checkpoint: {path}")
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise RequestError(f"no *.safetensors in {path}")
        state: dict[str, Any] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)
