"""Rejection fine-tuning, part one: which episodes to learn from.

Outcome selection first (the judge's milestone, optionally a reward floor), then quality filters
after the paper: invalid tool calls (an unknown tool, arguments that fail the tool's schema,
arguments that do not parse), inefficient loops (the same call repeated back to back; compiles
failing again and again with no file changed in between), truncated contexts; then exact
duplicates, then a cap per task (best reward first, then the shortest). Every episode dropped is
counted under the first rule that dropped it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from harness.trajectory import EpisodeRecord

MILESTONES = ("failed", "correct", "faster_than_eager", "faster_than_compile")
INVALID_CALL_KINDS = {"unknown_tool", "invalid_arguments", "malformed_arguments"}
FILE_CHANGING_TOOLS = {"write_file", "edit_file"}
TRUNCATED_ENDS = {"truncated", "context_budget"}


@dataclass
class SelectConfig:
    min_milestone: str = "faster_than_eager"
    min_reward: float | None = None
    drop_invalid_tool_calls: bool = True
    max_identical_consecutive_calls: int = 2  # more identical calls in a row than this drops the episode
    max_failed_compiles_without_change: int = 2  # more failing compiles with no file change drops it
    drop_truncated: bool = True
    dedupe: bool = True
    max_per_task: int | None = 4


@dataclass
class Selection:
    kept: list[EpisodeRecord]
    dropped: Counter = field(default_factory=Counter)
    total: int = 0

    def summary(self) -> dict[str, Any]:
        return {"total": self.total, "kept": len(self.kept), "dropped": dict(self.dropped)}


def _milestone(rec: EpisodeRecord) -> str:
    return rec.judgment.reward.milestone if rec.judgment else "failed"


def _calls(rec: EpisodeRecord) -> list[Any]:
    return [c for t in rec.turns for c in t.tool_calls]


def invalid_tool_call(rec: EpisodeRecord) -> str | None:
    """The first invalid call, judged both by what the harness recorded and against the tools shown."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in rec.tools if "function" in t}
    for c in _calls(rec):
        if c.error_kind in INVALID_CALL_KINDS:
            return f"{c.name}: {c.error_kind}"
        if schemas and c.name not in schemas:
            return f"{c.name}: unknown_tool"
        try:
            args = json.loads(c.arguments_raw) if c.arguments_raw.strip() else {}
        except json.JSONDecodeError:
            return f"{c.name}: malformed_arguments"
        if not isinstance(args, dict):
            return f"{c.name}: malformed_arguments"
        if c.name in schemas and next(jsonschema.Draft202012Validator(schemas[c.name]).iter_errors(args), None):
            return f"{c.name}: invalid_arguments"
    return None


def longest_identical_run(rec: EpisodeRecord) -> int:
    best = run = 0
    prev: tuple[str, str] | None = None
    for c in _calls(rec):
        key = (c.name, json.dumps(json.loads(c.arguments_raw), sort_keys=True) if _is_json(c.arguments_raw)
               else c.arguments_raw)
        run = run + 1 if key == prev else 1
        best, prev = max(best, run), key
    return best


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _compile_failed(call: Any) -> bool:
    if call.structured is not None and "ok" in call.structured:
        return not call.structured["ok"]
    return call.is_error


def failed_compiles_without_change(rec: EpisodeRecord) -> int:
    """The most failing compiles in a row with no successful file write or edit between them."""
    best = run = 0
    for c in _calls(rec):
        if c.name in FILE_CHANGING_TOOLS and not c.is_error:
            run = 0
        elif c.name == "compile" and _compile_failed(c):
            run += 1
            best = max(best, run)
    return best


def truncated(rec: EpisodeRecord) -> bool:
    return rec.ended in TRUNCATED_ENDS or any(t.finish_reason == "length" for t in rec.turns)


def fingerprint(rec: EpisodeRecord) -> str:
    """What the model wrote, in order: two episodes with the same fingerprint teach the same thing."""
    said = [{"content": m.get("content"), "calls": [(c["function"]["name"], c["function"]["arguments"])
                                                    for c in m.get("tool_calls") or []]}
            for m in rec.messages if m.get("role") == "assistant"]
    return hashlib.sha256(json.dumps([rec.task.id, said], sort_keys=True).encode()).hexdigest()


def rules(cfg: SelectConfig) -> list[tuple[str, Callable[[EpisodeRecord], bool]]]:
    """(name, drops?) in the order they are applied."""
    floor = MILESTONES.index(cfg.min_milestone)
    out: list[tuple[str, Callable[[EpisodeRecord], bool]]] = [
        ("outcome", lambda r: MILESTONES.index(_milestone(r)) < floor
         or (cfg.min_reward is not None and (r.reward if r.reward is not None else -1.0) < cfg.min_reward)),
        ("no_assistant_turn", lambda r: not any(m.get("role") == "assistant" for m in r.messages))]
    if cfg.drop_invalid_tool_calls:
        out.append(("invalid_tool_call", lambda r: invalid_tool_call(r) is not None))
    if cfg.max_identical_consecutive_calls > 0:
        out.append(("identical_consecutive_calls",
                    lambda r: longest_identical_run(r) > cfg.max_identical_consecutive_calls))
    if cfg.max_failed_compiles_without_change > 0:
        out.append(("compile_fail_loop",
                    lambda r: failed_compiles_without_change(r) > cfg.max_failed_compiles_without_change))
    if cfg.drop_truncated:
        out.append(("truncated", truncated))
    return out


def select(records: Iterable[EpisodeRecord], cfg: SelectConfig) -> Selection:
    if cfg.min_milestone not in MILESTONES:
        raise ValueError(f"min_milestone must be one of {', '.join(MILESTONES)}")
    records = list(records)
    sel = Selection(kept=[], total=len(records))
    checks = rules(cfg)
    passing = []
    for rec in records:
        name = next((n for n, drops in checks if drops(rec)), None)
        if name:
            sel.dropped[name] += 1
        else:
            passing.append(rec)
    if cfg.dedupe:
        seen: set[str] = set()
        unique = []
        for rec in passing:
            fp = fingerprint(rec)
            if fp in seen:
                sel.dropped["duplicate"] += 1
                continue
            seen.add(fp)
            unique.append(rec)
        passing = unique
    if cfg.max_per_task is not None:
        by_task: dict[str, list[EpisodeRecord]] = defaultdict(list)
        for rec in passing:
            by_task[rec.task.id].append(rec)
        passing = []
        for group in by_task.values():
            group.sort(key=lambda r: (-(r.reward or 0.0), len(r.turns)))
            passing += group[: cfg.max_per_task]
            if len(group) > cfg.max_per_task:
                sel.dropped["per_task_cap"] += len(group) - cfg.max_per_task
    sel.kept = passing
    return sel
