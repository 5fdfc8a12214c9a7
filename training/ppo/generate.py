"""Batched sampling from the actor itself, with the logprob of every sampled token under the distribution
it was sampled from: log-softmax of logits / temperature (the learner's PPOConfig.temperature must be
the same). Top-p is not part of it: with top_p < 1 the recorded logprobs are those of the tempered
distribution before the nucleus cut, as in verl. Greedy decoding (temperature 0) records the raw ones.
Single-turn warm-up samples here: one batched `generate` over a step's prompts is much faster than
the engine's one-request-at-a-time transformers backend, and no weight sync is needed."""

from __future__ import annotations

from typing import Any


def sample(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, batch_size: int = 8) -> list[tuple[list[int], list[float], str]]:
    """(completion ids ending with the end-of-turn token when it came, logprobs, finish reason) per prompt."""
    import torch

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    was_training = model.training
    model.eval()
    out: list[tuple[list[int], list[float], str]] = []
    kwargs: dict[str, Any] = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                              if temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None,
                                                       "top_k": None})
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i: i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for j, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
                ids[j, width - len(p):] = torch.tensor(p)
                attn[j, width - len(p):] = 1
            with torch.inference_mode():
                gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                     output_logits=True, return_dict_in_generate=True, use_cache=True, **kwargs)
            new = gen.sequences[:, width:]
            logits = torch.stack(gen.logits, dim=1).float()  # raw logits, before any logits processor
            logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            picked = logp.gather(-1, new[:, : logp.shape[1], None])[..., 0].cpu()
            new = new.cpu()
            for j in range(len(chunk)):
                toks = new[j].tolist()
                end = toks.index(eos) + 1 if eos in toks else len(toks)
                finish = "stop" if eos in toks[:end] else "length"
                out.append((toks[:end], picked[j, :end].tolist(), finish))
    finally:
        model.train(was_training)
    return out
