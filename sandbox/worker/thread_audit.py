"""ATen ops started on any thread of the candidate's process (Judge IX, item 2).

The op recorder is a dispatch mode and the op audit's profiler registers thread-local callbacks: an op that the
extension starts on a fresh `std::thread` (or any thread it did not inherit the judge's state on) passes both. A
matmul task's extension called `torch.Tensor.mm` that way and earned reward 3 at 24x eager. PyTorch's execution
trace observer registers a *global* RecordFunction callback, so the dispatcher reports to it from every thread
(OpenMP and at::parallel_for workers included): around the audited calls it records each op with the thread that
ran it, and every op run outside the calling thread that is not allocation, a view or metadata is compute the
recorder did not see (`torch_op_used`).

The judge's own canary: a multiply on a thread it starts itself, inside the observed region, must be reported on a
thread other than the caller's; a session without it (the observer switched off from C++, which the symbol scan
refuses, or its file replaced) is `dispatch_tampered`. Like the other in-process audits this runs in the candidate's
process and is only as strong as its canary; the Python the candidate would need to forge it is refused at build
time (sandbox/scan/object_scan.py).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import threading

import torch

from sandbox.worker.protocol import Reply
from sandbox.worker.recorder import ALLOWED_OPS

# captured at import, before any candidate code runs
_ET = torch._C._profiler
_ADD, _ON = _ET._add_execution_trace_observer, _ET._enable_execution_trace_observer
_OFF, _REMOVE = _ET._disable_execution_trace_observer, _ET._remove_execution_trace_observer
_THREAD = threading.Thread
_MUL, _ONES, _NO_GRAD = torch.mul, torch.ones, torch.no_grad
_LOADS, _OPEN, _UNLINK = json.loads, open, os.unlink
HARMLESS = ALLOWED_OPS | {"fill_", "resolve_conj", "resolve_neg"}
_ROOT = "[pytorch|profiler|execution_trace|"


def _attrs(node: dict) -> dict:
    return {a.get("name"): a.get("value") for a in node.get("attrs", ()) if isinstance(a, dict)}


def other_thread_ops(nodes: list[dict]) -> tuple[collections.Counter, int]:
    """(outermost ATen ops run on threads other than the caller's, less the judge's canary multiply; how many
    canary multiplies were seen). The caller is the thread of the session's first multiply (the judge's probe,
    made before the forward); the canary is the last multiply on any other thread."""
    by_id = {n.get("id"): n for n in nodes}
    ops = [n for n in nodes if str(n.get("name", "")).startswith("aten::")]
    muls = sorted((n for n in ops if n["name"] == "aten::mul"), key=lambda n: n.get("id", 0))
    if not muls:
        return collections.Counter(), 0
    caller = _attrs(muls[0]).get("tid")
    canary = [n for n in muls if _attrs(n).get("tid") != caller]

    def outermost(n: dict) -> bool:
        seen, parent = 0, by_id.get(n.get("ctrl_deps"))
        while parent is not None and seen < 10_000:
            if str(parent.get("name", "")).startswith("aten::"):
                return False
            parent, seen = by_id.get(parent.get("ctrl_deps")), seen + 1
        return True

    found: collections.Counter = collections.Counter()
    for n in ops:
        if _attrs(n).get("tid") != caller and n["name"].split("::", 1)[1] not in HARMLESS and outermost(n):
            found[n["name"]] += 1
    if canary:
        found["aten::mul"] -= 1
    return +found, len(canary)


class EveryThread:
    """One observed region: `start()`, the calls, `canary()`, `stop()`, then `verdict(what)`."""

    def __init__(self):
        self.path: str | None = None
        self.probe = _ONES(4)

    def _probe(self) -> None:
        with _NO_GRAD():
            _MUL(self.probe, self.probe)

    def start(self) -> EveryThread:
        fd, path = tempfile.mkstemp(prefix="cuda-agent-ops-", suffix=".json")
        os.close(fd)
        if not _ADD(path):  # another observer is registered (not the judge's): no every-thread audit here
            _UNLINK(path)
            return self
        _ON()
        self.path = path
        self._probe()  # the caller's thread, named by the session's first multiply
        return self

    def canary(self) -> None:
        """The judge's multiply on a thread of its own: an observer that still sees every thread reports it."""
        if self.path is None:
            return
        t = _THREAD(target=self._probe, name="cuda-agent-thread-canary")
        t.start()
        t.join()

    def stop(self) -> None:
        if self.path is not None:
            _OFF()
            _REMOVE()  # writes the trace

    def discard(self) -> None:
        """Stopped and forgotten without a verdict (a timing begun again before its end)."""
        self.stop()
        path, self.path = self.path, None
        if path is not None:
            try:
                _UNLINK(path)
            except OSError:
                pass

    def verdict(self, what: str) -> None:
        if self.path is None:
            return
        path, self.path = self.path, None
        try:
            with _OPEN(path) as f:
                nodes = _LOADS(f.read()).get("nodes", [])
            found, canaries = other_thread_ops(nodes)
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise Reply("dispatch_tampered", f"the every-thread op trace could not be read ({type(e).__name__}: "
                        f"{str(e)[:200]})") from None
        finally:
            try:
                _UNLINK(path)
            except OSError:
                pass
        if canaries < 1:
            raise Reply("dispatch_tampered", "the every-thread op audit missed the multiply the judge ran on a "
                        "thread of its own: the dispatcher's global op callbacks were switched off")
        if found:
            listed = ", ".join(f"{k} ({v}x)" for k, v in sorted(found.items())[:5])
            raise Reply("torch_op_used", f"{what} ran PyTorch ops on a thread other than the caller's: {listed}. "
                        "Compute must run in your kernels, on every thread")
