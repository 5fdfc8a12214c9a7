"""The worker's side of the pipe protocol: one JSON request per line in, one JSON reply per line out."""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

from sandbox.confinement.nproc import BOUND

CAPTURED = {
    "perf_counter": time.perf_counter,
    "json_dumps": json.dumps,
}


# work a task role leaves for after its reply is out: (name, job). It runs before the next request is read, so it overlaps
# the judge's work on the other process (a verify's reference warms up while the candidate's set-up runs) and never
# a request of this one; its seconds go out with the next reply ("after_reply"). A job that fails is dropped: what it
# prepared is then done on first use, as without it
AFTER_REPLY: list[tuple[str, object]] = []
TASK_ROLES = ("reference", "eager")  # the roles that never load candidate code: only they run AFTER_REPLY's jobs


class Reply(Exception):
    """Raised to answer a request with a failure reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def confinement_state() -> dict:
    """Once candidate code may have run: the confinement and limits it ran under, for failure replies too."""
    from sandbox.worker.startup import CONFINEMENT

    if not CONFINEMENT.get("candidate"):
        return {}
    return {"confinement": CONFINEMENT["applied"], "confinement_notes": CONFINEMENT["notes"],
            "limits": CONFINEMENT["limits"]}


def serve(role_handlers: dict, rfd: int, wfd: int, after_reply: bool = False) -> None:
    """Answer requests until exit. `after_reply`: run AFTER_REPLY's jobs (the task's roles only: in a process that
    runs candidate code nothing runs between its replies, where its outputs wait for the reference's comparison)."""
    rfile = os.fdopen(rfd, "rb")
    wfile = os.fdopen(wfd, "wb")

    def send(obj: dict) -> None:
        wfile.write(CAPTURED["json_dumps"](obj).encode() + b"\n")
        wfile.flush()

    after: dict[str, float] = {}
    for line in rfile:
        msg = json.loads(line)
        op = msg.pop("op")
        if "exchange_uid" in msg:  # the judgment's uid, taken at the role's set-up (sandbox.confinement.nproc.join)
            BOUND["given"] = msg.pop("exchange_uid")
        if op == "exit":
            send({"ok": True})
            break
        # every role's memory peaks, for an out-of-memory verdict's message (sandbox/correctness/oom.py)
        handler = memory_state if op == "memory" else role_handlers.get(op)
        if handler is None:
            send({"ok": False, "reason": "internal_error", "message": f"unknown op {op}"})
            continue
        try:
            t_op = CAPTURED["perf_counter"]()
            result = handler(**msg)
            if after:
                result = {**(result or {}), "after_reply": after}
                after = {}
            # started_at: on Linux perf_counter is CLOCK_MONOTONIC, one clock for every process, so the parent can
            # tell a request's wait to be taken up (a loaded host's scheduler) from its work (diagnostics only)
            send({"ok": True, **(result or {}), "elapsed_s": CAPTURED["perf_counter"]() - t_op, "started_at": t_op})
        except Reply as r:
            send({"ok": False, "reason": r.reason, "message": r.message, **confinement_state()})
            if r.reason in ("cuda_error",):
                break  # the CUDA context is poisoned: stop serving, the parent sees the exit
        except BaseException as e:  # report, never die silently
            reason = classify(e, "runtime_error")
            send({"ok": False, "reason": reason, "message": describe(e), **confinement_state()})
            if reason == "cuda_error":
                break
        while after_reply and AFTER_REPLY:
            name, job = AFTER_REPLY.pop(0)
            t_job = CAPTURED["perf_counter"]()
            try:
                job()
            except Exception:  # noqa: BLE001  (an optional warm-up: the request that needs it does the work itself)
                continue
            after[name] = after.get(name, 0.0) + CAPTURED["perf_counter"]() - t_job
    wfile.flush()
    os._exit(0)


def describe(e: BaseException, limit: int = 3000) -> str:
    if isinstance(e, SyntaxError) and _judge_frames_only(e.__traceback__):
        # a file that does not parse: its name, line and its text are all there is to say; the frames of
        # the judge's import of it are no help to whoever wrote the file
        text = (e.text or "").strip()
        return (f"{type(e).__name__}: {e}" + (f": {text}" if text else ""))[:1500]
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    text = "".join(tb)
    head = f"{type(e).__name__}: {e}"
    if len(text) > limit:
        text = text[: limit // 3] + "\n...\n" + text[-(2 * limit) // 3:]
    return head[:1500] + "\n--- traceback ---\n" + text


def classify(e: BaseException, default: str) -> str:
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "oom"
    text = str(e)
    if "CUDA error" in text or type(e).__name__ in ("AcceleratorError", "CudaError"):
        return "cuda_error"
    return default


def task_reason(e: BaseException) -> str:
    """The reason for the task's own code failing: reference_error, or reference_oom where it ran out of memory (the
    task's footprint, or other work on the device: never the candidate's oom, sandbox/correctness/oom.py)."""
    reason = classify(e, "reference_error")
    return "reference_oom" if reason == "oom" else reason


def memory_state() -> dict:
    """This process's memory peaks: on CUDA the caching allocator's (allocated, reserved) and the device's free and
    total now; everywhere the process's peak resident memory (ru_maxrss, KiB on Linux)."""
    import resource

    out = {"host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        out.update(device_peak_bytes=torch.cuda.max_memory_allocated(dev),
                   device_reserved_peak_bytes=torch.cuda.max_memory_reserved(dev))
        try:
            free, total = torch.cuda.mem_get_info(dev)
            out.update(device_free_bytes=free, device_total_bytes=total)
        except RuntimeError:  # a context past repair: the peaks are still the allocator's
            pass
    return out


def _judge_frames_only(tb) -> bool:
    """Whether every frame of a traceback is the judge's or the import system's (none of the file's author's)."""
    judge = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return all(f.filename.startswith((judge + os.sep, "<frozen")) for f in traceback.extract_tb(tb))
