"""Verify a task's reference against itself through the real judge.

A task whose reference cannot pass its own verification (it fails to build, runs out of memory,
or is nondeterministic, e.g. dropout left active) cannot judge anyone; find those up front.
"""

from __future__ import annotations

import time
from pathlib import Path

from sandbox.config import VerifyConfig
from sandbox.confinement.environment import handoff_dir
from sandbox.correctness.verify import run_verification
from sandbox.results import VerifyResult
from tasks import Task

_SHIM = '''import importlib.util as _u

_spec = _u.spec_from_file_location("cuda_agent_selfref", {path!r})
_mod = _u.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
ModelNew = _mod.Model
'''


def self_verify(task: Task, backend: str, trials: int = 2, timeout_s: float = 300.0) -> VerifyResult:
    t0 = time.perf_counter()
    scratch = handoff_dir()
    try:
        ref = Path(scratch) / "reference.py"
        ref.write_text(task.source)
        shim = Path(scratch) / "model_new.py"
        shim.write_text(_SHIM.format(path=str(ref)))
        cfg = VerifyConfig(trials=trials, forbid_torch_ops=False, setup_timeout_s=timeout_s, trial_timeout_s=timeout_s)
        base = dict(backend=backend, atol=cfg.atol, rtol=cfg.rtol)
        return run_verification(str(ref), None, str(shim), "cuda" if backend == "cuda" else "cpu", cfg, base, t0,
                                check_determinism=True)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
