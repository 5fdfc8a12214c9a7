"""A scripted policy: replays known solutions through the same tools a model would use.

It needs no model, so it drives tests and demos, and it is how `eval --solutions` scores other
systems' outputs: the files go in through write_file and the harness's judge does the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.policy import EpisodeContext, ModelTurn
from harness.solutions import Solution, find_solution
from harness.tool_schemas import ToolSpec


def _calls(turn: int, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [{"id": f"replay_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(calls)]


class ReplayPolicy:
    def __init__(self, root: Path, check: bool = True):
        """check: compile and verify through the tools before stopping, as an agent would."""
        self.root = Path(root)
        self.check = check

    def describe(self) -> dict[str, Any]:
        return {"provider": "replay", "model": "replay", "solutions": str(self.root)}

    def sampling(self) -> dict[str, Any]:
        return {}

    def solution(self, ctx: EpisodeContext) -> Solution | None:
        if "solution" not in ctx.state:
            ctx.state["solution"] = find_solution(self.root, ctx.task, ctx.backend)
        return ctx.state["solution"]

    async def complete(self, ctx: EpisodeContext, messages: list[dict[str, Any]], tools: list[ToolSpec],
                       max_tokens: int | None) -> ModelTurn:
        step = sum(1 for m in messages if m["role"] == "assistant")
        sol = self.solution(ctx)
        script: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
        if sol is not None:
            writes = [("write_file", {"path": path, "content": text}) for path, text in sol.files.items()]
            note = "".join(f" Note: {n}." for n in sol.notes)
            script.append((f"Writing the {sol.form.replace('_', '-')} solution from {sol.origin}.{note}", writes))
            if self.check:
                script += [("Building it.", [("compile", {})]), ("Checking it.", [("verify", {})])]
        if step < len(script):
            text, calls = script[step]
            message = {"role": "assistant", "content": text, "tool_calls": _calls(step, calls)}
            return ModelTurn(message=message, finish_reason="tool_calls")
        final = (f"Replayed the solution from {sol.origin}." if sol is not None
                 else f"No solution for {ctx.task.id} in {self.root}.")
        return ModelTurn(message={"role": "assistant", "content": final}, finish_reason="stop")

    async def end_episode(self, ctx: EpisodeContext) -> None:
        return None

    async def aclose(self) -> None:
        return None
