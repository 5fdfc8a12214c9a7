"""Ending a finished operation's workers off the caller's path (processes.Session)."""

from __future__ import annotations

import atexit
import contextlib
import queue
import shutil
import threading
from pathlib import Path
from typing import Any


class _Reaper:
    """Ends operations' workers off the caller's path.

    A finished operation's workers are sent SIGKILL at once (nothing of theirs runs past it), but a CUDA process
    takes 0.1-0.3 s to die while the driver tears its context down, and the operation's result does not depend on
    that: the waiting, the template's release and the removal of the scratch folders happen in one thread of this
    process. A lock the operation held over its workers (verify's shared device lock) is released only once they
    are gone, so a timing that waits for it never overlaps their teardown, as before."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._submitted = 0  # jobs handed in, and jobs finished (in order: one thread takes them first come)
        self._finished = 0
        self._folders: set[Path] = set()
        self._thread: threading.Thread | None = None
        # a process that exits right after its operation (an MCP helper) leaves the dying to the template
        self.wait_at_exit = True
        atexit.register(self._at_exit)

    def submit(self, workers: list[Any], folder: Path, held: contextlib.ExitStack) -> None:
        for w in workers:
            w.stop()
        with self._cond:
            self._pending += 1
            self._submitted += 1
            self._folders.add(folder)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cuda-agent-reaper", daemon=True)
                self._thread.start()
        self._jobs.put((workers, folder, held))

    def _run(self) -> None:
        while True:
            workers, folder, held = self._jobs.get()
            try:
                for w in workers:
                    w.kill()
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                try:
                    held.close()
                finally:
                    with self._cond:
                        self._pending -= 1
                        self._finished += 1
                        self._folders.discard(folder)
                        self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the workers of every operation submitted so far are gone (not those of operations that end
        meanwhile: under a steady stream of judgments the reaper is rarely idle, and a timing that waited for
        that would wait for a lull); False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def _at_exit(self) -> None:
        if self.wait_at_exit:
            self.drain(30.0)
        with self._cond:
            left = list(self._folders)
        for folder in left:  # the workers were killed; their files go now, whoever collects the processes
            shutil.rmtree(folder, ignore_errors=True)


REAPER = _Reaper()
