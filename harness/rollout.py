"""Many episodes at once: tasks x samples, bounded overall, per tool server (GPU) and per model endpoint.

Finished episodes are appended to OUT/episodes.jsonl as they finish; `resume` skips the episode
keys already there, so a killed run picks up where it was and runs every episode exactly once.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, Field
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.config import RolloutConfig
from harness.episode import EpisodeSetup, run_episode
from harness.policy import Policy
from harness.servers import ServerPool, open_servers
from harness.specs import select_tasks
from harness.trajectory import (
    ERROR_ENDS,
    EpisodeRecord,
    TrajectoryWriter,
    dump_json,
    episode_key,
    latest_records,
)
from tasks import Task

EPISODES_FILE = "episodes.jsonl"


class RolloutError(RuntimeError):
    """A run that cannot start (bad settings, an output folder in use); the message says why."""


class RolloutSummary(BaseModel):
    out: str
    planned: int = Field(description="tasks x samples")
    skipped: int = Field(description="already in the output (resume)")
    ran: int
    ended: dict[str, int] = Field(default_factory=dict)
    milestones: dict[str, int] = Field(default_factory=dict)
    mean_reward: float | None = None
    correct: int = 0
    duration_s: float = 0.0
    retried: int = Field(0, description="episodes run again on another tool server after theirs went away")
    servers_lost: dict[str, str] = Field(default_factory=dict, description="tool servers that went away, and why")
    cluster: dict[str, Any] | None = Field(None, description="--ray: the judge actors, their nodes and GPUs, "
                                                             "episodes and judgments each (harness.cluster.status)")


def make_policy(cfg: RolloutConfig, replay_checks: bool = True) -> Policy:
    if cfg.replay is not None:
        from harness.replay import ReplayPolicy

        return ReplayPolicy(cfg.replay, check=replay_checks)
    assert cfg.model is not None
    try:
        if cfg.model.provider == "anthropic":
            from harness.anthropic_client import AnthropicPolicy

            return AnthropicPolicy(cfg.model, cfg.sampling)
        from harness.openai_client import OpenAIChatPolicy

        return OpenAIChatPolicy(cfg.model, cfg.sampling)
    except ImportError as e:
        raise RolloutError(f"the {cfg.model.provider} client is not installed ({e.name}): "
                           "pip install 'cuda-agent[harness]'") from None


def plan(tasks: list[Task], samples: int, done: set[str]) -> list[tuple[Task, int]]:
    # sample-major: the samples of one task do not start together, so the first one's baseline timing
    # is cached on the server by the time the others profile
    return [(t, s) for s in range(samples) for t in tasks if episode_key(t.id, s) not in done]


def _line(rec: EpisodeRecord) -> str:
    j = rec.judgment
    reward = f"reward {j.reward.reward:g} ({j.reward.milestone})" if j else "not judged"
    return f"{rec.key}: {reward}, {len(rec.turns)} turns, {rec.ended}, {rec.duration_s:.0f} s"


class _Tally:
    def __init__(self) -> None:
        self.ended: Counter[str] = Counter()
        self.milestones: Counter[str] = Counter()
        self.rewards: list[float] = []
        self.retried = 0
        self.lost: dict[str, str] = {}
        self.by_server: Counter[str] = Counter()
        self.judged_by: Counter[str] = Counter()
        self.cluster: dict[str, Any] | None = None

    def add(self, rec: EpisodeRecord) -> None:
        self.ended[rec.ended] += 1
        alias = (rec.tool_server or {}).get("alias") or ""
        self.by_server[alias] += 1
        if rec.judgment and rec.judgment.compile is not None:
            self.judged_by[alias] += 1
        if rec.judgment:
            self.milestones[rec.judgment.reward.milestone] += 1
            self.rewards.append(rec.judgment.reward.reward)

    @property
    def correct(self) -> int:
        return sum(n for m, n in self.milestones.items() if m != "failed")

    def mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


async def run_rollout(cfg: RolloutConfig, policy: Policy | None = None, console: Console | None = None,
                      replay_checks: bool = True) -> RolloutSummary:
    console = console or Console(stderr=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / EPISODES_FILE
    existing = latest_records(path)
    if existing and not cfg.resume:
        raise RolloutError(f"{path} already holds {len(existing)} episodes: pass --resume to continue that run, "
                           "or choose another --out")
    done = {k for k, r in existing.items() if not (cfg.retry_errors and r.ended in ERROR_ENDS)}
    tasks = select_tasks(cfg.tasks)
    todo = plan(tasks, cfg.samples, done)
    planned = len(tasks) * cfg.samples
    with open(out / "runs.jsonl", "a") as fh:
        fh.write(dump_json({"started": time.time(), "argv": sys.argv, "planned": planned, "to_run": len(todo),
                            "config": cfg.model_dump(mode="json")}).replace("\n", " ") + "\n")
    own_policy = policy is None
    policy = policy or make_policy(cfg, replay_checks)
    tally = _Tally()
    t0 = time.perf_counter()
    try:
        if todo:
            await _run_all(cfg, policy, todo, path, out, tally, console)
    finally:
        if own_policy:
            await policy.aclose()
    summary = RolloutSummary(out=str(out), planned=planned, skipped=planned - len(todo), ran=sum(tally.ended.values()),
                             ended=dict(tally.ended), milestones=dict(tally.milestones), mean_reward=tally.mean(),
                             correct=tally.correct, duration_s=time.perf_counter() - t0, retried=tally.retried,
                             servers_lost=tally.lost, cluster=tally.cluster)
    (out / "summary.json").write_text(summary.model_dump_json(indent=2))
    return summary


async def _run_all(cfg: RolloutConfig, policy: Policy, todo: list[tuple[Task, int]], path: Path, out: Path,
                   tally: _Tally, console: Console) -> None:
    setup = EpisodeSetup(policy=policy, agent=cfg.agent, judge=cfg.judge, max_tokens=cfg.sampling.max_tokens)
    show_bar = cfg.progress and console.is_terminal
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
                        disable=not show_bar)
    bar = progress.add_task("episodes", total=len(todo), status="")
    send, receive = anyio.create_memory_object_stream[tuple[Task, int]](math.inf)
    for item in todo:
        send.send_nowait(item)
    send.close()
    async with open_servers(cfg.tools, cfg.agent.backend, cfg.concurrency, out / "logs") as servers:
        pool = ServerPool(servers, cfg.tools.episodes_per_server)

        def cluster_status(final: bool = False) -> str | None:
            """--ray only: the actors' status into OUT/cluster.json (and the summary); its line to print."""
            if not cfg.tools.ray:
                return None
            from harness.cluster.status import cluster_view, status_line, write_status

            stats = None
            if final:
                import ray

                from harness.cluster.pool import actor_stats
                stats = actor_stats(ray, servers)
            queue = len(todo) - sum(tally.ended.values()) - sum(pool.load.values())
            view = cluster_view(cfg.tools.ray, servers, pool.load, pool.lost, tally.by_server, tally.judged_by,
                                max(0, queue), tally.retried, stats)
            write_status(out, view)
            tally.cluster = view
            return status_line(view)

        with TrajectoryWriter(path) as writer, progress:
            async def worker() -> None:
                async for task, sample in receive:
                    while True:
                        async with pool.lease() as server:
                            cluster_status()
                            rec = await run_episode(task, sample, server, setup)
                        # the server broke, not the policy: run the episode again elsewhere, so a lost host
                        # costs time, never an episode (or a reward of -1 it did not earn)
                        if rec.ended != "tool_server_error" or not [s for s in pool.alive() if s is not server]:
                            break
                        await pool.mark_lost(server, rec.end_detail or "tool_server_error")
                        tally.lost = dict(pool.lost)
                        tally.retried += 1
                        console.print(f"tool server {server.alias} went away ({(rec.end_detail or '')[:200]}): "
                                      f"{rec.key} runs again on another", highlight=False)
                    writer.append(rec)
                    tally.add(rec)
                    mean = tally.mean()
                    progress.update(bar, advance=1, status=f"correct {tally.correct}"
                                    + (f", mean reward {mean:.2f}" if mean is not None else ""))
                    line = cluster_status()
                    if not show_bar and cfg.progress:
                        done = sum(tally.ended.values())
                        console.print(f"[{done}/{len(todo)}] {_line(rec)}", highlight=False)
                        if line:
                            console.print(line, highlight=False, markup=False)
                    elif line:
                        progress.update(bar, status=f"correct {tally.correct}, {line[:line.index(' |')]}")

            async with anyio.create_task_group() as tg:
                for _ in range(min(cfg.concurrency, len(todo))):
                    tg.start_soon(worker)
            if cfg.tools.ray:
                await anyio.to_thread.run_sync(cluster_status, True)


