"""The judged role: one process for a candidate's whole judgment, its verify and then its timing.

A judgment that verifies and then profiles started two candidate processes, each creating a CUDA context and
building the model, loading the extension and calibrating its canaries again; under eight judgments on one GPU
those contexts queue in the driver. This role is the candidate role (candidate.py: `run`, `release`, the op
recorder and the op audit, for the verify's trials) inside the timer role (timer.py: the timing protocol and the
kernel audit, for the profile), set up once. Every calibration either side relies on (the op recorder's canary,
the op audit's, the kernel audit's canary and the kernels input drawing launches) is made in the set-up, before
any candidate code runs, as in the two processes it replaces. sandbox/timing/judgment.py drives it; docs/judge.md
says why the timing that follows a verify in the same process measures what a fresh timer would.
"""

from __future__ import annotations

from sandbox.worker.startup import startup_times
from sandbox.worker.timer import TimerRole


class JudgedRole(TimerRole):
    def setup(self, task: str, device: str, init_seed: int, extension: str | None, model_new: str, shm_dir: str,
              record_ops: bool = True, audit_ops: bool = False, own_kernels: list | None = None):
        """The candidate role's set-up message (what verify sends), answered with what a candidate's set-up says."""
        info = super().setup(task, device, init_seed, "candidate", extension=extension, model_new=model_new,
                             shm_dir=shm_dir, checks={"record_ops": record_ops, "audit_ops": audit_ops,
                                                      "own_kernels": own_kernels})
        return {**info, **startup_times()}

    def run(self, seed: int, variant: str = "original", repeat: bool = False, shapes: dict | None = None):
        return self.cand.run(seed, variant, repeat, shapes)

    def again(self):
        return self.cand.again()

    def release(self):
        self.cand.release()
        return super().release()
