"""The policy's forward passes take turns with the judge's timings on a device they share.

A trainer that judges episodes while its policy generates for others puts both on one GPU (or one CPU). The
judge times a candidate with the device to itself (sandbox/timing/device_lock.py: a timing holds the device's
lock exclusively, and every other judge phase that loads the device holds it shared), but a policy generating
beside it held nothing: on an H200, honest elementwise kernels profiled beside bursts of GPU work of another
process were left unscored `timing_noisy` in 10 to 12 of 16 profiles (bench/small_kernels.py --gpu-load), and
a speedup the judge cannot score is a reward the policy never sees.

So each forward pass of the served model holds the device's lock shared, like a verify's trials: passes run
freely beside verifies and each other, and a timing that asks for the device waits only for the pass in flight
(one decoding step, milliseconds) while the passes that follow wait at the lock's turnstile until it is done. The
lock is let go after the pass's work on the device is finished (a synchronize: a decoding step reads its sampled
tokens back anyway), so none of it runs into the timing. The locks are host-wide flock(2) files, so this holds
for a judge in this process (an agentic PPO run) and for one in another (`cuda-agent engine serve` beside MCP
servers). vLLM's engine runs its passes in a process of its own, out of reach of these hooks: give it a GPU of
its own.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from typing import Any

import torch

from sandbox.timing.device_lock import device_lock


class DeviceTurns:
    """Forward hooks on a model: each pass holds `device`'s lock shared. `waited_s` and `passes` say what
    they cost (the seconds passes spent waiting for timings, and how many passes there were)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.waited_s = 0.0
        self.passes = 0
        self._held = threading.local()  # the pass in flight on each thread (continuous batching has its own)
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> DeviceTurns:
        self._handles = [model.register_forward_pre_hook(self._enter),
                         # always_call: a pass that raises still lets the lock go
                         model.register_forward_hook(self._exit, always_call=True)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _enter(self, _module: Any, _args: Any) -> None:
        held: list[AbstractContextManager] = self._held.__dict__.setdefault("stack", [])
        t0 = time.perf_counter()
        lock = device_lock(str(self.device), exclusive=False)
        lock.__enter__()
        held.append(lock)
        self.waited_s += time.perf_counter() - t0
        self.passes += 1

    def _exit(self, _module: Any, _args: Any, _out: Any) -> None:
        held = self._held.__dict__.get("stack")
        if not held:
            return
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            held.pop().__exit__(None, None, None)
