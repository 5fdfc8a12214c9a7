"""Entry point: `python -P -m sandbox.worker ROLE READ_FD WRITE_FD` (see sandbox.confinement.processes.Worker)."""

from __future__ import annotations

import json
import os
import sys

# first: it leaves the network namespace and starts the clock before anything imports torch
from sandbox.worker.startup import open_device, preload  # isort: skip

import torch  # noqa: E402

from sandbox.worker.baseline_timer import BaselineRole  # noqa: E402
from sandbox.worker.candidate import CandidateRole  # noqa: E402
from sandbox.worker.check import CheckRole  # noqa: E402
from sandbox.worker.eager import EagerRole  # noqa: E402
from sandbox.worker.protocol import serve  # noqa: E402
from sandbox.worker.reference import ReferenceRole  # noqa: E402
from sandbox.worker.synth_probe import ProbeRole  # noqa: E402
from sandbox.worker.timer import TimerRole  # noqa: E402
from sandbox.worker.trace import TraceRole  # noqa: E402

ROLES = {"reference": ReferenceRole, "candidate": CandidateRole, "timer": TimerRole, "baseline": BaselineRole,
         "eager": EagerRole, "check": CheckRole, "synth_probe": ProbeRole, "trace": TraceRole}


def _await_role(rfd: int, wfd: int, warm_device: str) -> str:
    """A pre-started worker: torch imported and the device initialised, no user code run yet."""
    if warm_device == "cuda" and torch.cuda.is_available():
        open_device("cuda")
    preload()
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(rfd, 1)
        if not chunk:
            os._exit(0)
        line += chunk
    msg = json.loads(line)
    with os.fdopen(os.dup(wfd), "wb") as w:
        w.write(b'{"ok": true}\n')
        w.flush()
    return msg["role"]


def main() -> None:
    role, rfd, wfd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if role.startswith("idle:"):
        role = _await_role(rfd, wfd, role.split(":", 1)[1])
    elif role in ("timer", "baseline"):
        preload()
    obj = ROLES[role]()
    handlers = {name: getattr(obj, name) for name in dir(obj) if not name.startswith("_") and callable(getattr(obj, name))}
    serve(handlers, rfd, wfd)


if __name__ == "__main__":
    main()
