"""Execute a task file safely (subprocess, meta device) to validate it before use."""

from __future__ import annotations

from pathlib import Path

from sandbox.confinement.processes import Session, WorkerError
from sandbox.timing.device_lock import device_lock
from tasks import Task, TaskError


def check_task(task: Task, timeout_s: float = 120.0) -> dict:
    """Raise TaskError naming the problem: import failure, no Model, get_inputs() raising..."""
    # task code loads the host's cores: like a verify's, it runs beside other judgments' work, never beside a timing on
    # the CPU (the "cpu" lock, shared, held until the worker is gone). A client's task check spinning four threads
    # made another client's CPU profile score 120x off (issue 69, item 5)
    with Session(hold=(device_lock("cpu", exclusive=False),)) as s:
        w = s.spawn("check")
        path = task.path
        if path is None:  # in the worker's scratch: a folder of the session's /dev/shm is not in the worker's view
            path = Path(w.scratch) / "task.py"
            path.write_text(task.source)
        try:
            r = w.request("check", timeout_s, f"checking task {task.id}", task=str(path))
        except WorkerError as e:
            raise TaskError(f"task {task.id}: {e.message}") from None
    if not r["ok"]:
        raise TaskError(f"task {task.id}: {r['message']}")
    return r
