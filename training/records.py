"""The contract from harness trajectories to training rows (docs/training.md, "Training records").

A training row is harness.export's SFT row (messages with tool calls and results, the tools' JSON
schemas, task id, reward, milestone, how the episode ended, the policy version per assistant turn)
plus, per assistant turn, what the engine recorded: prompt and completion token ids and the
logprobs of the completion's tokens. `tokenize_row` renders a row through the model's own chat
template and returns the loss mask: 1 on exactly the tokens the model wrote (assistant content, its
tool calls and its end-of-turn token), 0 on system and user prompts, tool results and the template's
glue. Rows whose turns carry token ids also convert to token-level RL rows (harness.export.rl_rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness.export import sft_rows
from harness.trajectory import EpisodeRecord, load_records


class MaskError(ValueError):
    """The chat template cannot mark the assistant's tokens (it has no {% generation %} block)."""


def training_rows(records: Iterable[EpisodeRecord]) -> list[dict[str, Any]]:
    records = list(records)
    by_id = {r.episode_id: r for r in records}
    rows = []
    for row in sft_rows(records):
        rec = by_id[row["episode_id"]]
        row["turns"] = [{"message_index": t.message_index, "finish_reason": t.finish_reason,
                         "policy_version": t.policy_version, "prompt_token_ids": t.prompt_token_ids,
                         "completion_token_ids": t.completion_token_ids,
                         "completion_logprobs": t.completion_logprobs} for t in rec.turns]
        rows.append(row)
    return rows


def load_episodes(paths: list[Path]) -> list[EpisodeRecord]:
    """Episode records from run folders (their episodes.jsonl) or episode JSONL files."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"no such run folder or file: {', '.join(missing)}")
    return load_records([Path(p) for p in paths])


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          max_length: int | None = None) -> dict[str, list[int]]:
    """input_ids and loss_mask (1 = the model's own token) through the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    mask = list(out.get("assistant_masks") or [])
    if len(mask) != len(ids) or (any(m["role"] == "assistant" for m in messages) and not any(mask)):
        raise MaskError("the chat template does not mark assistant turns with {% generation %}")
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_row(tokenizer: Any, row: dict[str, Any], max_length: int | None = None) -> dict[str, list[int]]:
    return tokenize_conversation(tokenizer, row["messages"], row.get("tools"), max_length)


def masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of masked-in tokens, in order (one per assistant turn when the template is right)."""
    spans: list[list[int]] = []
    prev = 0
    for tok, m in zip(ids, mask, strict=True):
        if m and not prev:
            spans.append([])
        if m:
            spans[-1].append(tok)
        prev = m
    return spans
