"""`eval`: a policy (a model, or existing solutions replayed) over a suite, judged, and reported."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from harness.config import EvalConfig
from harness.report import Report, build_report, write_report
from harness.rollout import EPISODES_FILE, RolloutSummary, run_rollout
from harness.solutions import find_solution
from harness.specs import select_tasks
from harness.trajectory import episode_key, latest_records
from sandbox.backend import resolve_backend
from tasks import TaskError, list_tasks


def tasks_with_solutions(root: Path, backend: str | None) -> list[str]:
    """KernelBench task ids that a solutions folder has an answer for (the default suite of --solutions)."""
    b = resolve_backend(backend)
    try:
        suite = list_tasks("kernelbench")
    except TaskError:
        suite = []
    found = [t.id for t in suite if find_solution(root, t, b) is not None]
    if not found:
        raise TaskError(f"no solution in {root} matches a KernelBench task; name the tasks with --tasks")
    return [",".join(found)]


async def run_eval(cfg: EvalConfig, console: Console | None = None) -> tuple[RolloutSummary, Report, list[Path]]:
    rc = cfg.rollout
    # replayed solutions go straight to the judge; a compile and verify of their own would only repeat it
    summary = await run_rollout(rc, console=console, replay_checks=False)
    wanted = {episode_key(t.id, s) for t in select_tasks(rc.tasks) for s in range(rc.samples)}
    records = [r for k, r in latest_records(Path(rc.out) / EPISODES_FILE).items() if k in wanted]
    report = build_report(records, cfg.fast_p_thresholds)
    written = write_report(report, Path(rc.out), plots=cfg.plots)
    return summary, report, written
