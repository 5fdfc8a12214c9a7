"""Per-turn metrics of a step's multi-turn episodes: how many turns they used, which tools they called,
how the reward depends on the turns used, and by which turn the tools first said the solution was right.

The judge rewards an episode once, at its end; "reward per turn" is therefore the mean reward of the
episodes that ended after k turns (`reward_by_turns/k`). What the agent learned about repairing shows
in `verified_by_turn/k`: the share of episodes in which a `verify` call had passed by the end of turn k
(cumulative, from the tool results the model itself read). `verified_by_turn/1` is the share solved on
the first turn; the gap to the judge's `pass_rate` is what later turns added."""

from __future__ import annotations

from collections import Counter
from typing import Any

UNKNOWN_TOOL = "unknown"  # a name the episode's tool list does not hold (counted, never used as a key)


def _passed(call: Any) -> bool:
    return call.name == "verify" and not call.is_error and bool((call.structured or {}).get("ok"))


def first_verified_turn(record: Any) -> int | None:
    """1-based turn whose tool calls include the first passing verify, or None."""
    for turn in record.turns:
        if any(_passed(c) for c in turn.tool_calls):
            return turn.index + 1
    return None


def turn_metrics(records: list[Any]) -> dict[str, float]:
    if not records:
        return {}
    n = len(records)
    out: dict[str, float] = {}
    calls: Counter[str] = Counter()
    errors = 0
    for r in records:
        known = {(t.get("function") or {}).get("name") for t in r.tools or []}
        for turn in r.turns:
            for c in turn.tool_calls:
                calls[c.name if c.name in known else UNKNOWN_TOOL] += 1
                errors += c.is_error
    for name, k in sorted(calls.items()):
        out[f"tool_calls/{name}"] = k / n
    out["tool_calls/errors"] = errors / n
    out["tool_calls/per_turn"] = sum(calls.values()) / max(1, sum(len(r.turns) for r in records))
    longest = max((len(r.turns) for r in records), default=0)
    by_turns: dict[int, list[float]] = {}
    for r in records:
        by_turns.setdefault(len(r.turns), []).append(r.reward if r.reward is not None else -1.0)
    for k, rewards in sorted(by_turns.items()):
        out[f"reward_by_turns/{k}"] = sum(rewards) / len(rewards)
        out[f"turns_used/{k}"] = len(rewards) / n
    first = [first_verified_turn(r) for r in records]
    for k in range(1, longest + 1):
        out[f"verified_by_turn/{k}"] = sum(f is not None and f <= k for f in first) / n
    out["solved_first_turn"] = sum(f == 1 for f in first) / n
    return out
