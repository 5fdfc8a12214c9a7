"""Episode records and the append-only JSONL file they are written to.

One line per finished episode, written whole and flushed to disk before the next, so a run that
is killed loses only the episodes still in flight. A torn last line (a kill during a write) is
cut off when the file is opened again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from sandbox.results import CompileResult, ProfileResult, RewardResult, VerifyResult

SCHEMA_VERSION = 1

EndReason = Literal[
    "model_stopped",  # answered without calling a tool
    "max_turns",
    "context_budget",  # the next call would not fit the context budget
    "timeout",  # the episode's wall-clock limit
    "truncated",  # too many responses in a row cut off at max_tokens
    "model_error",  # the model endpoint failed after retries
    "tool_server_error",  # the MCP connection broke
    "no_workspace",  # the task could not be opened
    "error",  # anything else in the harness
]
# episodes that ended for reasons outside the model's control; --retry-errors runs them again
ERROR_ENDS = frozenset({"model_error", "tool_server_error", "no_workspace", "error"})


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None


class ToolCallRecord(BaseModel):
    id: str
    name: str = Field(description="the name the model used")
    arguments_raw: str = Field(description="the arguments exactly as the model produced them")
    mcp_name: str | None = None
    server: str | None = None
    arguments: dict[str, Any] | None = Field(None, description="as sent to the tool server")
    is_error: bool = False
    error_kind: str | None = None
    result_text: str = ""
    structured: dict[str, Any] | None = Field(None, description="the sandbox result of compile/verify/profile/analyze")
    duration_s: float = 0.0


class TurnRecord(BaseModel):
    index: int
    message_index: int = Field(description="the assistant message's position in `messages`")
    started_s: float = Field(description="seconds since the episode started")
    model_s: float
    tools_s: float = 0.0
    finish_reason: str | None = None
    usage: Usage = Field(default_factory=Usage)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    response_id: str | None = None
    policy_version: int | None = Field(None, description="the weights version that generated this turn, as the "
                                                         "serving engine reported it (training.engine)")


class Judgment(BaseModel):
    """The environment's own compile, verify and profile of the final workspace, and the reward."""

    compile: CompileResult | None = None
    verify: VerifyResult | None = None
    profile: ProfileResult | None = None
    reward: RewardResult
    settings: dict[str, Any] = Field(default_factory=dict, description="judge settings in force")
    error: str | None = None
    duration_s: float = 0.0


class TaskRef(BaseModel):
    id: str
    sha256: str
    level: str
    path: str | None = None


class EpisodeRecord(BaseModel):
    schema_version: int = SCHEMA_VERSION
    episode_id: str
    key: str = Field(description="task id and sample index: what --resume matches on")
    task: TaskRef
    sample: int
    policy: dict[str, Any] = Field(description="provider, model, endpoint, or the replayed solution")
    sampling: dict[str, Any] = Field(default_factory=dict)
    agent: dict[str, Any] = Field(default_factory=dict)
    tool_server: dict[str, Any] = Field(default_factory=dict)
    workspace_id: str | None = None
    backend: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list, description="tool schemas shown, OpenAI format")
    messages: list[dict[str, Any]] = Field(default_factory=list, description="the conversation, OpenAI format")
    turns: list[TurnRecord] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    ended: EndReason
    end_detail: str = ""
    judgment: Judgment | None = None
    started_at: float
    agent_s: float = 0.0
    duration_s: float = 0.0

    @property
    def reward(self) -> float | None:
        return self.judgment.reward.reward if self.judgment else None


def episode_key(task_id: str, sample: int) -> str:
    return f"{task_id}#{sample}"


class TrajectoryWriter:
    """Appends records to a JSONL file, one complete line per episode."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)
        self._fh = open(self.path, "ab")

    def append(self, record: EpisodeRecord) -> None:
        line = record.model_dump_json().encode() + b"\n"
        # one write of the whole line, then to disk: a kill leaves at most a torn last line
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def repair_tail(path: Path) -> bool:
    """Cut a torn last line left by a killed run. True if something was cut."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 1))
        if fh.read(1) == b"\n":
            return False
        # find the last newline; everything after it is a partial record
        pos = size
        chunk = 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            fh.seek(start)
            data = fh.read(pos - start)
            idx = data.rfind(b"\n")
            if idx >= 0:
                fh.truncate(start + idx + 1)
                return True
            pos = start
        fh.truncate(0)
        return True


def iter_records(path: Path) -> Iterator[EpisodeRecord]:
    """Every complete record of a file; a torn or unreadable line is skipped."""
    if not Path(path).is_file():
        return
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            try:
                yield EpisodeRecord.model_validate_json(line)
            except ValueError:
                continue


def latest_records(path: Path) -> dict[str, EpisodeRecord]:
    """The last record per episode key (an episode run again with --retry-errors replaces the first)."""
    out: dict[str, EpisodeRecord] = {}
    for rec in iter_records(path):
        out[rec.key] = rec
    return out


def load_records(paths: list[Path]) -> list[EpisodeRecord]:
    out: dict[str, EpisodeRecord] = {}
    for p in paths:
        p = Path(p)
        out.update(latest_records(p / "episodes.jsonl" if p.is_dir() else p))
    return list(out.values())


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)