def summary_table(summary: RolloutSummary) -> Table:
    table = Table(title=f"rollout: {summary.out}", show_header=False)
    table.add_row("episodes", f"{summary.ran} run, {summary.skipped} already done, {summary.planned} planned")
    table.add_row("correct", f"{summary.correct} of {summary.ran}")
    if summary.mean_reward is not None:
        table.add_row("mean reward", f"{summary.mean_reward:.3f}")
    table.add_row("milestones", ", ".join(f"{k} {v}" for k, v in sorted(summary.milestones.items())) or "-")
    table.add_row("ended", ", ".join(f"{k} {v}" for k, v in sorted(summary.ended.items())) or "-")
    table.add_row("time", f"{summary.duration_s:.0f} s")
    if summary.retried or summary.servers_lost:
        table.add_row("servers", f"{summary.retried} episodes run again; lost: "
                      + (", ".join(summary.servers_lost) or "none"))
    if summary.cluster:
        from harness.cluster.status import status_line

        table.add_row("ray", status_line(summary.cluster))
    return table


def print_summary(summary: RolloutSummary, console: Console | None = None) -> None:
    (console or Console(stderr=True)).print(summary_table(summary))


def records_of(out: Path) -> dict[str, Any]:
    return latest_records(Path(out) / EPISODES_FILE)
