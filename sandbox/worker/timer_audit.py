"""The timer role's CUDA kernel audit (sandbox/worker/kernel_audit.py): its set-up before any candidate code runs, and
the end of an audited timing (the profiler stopped, the table read, the verdict), given by time_end or deferred to a
time_audit request of its own (sandbox/timing/profile.py runs that once the device is let go)."""

from __future__ import annotations

import collections

from sandbox.worker import kernel_audit
from sandbox.worker.candidate import CandidateRole
from sandbox.worker.inputs import make_inputs, refill_inputs
from sandbox.worker.protocol import CAPTURED
from sandbox.worker.startup import synchronize


class TimerAudit:
    """Mixed into TimerRole: `self._run` is the current timing's state, `self.mod`/`self.device` the task's."""

    def time_audit(self, top: int = 0):
        """The kernel audit of the last timing, when time_end deferred it: the profiler stopped, then (the
        candidate) the verdict and the top-kernel rows. Nothing to do when time_end did it."""
        run = getattr(self, "_run", None)
        if run is None or run.get("prof") is None or "end_profiler_s" in run:
            return {"checks": {}}
        self._stop_profiler(run)
        checks = {"end_profiler_s": run["end_profiler_s"]}
        if not run["candidate"]:
            return {"checks": checks}
        return {"checks": checks, "kernels": self._audit(run, top, checks)}

    def _stop_profiler(self, run: dict) -> None:
        perf = CAPTURED["perf_counter"]
        t0 = perf()
        run["prof"].__exit__(None, None, None)
        # where a timing's end goes (checks.end_*_s): on an H100 under eight judgments the two sides' ends took
        # 0.6-3.1 s of a 1-6 s timing phase, against 0.04-0.16 s of timed batches
        run["end_profiler_s"] = perf() - t0

    def _audit(self, run: dict, top: int, checks: dict) -> list[dict]:
        perf = CAPTURED["perf_counter"]
        checks["audit_setup_s"] = self.audit_setup_s
        t0 = perf()
        kernels = kernel_audit.verdict(self._kernel_table, run["prof"], run["gen_kernels"], run["canary"],
                                       run["calls"], checks, run.get("host_copies", 0))[:top]
        checks["end_audit_s"] = perf() - t0
        return kernels

    def _audit_setup(self, cand: CandidateRole, init_seed: int) -> None:
        """Before any candidate code runs: the kernels input drawing launches (the audit allows them) and
        the canary's calibration, both from code and lists the candidate has not had a chance to patch."""
        t0 = CAPTURED["perf_counter"]()
        self.mod = cand.mod  # the task, which the candidate role loaded under its confinement
        self.gen_kernels = self._generation_kernels(init_seed)
        self.own_kernels = frozenset(cand.own_kernels) or None  # library kernels are foreign, as in verify's audit
        self.audit_canary = kernel_audit.plan(self.device, cand.reference, cand.canary_inputs, self.gen_kernels,
                                              lambda: synchronize(self.device), own=self.own_kernels)
        self.audit_setup_s = CAPTURED["perf_counter"]() - t0

    def _generation_kernels(self, seed: int) -> set[str]:
        """Kernels that drawing the inputs launches: they run between timed calls, not in them."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            refill_inputs(make_inputs(self.mod, seed, self.device), make_inputs(self.mod, seed + 1, self.device))
            synchronize(self.device)
        return {e.key for e in prof.key_averages()}

    def _kernel_table(self, prof, allowed: set[str]) -> tuple[list, collections.Counter]:
        """The audit of the timed run: the rows to show and the foreign kernels' launches (the canary's
        included; _end takes them out, and refuses the run if they are not all there)."""
        return kernel_audit.audit(kernel_audit.table(prof), allowed, getattr(self, "own_kernels", None))
