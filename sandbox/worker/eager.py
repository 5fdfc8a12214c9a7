"""The eager role: the reference in a profile, timed as eager in rounds paired with the candidate's
(sandbox/timing/paired.py drives timer.py's protocol on it) and, on the same model, the reference that
the spot-checked timed calls are compared against (reference.py's run and compare).

One process for both keeps a profile at two processes (this and the candidate's timer) and the model once
in memory. It never loads candidate code, so like the reference role it is not confined, and it does not
import torch._dynamo at start-up (the timer role's preload): only a re-calibration under the CUDA kernel
audit's profiler needs it, and pays it then.
"""

from __future__ import annotations

from sandbox.worker.reference import ReferenceRole
from sandbox.worker.timer import TimerRole


class EagerRole(TimerRole):
    TASK_ROLE = "eager"

    def setup(self, task: str, device: str, init_seed: int, shm_dir: str, compile_mode: str = "default"):
        info = super().setup(task, device, init_seed, "reference", compile_mode, shm_dir=shm_dir)
        ref = self._reference = ReferenceRole()
        ref.device, ref.shm_dir, ref.mod, ref.model = self.device, shm_dir, self.mod, self.eager
        if self.device.type == "cuda":
            # a process's first profiler session starts Kineto and CUPTI: paid here, in the set-up beside the
            # candidate's, not in the first begin of the paired timing (the audit's profiler: timer.py), which
            # holds the device exclusively. The candidate's process paid it in its audit's set-up already
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]):
                pass
        return info

    def run(self, seed: int, check_determinism: bool = False, variant: str = "original", shapes: dict | None = None):
        return self._reference.run(seed, check_determinism, variant, shapes)

    def compare(self, outputs: dict, inputs: dict, tolerances: dict, repeat: dict | None = None):
        return self._reference.compare(outputs, inputs, tolerances, repeat)
