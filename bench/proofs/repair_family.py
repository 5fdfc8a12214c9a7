"""The repair proof's expert and family: bench.proofs.family's operators as multi-turn tasks, the plans of which
demonstration starts with which expression and whether it repairs, and the scripted expert that reads its
tools' answers (a failed verify) and repairs or stops. Shared by bench.proofs.repair, its SFT stage and
bench.proofs.stages.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.proofs.family import OPS, expert_files, pick_confusers, write_tasks  # noqa: E402

# the model sees the four tools a repair needs; the rest of the server's tools stay hidden from it
SHOWN_TOOLS = ("write_file", "edit_file", "compile", "verify")
HIDDEN_TOOLS = ["list_tasks", "open_task", "close_workspace", "list_files", "read_file", "profile", "read_skill"]
DONE = "Done."


def kernel_path(backend: str) -> str:
    return "kernels/op.cu" if backend == "cuda" else "kernels/op.cpp"


def expression_line(op: str) -> str:
    """The text an edit replaces: `= expr;` occurs once in either backend's kernel."""
    return f"= {OPS[op][1]};"


def _call(turn: int, i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"demo_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def plans(fam: Family) -> dict[str, list[tuple[str, bool]]]:
    """Per task, the demonstration episodes by sample number: (expression of the first attempt, whether a
    failed verify is repaired). Sample 0 starts right; then each confuser once repaired, once given up."""
    return {n: [(n, True), *((c, True) for c in fam.confusers[n]), *((c, False) for c in fam.confusers[n])]
            for n in fam.names}


REPAIRS = ("rewrite", "edit")


def repair_reason(op: str) -> str:
    """What the repair turn says before it acts: the reference's expression, read off the task, and the
    kernel's expression it implies. A tiny model picks the right expression for the repair by copying the
    first from its prompt and mapping it to the second next to where it writes it, where a bare tool call
    would have to fetch the task from ~700 tokens back (issue 36: its live repairs wrote a wrong expression
    in 3 of 11 edits)."""
    return f"verify failed. The reference returns {OPS[op][0]}, so the kernel must compute {OPS[op][1]}."


def repair_calls(name: str, first: str, backend: str, how: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of a repair: rewrite the kernel file with the task's expression, or edit the first
    attempt's expression line into it. An edit must copy the failed expression into old_text, which a tiny
    model gets wrong (issue 36: 5 of 11 live edits missed their own text); a rewrite needs no copy of it."""
    path = kernel_path(backend)
    if how == "rewrite":
        return [("write_file", {"path": path, "content": expert_files(OPS[name][1], backend)[path]})]
    return [("edit_file", {"path": path, "old_text": expression_line(first), "new_text": expression_line(name)})]


class RepairExpert:
    """A scripted expert (harness Policy) that decides from the tool results it is given: the episode's
    sample number picks its plan (`plans`): the expression of its first attempt, and whether after a failed
    verify it repairs or answers as it is. A repair by `how="rewrite"` says what the reference computes
    (`repair_reason`) and writes the kernel anew; by `"edit"` it is a bare edit of the expression line (the
    form of the runs before issue 36's rewrite). Its turns are what the tiny model is fine-tuned on."""

    def __init__(self, plan: dict[str, list[tuple[str, bool]]], name_of: dict[str, str], how: str = "rewrite"):
        if how not in REPAIRS:
            raise ValueError(f"repair by one of {REPAIRS}, not {how!r}")
        self.plan, self.name_of, self.how = plan, name_of, how

    def describe(self) -> dict[str, Any]:
        return {"provider": "scripted", "model": "repair-expert"}

    def sampling(self) -> dict[str, Any]:
        return {}

    async def complete(self, ctx: Any, messages: list[dict[str, Any]], tools: Any, max_tokens: int | None) -> Any:
        from harness.policy import ModelTurn

        name = self.name_of[ctx.task.id]
        first, repairs = self.plan[name][ctx.sample]
        turn = sum(m["role"] == "assistant" for m in messages)
        last_verify = next((m["content"] for m in reversed(messages) if m["role"] == "tool"), "")
        check = [("compile", {}), ("verify", {})]
        if turn == 0:
            files = expert_files(OPS[first][1], ctx.backend)
            calls = [("write_file", {"path": p, "content": body}) for p, body in files.items()] + check
        elif turn == 1 and repairs and not last_verify.startswith("verify OK"):
            calls = repair_calls(name, first, ctx.backend, self.how) + check
        else:
            return ModelTurn(message={"role": "assistant", "content": DONE}, finish_reason="stop")
        # the edit form stays as the runs before the rewrite had it: a bare tool call
        message = {"role": "assistant", "content": repair_reason(name) if turn and self.how == "rewrite" else "",
                   "tool_calls": [_call(turn, i, n, a) for i, (n, a) in enumerate(calls)]}
        return ModelTurn(message=message, finish_reason="tool_calls")

    async def end_episode(self, ctx: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


@dataclass
class Family:
    out: Path
    names: list[str]
    tasks: dict[str, Any]  # name -> Task
    tasks_dir: Path
    backend: str
    device: str
    confusers: dict[str, list[str]]


def make_family(out: Path, n_tasks: int, rows: int, backend: str | None, device: str | None,
                confusers: int = 2) -> Family:
    import torch

    from harness.specs import select_tasks
    from sandbox.backend import resolve_backend

    names = list(OPS)[:n_tasks]
    out.mkdir(parents=True, exist_ok=True)
    write_tasks(out / "tasks", rows, names)
    by_name = {t.name: t for t in select_tasks([str(out / "tasks")])}
    return Family(out=out, names=names, tasks={n: by_name[n] for n in names}, tasks_dir=out / "tasks",
                  backend=resolve_backend(backend), device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                  confusers=pick_confusers(names, confusers))
