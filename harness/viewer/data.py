"""What the viewer shows, worked out from a run folder: the overview, one row per episode, and each
episode's body (conversation, tool calls with their results, file edits as diffs, final files, judgment).

The metrics come from the same code as report.json (harness.metrics via build_report), so the page and
the report never disagree. Episode bodies drop what no reader needs (token ids, logprobs) and share the
system prompt, which is the same long text in every episode of a run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from harness.metrics import result_of
from harness.report import build_report
from harness.trajectory import EpisodeRecord, ToolCallRecord, latest_records

EPISODES_FILE = "episodes.jsonl"
METRICS_FILE = "metrics.jsonl"
MAX_RESULT_CHARS = 200_000  # a tool result longer than this is cut, saying so


class ViewerError(ValueError):
    """A run folder the viewer cannot read; the message says why."""


def find_episodes(run: Path) -> Path:
    run = Path(run)
    if run.is_file():
        return run
    path = run / EPISODES_FILE
    if not path.is_file():
        raise ViewerError(f"{run} holds no {EPISODES_FILE}: point at a rollout or eval output folder")
    return path


def load_training_metrics(path: Path) -> list[dict[str, float]]:
    """Numeric fields of each JSON line (one per training step); other fields and bad lines are skipped."""
    rows: list[dict[str, float]] = []
    if not path.is_file():
        return rows
    for line in path.read_text(errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        row = {k: float(v) for k, v in obj.items()
               if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if row:
            rows.append(row)
    return rows


# metric families charted as one chart with a line per member (training/ppo/turns.py and the stages write
# them): per turn k, per tool, per milestone, per way an episode ended
GROUPED = ("tool_calls", "reward_by_turns", "turns_used", "verified_by_turn", "milestone", "ended")


def training_charts(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    """The training page's charts, in first-seen order: one per metric, except that the members of a GROUPED
    family (`tool_calls/verify`, `tool_calls/compile`, ...) share one chart titled by the family, with their
    series ordered by number where the member is one (turn 1, 2, ..., 10) and by name otherwise."""
    charts: list[dict[str, Any]] = []
    families: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        if key == "step":
            continue
        family, sep, member = key.partition("/")
        if sep and family in GROUPED:
            if family not in families:
                families[family] = {"title": family, "series": []}
                charts.append(families[family])
            families[family]["series"].append(key)
        else:
            charts.append({"title": key, "series": [key]})
    for chart in families.values():
        chart["series"].sort(key=lambda k: (0, int(k.split("/", 1)[1]), "") if k.split("/", 1)[1].isdigit()
                             else (1, 0, k))
    return charts


def _lines(text: str) -> list[str]:
    # split at newlines only: str.splitlines also splits at U+2028 and friends, which are not line ends in code
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _diff(path: str, before: str | None, after: str) -> str:
    lines = difflib.unified_diff(_lines(before or ""), _lines(after),
                                 fromfile="/dev/null" if before is None else f"a/{path}", tofile=f"b/{path}", n=3)
    return "".join(x if x.endswith("\n") else x + "\n" for x in lines)


class _Files:
    """The workspace files as the model's successful writes and edits left them."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def apply(self, call: ToolCallRecord) -> dict[str, Any] | None:
        args = call.arguments or {}
        path = args.get("path")
        if call.is_error or not isinstance(path, str):
            return None
        name = call.mcp_name or call.name
        before = self.files.get(path)
        if name == "write_file" and isinstance(args.get("content"), str):
            after = args["content"]
        elif name == "edit_file" and isinstance(args.get("old_text"), str) and isinstance(args.get("new_text"), str):
            if before is None or args["old_text"] not in before:
                # the file came with the task (never written here): show the edit itself
                return {"path": path, "diff": _diff(path, args["old_text"], args["new_text"]), "partial": True}
            after = before.replace(args["old_text"], args["new_text"], 1)
        else:
            return None
        self.files[path] = after
        return {"path": path, "diff": _diff(path, before, after), "partial": False}


def _cut(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters not shown]"


def _pretty_args(call: ToolCallRecord) -> str:
    shown = dict(call.arguments) if call.arguments is not None else None
    if shown is not None:
        shown.pop("workspace_id", None)  # bound by the harness, not chosen by the model
        return json.dumps(shown, indent=2, ensure_ascii=False)
    return call.arguments_raw


