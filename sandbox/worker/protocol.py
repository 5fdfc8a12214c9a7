"""The worker's side of the pipe protocol: one JSON request per line in, one JSON reply per line out."""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

CAPTURED = {
    "perf_counter": time.perf_counter,
    "json_dumps": json.dumps,
}


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


def serve(role_handlers: dict, rfd: int, wfd: int) -> None:
    rfile = os.fdopen(rfd, "rb")
    wfile = os.fdopen(wfd, "wb")

    def send(obj: dict) -> None:
        wfile.write(CAPTURED["json_dumps"](obj).encode() + b"\n")
        wfile.flush()

    for line in rfile:
        msg = json.loads(line)
        op = msg.pop("op")
        if op == "exit":
            send({"ok": True})
            break
        handler = role_handlers.get(op)
        if handler is None:
            send({"ok": False, "reason": "internal_error", "message": f"unknown op {op}"})
            continue
        try:
            t_op = CAPTURED["perf_counter"]()
            result = handler(**msg)
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
    wfile.flush()
    os._exit(0)


def describe(e: BaseException, limit: int = 3000) -> str:
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
