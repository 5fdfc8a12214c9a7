"""The eager role: the task's side of a judgment. In a profile it is the reference timed as eager in rounds paired
with the candidate's (sandbox/timing/paired.py drives timer.py's protocol on it) and, on the same model, the
reference that the spot-checked timed calls are compared against (reference.py's run and compare); in a verify it is
the reference the candidate's outputs are compared against.

One process for both keeps a profile at two processes (this and the candidate's timer) and the model once
in memory. It never loads candidate code, so like the reference role it is confined as a task, not as a candidate.
It does not import torch._dynamo at start-up (the timer role's preload): a verify's reference needs none, and a
profile's set-up pays it where the process did not inherit it (started by exec), with the profiler's first start.

Because it never runs candidate code, a process that repeatedly judges keeps it for the next judgment of the same task
(sandbox/confinement/kept.py): `park` drops everything of the judgment it served, and the next `setup` builds the
model again from the text the judge hashed, with that judgment's seed.
"""

from __future__ import annotations

import gc
import os
import resource
import sys

import torch

from sandbox.worker.compare import queue_warm
from sandbox.worker.protocol import Reply, describe, task_reason
from sandbox.worker.reference import ReferenceRole
from sandbox.worker.startup import _STEPS, preload, startup_times
from sandbox.worker.timer import TimerRole

_PROFILER_STARTED = [False]


class EagerRole(TimerRole):
    TASK_ROLE = "eager"

    def setup(self, task: str, device: str, init_seed: int, shm_dir: str, compile_mode: str = "default",
              source: str | None = None, timing: bool = True):
        """`timing`: this process is to time (a profile's), not only compare (a verify's reference)."""
        try:
            info = super().setup(task, device, init_seed, "reference", compile_mode, shm_dir=shm_dir, source=source)
        except Reply:
            raise
        except Exception as e:  # the task's code: the reference's failure, never the candidate's
            raise Reply(task_reason(e), "the reference model failed to build: " + describe(e)) from e
        ref = self._reference = ReferenceRole()
        ref.device, ref.shm_dir, ref.mod, ref.model = self.device, shm_dir, self.mod, self.eager
        if timing and self.device.type == "cuda" and not _PROFILER_STARTED[0]:
            # a process's first profiler session starts Kineto and CUPTI: paid here, in the set-up beside the
            # candidate's, not in the first begin of the paired timing (the audit's profiler: timer.py), which
            # holds the device exclusively. The candidate's process paid it in its audit's set-up already
            from torch.profiler import ProfilerActivity, profile

            if "torch._dynamo" not in sys.modules:  # started by exec (a forked or pooled process has it already)
                preload()
            with profile(activities=[ProfilerActivity.CUDA]):
                pass
            _PROFILER_STARTED[0] = True
        queue_warm(self.device)
        return {**info, "device": str(self.device), **startup_times()}

    def settle(self):
        """Nothing: answered once the work queued after the set-up's reply is done (protocol.AFTER_REPLY), so that a
        profile that lets go of its shared hold without another request to this process (no untimed start ahead)
        first waits for that work, which uses the device."""
        return {}

    def run(self, seed: int, check_determinism: bool = False, variant: str = "original", shapes: dict | None = None):
        return self._reference.run(seed, check_determinism, variant, shapes)

    def compare(self, outputs: dict, inputs: dict, tolerances: dict, repeat: dict | None = None):
        return self._reference.compare(outputs, inputs, tolerances, repeat)

    def park(self):
        """Between judgments: the last one's model, inputs, outputs, spot copies and profiler gone, its device memory
        given back (other judgments' processes share the GPU). The reply says what the keeper retires a process by."""
        run = getattr(self, "_run", None)
        if run is not None and run.get("prof") is not None and "end_profiler_s" not in run:
            self._stop_profiler(run)
        if run is not None:
            run.clear()  # whatever else may still refer to the last timing's state holds nothing of it now
        for name in ("_run", "eager", "compiled", "mod", "keep", "_spots", "_on_device", "_reference", "_fn_now",
                     "audit_canary", "cand"):
            if hasattr(self, name):
                setattr(self, name, None)
        sys.modules.pop("cuda_agent_task", None)
        _STEPS.clear()  # start-up steps are reported once: the next set-up's reply says what it cost itself
        allocated, extra = 0, {}
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # cuBLAS's workspaces stay allocated past the last matmul otherwise
                clear()
            if torch.cuda.memory_allocated(device):
                # held in reference cycles (the task module's functions and its globals): a collection frees them.
                # Only then: a full collection of a torch process takes a tenth of a second, on the judgment's path
                gc.collect()
            torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated(device)
            if allocated:  # what holds it, for the keeper's record (it retires this process)
                live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
                extra = {"cuda_tensors": len(live), "largest": sorted((list(t.shape) for t in live),
                                                                      key=lambda x: -int(torch.Size(x).numel()))[:3]}
            from sandbox.timing import cores  # standard library only

            # threads started while a timing held this process to its timing core (the profiler's) stay there
            # otherwise: every thread goes back to the build cores, as at the process's start
            cores.keep_off_timing_cores()
        use = resource.getrusage(resource.RUSAGE_SELF)
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            fds = None
        cpu_s = use.ru_utime + use.ru_stime
        return {"allocated_bytes": int(allocated), "cpu_s": cpu_s, "open_fds": fds,
                "profiling": bool(torch.autograd._profiler_enabled()), **extra,
                # how much of each limit this process has used: a kept process that reached one would fail a later
                # judgment (a comparison that cannot allocate reads as the candidate's outputs' fault)
                "limits_used": {"cpu": _share(cpu_s, resource.RLIMIT_CPU), "data": _share(_vm_data(), resource.RLIMIT_DATA),
                                "fds": _share(fds, resource.RLIMIT_NOFILE)}}


def _share(used: float | None, which: int) -> float | None:
    soft = resource.getrlimit(which)[0]
    if used is None or soft in (resource.RLIM_INFINITY, 0):
        return None
    return used / soft


def _vm_data() -> int | None:
    """Bytes of this process's data segment, what RLIMIT_DATA bounds."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
