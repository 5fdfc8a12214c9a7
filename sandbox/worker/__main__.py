"""Entry point: `python -P -m sandbox.worker ROLE READ_FD WRITE_FD` (see sandbox.confinement.processes.Worker),
or `python -P -m sandbox.worker template FD`, the process workers are forked from (sandbox.worker.template)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

# first: it leaves the network namespace and starts the clock before anything imports torch
from sandbox.worker.startup import mark_ready, open_device, preload  # isort: skip

import torch  # noqa: E402

from sandbox.confinement import filesystem  # noqa: E402
from sandbox.worker.protocol import TASK_ROLES, serve  # noqa: E402

# imported when the role is known: the timer's module asks torch whether CUDA is available when it is
# imported, which initialises CUDA, and the template must not (a forked child of a process that did
# cannot use the device)
ROLES = {"reference": ("sandbox.worker.reference", "ReferenceRole"),
         "candidate": ("sandbox.worker.candidate", "CandidateRole"),
         "timer": ("sandbox.worker.timer", "TimerRole"),
         "baseline": ("sandbox.worker.baseline_timer", "BaselineRole"),
         "check": ("sandbox.worker.check", "CheckRole"),
         "synth_probe": ("sandbox.worker.synth_probe", "ProbeRole"),
         "eager": ("sandbox.worker.eager", "EagerRole"),
         "judged": ("sandbox.worker.judged", "JudgedRole"),
         "trace": ("sandbox.worker.trace", "TraceRole")}


def _line(rfd: int) -> dict:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(rfd, 1)
        if not chunk:
            os._exit(0)
        line += chunk
    return json.loads(line)


def _say(wfd: int, msg: dict) -> None:
    with os.fdopen(os.dup(wfd), "wb") as w:
        w.write(json.dumps(msg).encode() + b"\n")
        w.flush()


def _await_role(rfd: int, wfd: int, spec: str) -> str:
    """A pre-started worker: torch imported and the device initialised, no user code run yet. `spec` "cuda:gated":
    the device is opened only when the pool says so ({"op": "open"}, answered with the moment it was opened), which
    it does under the device's shared lock: a CUDA context created beside a timing stalled its batches for seconds.
    A worker handed out before that opens it in its role's set-up, as a worker started for a role does."""
    warm_device, _, gate = spec.partition(":")

    def warm() -> None:
        if warm_device == "cuda" and torch.cuda.is_available():
            open_device("cuda")
        preload()

    if gate != "gated":
        warm()
    msg = _line(rfd)
    if msg.get("op") == "open":
        warm()
        _say(wfd, {"opened_at": time.monotonic()})
        msg = _line(rfd)
    elif gate == "gated":
        preload()  # the device is opened by the role's set-up, under the lock the judgment holds
    _say(wfd, {"ok": True})
    if "exchange_uid" in msg:  # as sandbox.worker.protocol.serve reads it from a request
        from sandbox.confinement.nproc import BOUND

        BOUND["given"] = msg["exchange_uid"]
    return msg["role"]


def run_role(role: str, rfd: int, wfd: int) -> None:
    """Serve one role until the judge says exit; never returns (serve ends the process)."""
    if role.startswith("idle:"):
        role = _await_role(rfd, wfd, role.split(":", 1)[1])
    elif role in ("timer", "baseline", "judged"):  # eager preloads in a profile's set-up: as verify's reference it needs none
        preload()
    module, name = ROLES[role]
    obj = getattr(importlib.import_module(module), name)()
    handlers = {name: getattr(obj, name) for name in dir(obj) if not name.startswith("_") and callable(getattr(obj, name))}
    # the first line the judge reads: when this process could take its first request (Worker.ready_wait)
    # and whether its /dev/shm is its own (the judge then links into it what it must read: Worker.send)
    os.write(wfd, json.dumps({"ready_at": mark_ready(), "private_shm": bool(filesystem.PRIVATE_SHM["host"])}).encode()
             + b"\n")
    serve(handlers, rfd, wfd, after_reply=role in TASK_ROLES)


def main() -> None:
    if sys.argv[1] == "template":
        from sandbox.worker.template import serve_forks

        serve_forks(int(sys.argv[2]), run_role)
    else:
        run_role(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    main()
