"""Episode records turned into training rows, and into Hugging Face datasets.

SFT rows (chat format): {"messages", "tools", ...}; the messages as the model saw them, tool-call
arguments as objects (what chat templates expect), harness-only keys removed; with the task, the
reward and milestone, how the episode ended, and the policy version of each assistant turn.
docs/training.md gives the full contract; training.records tokenizes these rows with a loss mask.

RL rows (token level): {"prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward"}.
They need the token ids the server returned (vLLM: return_token_ids). The response is the
model's completions with the tokens in between (tool results, chat-template glue) spliced in from
the next turn's prompt and masked out (mask 0, logprob 0). That splice needs each prompt to extend
the previous prompt plus completion token for token; where a chat template re-renders history
differently (dropped reasoning, repaired arguments), the episode is split into several rows at
that point, each carrying the episode's reward.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.policy import PRIVATE_KEYS, is_json_object
from harness.trajectory import EpisodeRecord


def _sft_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in PRIVATE_KEYS}
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for c in calls:
            args = c["function"].get("arguments")
            if isinstance(args, str) and is_json_object(args):
                args = json.loads(args)
            fixed.append({**c, "function": {**c["function"], "arguments": args}})
        out["tool_calls"] = fixed
    return out


def _reason(rec: EpisodeRecord) -> str | None:
    """Why the episode's reward is the failed one (an integrity reason when the judge caught it cheating)."""
    r = rec.judgment.reward if rec.judgment else None
    return str(r.reason) if r is not None and r.reason is not None else None


def sft_rows(records: Iterable[EpisodeRecord], min_reward: float | None = None) -> list[dict[str, Any]]:
    rows = []
    for rec in records:
        reward = rec.reward if rec.reward is not None else -1.0
        if min_reward is not None and reward < min_reward:
            continue
        if not any(m["role"] == "assistant" for m in rec.messages):
            continue
        rows.append({"messages": [_sft_message(m) for m in rec.messages], "tools": rec.tools,
                     "task_id": rec.task.id, "sample": rec.sample, "episode_id": rec.episode_id,
                     "reward": reward, "milestone": rec.judgment.reward.milestone if rec.judgment else "failed",
                     "reason": _reason(rec), "ended": rec.ended,
                     "policy_versions": [t.policy_version for t in rec.turns]})
    return rows


@dataclass
class _Segment:
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    versions: list[int | None] = field(default_factory=list)

    def add(self, ids: list[int], mask: int, logprobs: list[float] | None) -> None:
        self.response += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None and len(logprobs) == len(ids) else [0.0] * len(ids)


def rl_segments(rec: EpisodeRecord) -> list[_Segment] | None:
    """None when the episode lacks token ids for any turn."""
    if not rec.turns or any(t.prompt_token_ids is None or t.completion_token_ids is None for t in rec.turns):
        return None
    segments: list[_Segment] = []
    current: _Segment | None = None
    for t in rec.turns:
        prompt = list(t.prompt_token_ids or [])
        completion = list(t.completion_token_ids or [])
        if current is not None:
            so_far = current.prompt + current.response
            if prompt[: len(so_far)] == so_far:
                current.add(prompt[len(so_far):], 0, None)
                current.add(completion, 1, t.completion_logprobs)
                current.turns += 1
                current.versions.append(t.policy_version)
                continue
            segments.append(current)
        current = _Segment(prompt=prompt)
        current.add(completion, 1, t.completion_logprobs)
        current.turns = 1
        current.versions = [t.policy_version]
    if current is not None:
        segments.append(current)
    return segments


def rl_rows(records: Iterable[EpisodeRecord]) -> list[dict[str, Any]]:
    rows = []
    for rec in records:
        segments = rl_segments(rec)
        if not segments:
            continue
        reward = rec.reward if rec.reward is not None else -1.0
        for i, seg in enumerate(segments):
            rows.append({"prompt_ids": seg.prompt, "response_ids": seg.response, "response_mask": seg.mask,
                         "response_logprobs": seg.logprobs, "reward": reward, "task_id": rec.task.id,
                         "sample": rec.sample, "episode_id": rec.episode_id, "segment": i,
                         "segments": len(segments), "turns": seg.turns, "reason": _reason(rec),
                         "policy_versions": seg.versions})
    return rows


def to_dataset(rows: list[dict[str, Any]], kind: str) -> Any:
    """A datasets.Dataset. Chat rows keep messages and tool schemas as JSON objects where the
    installed datasets has the Json feature (their fields differ from row to row), else as JSON text."""
    import datasets

    if kind != "sft":
        return datasets.Dataset.from_list(rows)
    if hasattr(datasets, "Json"):
        features = datasets.Features({
            "messages": datasets.List(datasets.Json()), "tools": datasets.List(datasets.Json()),
            "task_id": datasets.Value("string"), "sample": datasets.Value("int64"),
            "episode_id": datasets.Value("string"), "reward": datasets.Value("float64"),
            "milestone": datasets.Value("string"), "reason": datasets.Value("string"),
            "ended": datasets.Value("string"), "policy_versions": datasets.List(datasets.Value("int64"))})
        return datasets.Dataset.from_list(rows, features=features)
    text_rows = [{**r, "messages": json.dumps(r["messages"]), "tools": json.dumps(r["tools"])} for r in rows]
    return datasets.Dataset.from_list(text_rows)


def save_rows(rows: list[dict[str, Any]], out: Path, kind: str) -> Path:
    """.jsonl: plain JSON lines (no datasets needed); .parquet: one file; otherwise a save_to_disk folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".jsonl":
        with open(out, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
        return out
    ds = to_dataset(rows, kind)
    if out.suffix == ".parquet":
        ds.to_parquet(str(out))
    else:
        ds.save_to_disk(str(out))
    return out
