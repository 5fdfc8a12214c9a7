"""The baseline role: the timer of the reference alone (eager and torch.compile), for sandbox.timing.baseline.

It never loads candidate code and is never a pooled worker, so it is not confined, and where the judge
passed its persistent Inductor/Triton cache (only where Landlock keeps every candidate process away from
it, see sandbox.confinement.filesystem) torch.compile starts from that cache instead of a cold scratch directory.
"""

from __future__ import annotations

import os
import time

from sandbox.confinement.filesystem import COMPILE_CACHE_ENV
from sandbox.worker.protocol import Reply
from sandbox.worker.timer import TimerRole


class BaselineRole(TimerRole):
    TASK_ROLE = "baseline"
    COMPILES = True

    compile_s: float | None = None

    def setup(self, task: str, device: str, init_seed: int, which: str = "reference", compile_mode: str = "default"):
        if which != "reference":
            raise Reply("internal_error", "the baseline role times the reference only")
        return super().setup(task, device, init_seed, "reference", compile_mode)

    def warm(self, variant: str, seed: int):
        first = variant == "compiled" and self.compiled is None
        t = time.perf_counter()
        out = super().warm(variant, seed)
        if first:  # the first compiled call: compilation (from the cache or not) plus one call
            self.compile_s = time.perf_counter() - t
        return out

    def compile_cache(self) -> dict:
        """Which cache torch.compile used, and what it found there (Inductor's and AOTAutograd's counters)."""
        from torch._dynamo.utils import counters

        return {"shared": bool(os.environ.get(COMPILE_CACHE_ENV)), "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
                "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
                "autograd_miss": counters["aot_autograd"]["autograd_cache_miss"], "compile_s": self.compile_s,
                "compile_threads": _compile_threads()}


def _compile_threads() -> int | None:
    import torch._inductor.config as inductor_config

    return inductor_config.compile_threads
