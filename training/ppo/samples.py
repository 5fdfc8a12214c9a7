"""Training samples for the learner: one token sequence with its action mask, the behaviour policy's
logprobs (what the engine recorded) and the episode's score. Made from harness.export's RL rows
(multi-turn) or from one prompt and completion (single-turn); nothing here re-tokenizes text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    input_ids: list[int]
    action_mask: list[int]  # per token of input_ids: 1 = written by the model
    behaviour_logprobs: list[float]  # per token of input_ids: the engine's logprob (0 where not an action)
    score: float
    meta: dict[str, Any] = field(default_factory=dict)

    def truncated(self, max_length: int) -> Sample:
        """Cut from the end; the score stays (it lands on the last model token that is left)."""
        if len(self.input_ids) <= max_length:
            return self
        return Sample(self.input_ids[:max_length], self.action_mask[:max_length],
                      self.behaviour_logprobs[:max_length], self.score, {**self.meta, "truncated": True})


def from_rl_row(row: dict[str, Any]) -> Sample:
    """harness.export.rl_rows row -> Sample (tool results and glue between turns are mask 0)."""
    prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
    meta = {k: row.get(k) for k in ("task_id", "episode_id", "sample", "segment", "segments", "turns",
                                    "reason", "policy_versions")}
    return Sample(prompt + response, [0] * len(prompt) + list(row["response_mask"]),
                  [0.0] * len(prompt) + [float(x) for x in row["response_logprobs"]], float(row["reward"]), meta)


def from_completion(prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], score: float,
                    meta: dict[str, Any] | None = None) -> Sample:
    return Sample(list(prompt_ids) + list(completion_ids), [0] * len(prompt_ids) + [1] * len(completion_ids),
                  [0.0] * len(prompt_ids) + list(logprobs), float(score), dict(meta or {}))


def collate(items: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pads per-sample 1-D tensors: input_ids [B, L] and every target-aligned key [B, L-1]."""
    import torch

    length = max(int(it["input_ids"].numel()) for it in items)
    out: dict[str, Any] = {}
    ids = torch.full((len(items), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), length), dtype=torch.long)
    for i, it in enumerate(items):
        n = int(it["input_ids"].numel())
        ids[i, :n] = it["input_ids"]
        attn[i, :n] = 1
    out["input_ids"], out["attention_mask"] = ids, attn
    for key in items[0]:
        if key == "input_ids" or not hasattr(items[0][key], "dim") or items[0][key].dim() != 1:
            continue
        t = torch.zeros((len(items), length - 1), dtype=items[0][key].dtype)
        for i, it in enumerate(items):
            t[i, : it[key].numel()] = it[key]
        out[key] = t
    return out