def episode_body(rec: EpisodeRecord, prompts: dict[str, str]) -> dict[str, Any]:
    calls = {c.id: c for t in rec.turns for c in t.tool_calls}
    turn_at = {t.message_index: t for t in rec.turns}
    files = _Files()
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(rec.messages):
        role = str(m.get("role", "?"))
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False) if content is not None else ""
        if role == "tool" and m.get("tool_call_id") in calls:
            continue  # shown with its call
        out: dict[str, Any] = {"role": role}
        if role == "system" and len(content) > 2000:
            ref = hashlib.sha256(content.encode()).hexdigest()[:16]
            prompts.setdefault(ref, content)
            out["prompt_ref"] = ref
        else:
            out["content"] = _cut(content)
        if m.get("reasoning_content"):
            out["reasoning"] = str(m["reasoning_content"])
        turn = turn_at.get(i)
        if turn is not None:
            out["turn"] = {"index": turn.index, "model_s": turn.model_s, "tools_s": turn.tools_s,
                           "started_s": turn.started_s, "finish_reason": turn.finish_reason,
                           "prompt_tokens": turn.usage.prompt_tokens,
                           "completion_tokens": turn.usage.completion_tokens}
        shown_calls = []
        for tc in m.get("tool_calls") or []:
            rec_call = calls.get(tc.get("id"))
            if rec_call is None:
                fn = tc.get("function") or {}
                shown_calls.append({"name": str(fn.get("name", "?")), "args": str(fn.get("arguments", "")),
                                    "result": "", "missing": True})
                continue
            shown_calls.append({"name": rec_call.name, "args": _pretty_args(rec_call), "is_error": rec_call.is_error,
                                "error_kind": rec_call.error_kind, "result": _cut(rec_call.result_text),
                                "structured": rec_call.structured, "duration_s": rec_call.duration_s,
                                "edit": files.apply(rec_call)})
        if shown_calls:
            out["calls"] = shown_calls
        messages.append(out)
    j = rec.judgment
    return {"key": rec.key, "task": rec.task.model_dump(), "sample": rec.sample, "policy": rec.policy,
            "sampling": rec.sampling, "backend": rec.backend, "ended": rec.ended, "end_detail": rec.end_detail,
            "usage": rec.usage.model_dump(), "agent_s": rec.agent_s, "duration_s": rec.duration_s,
            "messages": messages, "files": files.files,
            "judgment": j.model_dump(mode="json") if j else None}


def episode_row(rec: EpisodeRecord) -> dict[str, Any]:
    r = result_of(rec)
    j = rec.judgment
    return {"key": rec.key, "task": r.task_id, "level": r.level, "sample": r.sample, "milestone": r.milestone,
            "reward": r.reward, "correct": r.correct, "compiled": r.compiled, "reason": r.reason,
            "eager": r.speedup_vs_eager, "compile": r.speedup_vs_compile, "turns": r.turns, "ended": r.ended,
            "tokens": rec.usage.prompt_tokens + rec.usage.completion_tokens,
            "completion_tokens": rec.usage.completion_tokens, "judge_s": j.duration_s if j else None,
            "duration_s": rec.duration_s}


def build_view(run: Path, metrics: Path | None = None, title: str | None = None) -> dict[str, Any]:
    """Everything the page shows: `index` (small, parsed at load) and `bodies` (one per episode, lazily)."""
    path = find_episodes(run)
    records = sorted(latest_records(path).values(), key=lambda r: (r.task.id, r.sample))
    folder = path.parent
    metrics_path = metrics if metrics is not None else folder / METRICS_FILE
    training = load_training_metrics(Path(metrics_path))
    if not records and not training:
        raise ViewerError(f"{path} holds no complete episode")
    report = build_report(records)
    prompts: dict[str, str] = {}
    bodies = [episode_body(r, prompts) for r in records]
    summary = None
    if (folder / "summary.json").is_file():
        try:
            summary = json.loads((folder / "summary.json").read_text())
        except ValueError:
            summary = None
    index = {"title": title or folder.name, "source": str(path), "report": report.model_dump(mode="json",
                                                                                             exclude={"problems"}),
             "summary": summary, "episodes": [episode_row(r) for r in records], "training": training,
             "training_charts": training_charts(training), "prompts": prompts}
    return {"index": index, "bodies": bodies}
