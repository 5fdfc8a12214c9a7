"""The task's side of a judgment: one `eager` process, verify's reference or profile's eager, kept between judgments
of the same task where the process judges repeatedly (sandbox/confinement/kept.py)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from sandbox.confinement.processes import Session, Worker, WorkerError


def task_source(task_path: str) -> tuple[str, str]:
    """The task's text, read once by the judge, and its hash: what a task process runs, and what it is kept by."""
    raw = Path(task_path).read_bytes()
    # decoded as the import system decodes a source file (its coding line, else UTF-8), whatever the locale says
    return importlib.util.decode_source(raw), hashlib.sha256(raw).hexdigest()


def spawn(s: Session, sha: str) -> Worker:
    return s.spawn("eager", keep=sha)


def ask(w: Worker, **setup) -> None:
    """Send the set-up; a kept process that cannot take it is replaced when its reply is read (setup_reply)."""
    try:
        w.send("setup", **setup)
    except WorkerError:
        if not w.reused:
            raise


def setup_reply(s: Session, w: Worker, timeout: float, what: str, **setup) -> tuple[Worker, dict]:
    """The reply to the set-up `setup` already sent to `w`. A kept process that fails it, or dies, is replaced by a
    fresh one, asked again: whatever a process met while it waited (a fault on the device) is no judgment's verdict."""
    try:
        if w._killed:
            raise WorkerError("crash", "the kept process could not take the set-up")
        r = w.recv(timeout, what)
        if r.get("ok") or not w.reused:
            return w, r
    except WorkerError:
        if not w.reused:
            raise
    w = s.replace(w)
    w.wait_ready(timeout, "starting the task's process")
    return w, w.request("setup", timeout, what, **setup)


def settle(w: Worker, timeout: float) -> dict:
    """The reply once the task process's work after its set-up's reply is done (protocol.AFTER_REPLY: it uses the
    device), for a caller about to let its hold go with no other request to it under the hold (a profile without
    the untimed start ahead). A process that died meanwhile is the reference's failure: {"ok": False, "message"}."""
    try:
        return w.request("settle", timeout, "the eager process's set-up")
    except WorkerError as e:
        return {"ok": False, "message": f"the eager process failed after its set-up ({e.reason}): {e.message}"}

