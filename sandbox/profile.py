"""profile: time the reference (eager and torch.compile) and ModelNew on the same device.

Each model is timed in its own fresh process, one process at a time so timings stay clean. The
reference's times are cached per task content, device, torch version, compile mode and timing
protocol, so the tenth profile of an episode does not recompile the baseline.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from sandbox.compile import extension_path
from sandbox.config import ProfileConfig, VerifyConfig, cache_dir
from sandbox.isolation import Session, WorkerError
from sandbox.results import KernelStat, ProfilerCost, ProfileResult, Reason, Timing
from sandbox.verify import _reason, _tolerances, device_for, new_seed, preflight
from sandbox.workspace import Workspace

PROTOCOL_VERSION = 3  # fresh input values per timed call, in the same tensors


def _timing_cfg(cfg: ProfileConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("warmup_ms", "min_warmup_calls", "target_ms", "min_trials", "max_trials",
                                         "audit_timed_calls")}


def baseline_key(task_sha: str, device_name: str, torch_version: str, backend: str, cfg: ProfileConfig) -> str:
    parts = [task_sha, device_name, torch_version, backend, cfg.compile_mode, str(PROTOCOL_VERSION),
             json.dumps(_timing_cfg(cfg), sort_keys=True), os.environ.get("CUDA_VISIBLE_DEVICES", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _cache_file(key: str) -> Path:
    return cache_dir() / "baselines" / f"{key}.json"


def _load_cached(key: str) -> dict | None:
    path = _cache_file(key)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _store(key: str, data: dict) -> None:
    path = _cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _device_identity(backend: str) -> tuple[str, str]:
    """(device name, torch version) without importing torch in this process: from the toolchain probe."""
    from sandbox.toolchain import get_toolchain

    tc = get_toolchain(backend)
    name = tc.device_name or ("cpu" if backend == "cpu" else "cuda")
    if backend == "cpu":
        import platform

        name = f"cpu:{platform.machine()}:{os.cpu_count()}"
    return name, tc.torch_version


def profile_workspace(ws: Workspace, config: ProfileConfig | None = None) -> ProfileResult:
    cfg = config or ProfileConfig()
    t0 = time.perf_counter()
    restored, _, err = preflight(ws)
    base = dict(backend=ws.backend, compile_mode=cfg.compile_mode, restored_files=restored)
    if err:
        reason, _, msg = err.partition(":")
        return ProfileResult(ok=False, reason=Reason(reason), message=msg, duration_s=time.perf_counter() - t0, **base)
    device = device_for(ws.backend)
    try:
        device_name, torch_version = _device_identity(ws.backend)
    except RuntimeError as e:  # the machine's setup, not the agent's code
        return ProfileResult(ok=False, reason=Reason.internal_error, message=str(e)[-3000:],
                             duration_s=time.perf_counter() - t0, **base)
    key = baseline_key(ws.meta.task_sha256, device_name, torch_version, ws.backend, cfg)
    timing_cfg = _timing_cfg(cfg)
    task = str(ws.reference_path)
    cached = _load_cached(key) if cfg.use_cache else None
    out: dict = {"device": device_name, "torch_version": torch_version, "baseline_cached": cached is not None}

    def result(ok: bool, reason: Reason | None = None, message: str = "") -> ProfileResult:
        return ProfileResult(ok=ok, reason=reason, message=message, duration_s=time.perf_counter() - t0,
                             **out, **base)

    init_seed = new_seed()
    seed = new_seed()
    try:
        if cached is None:
            with Session(device) as s:
                w = s.spawn("timer")
                r = w.request("setup", cfg.setup_timeout_s, "building the reference", task=task, device=device,
                              init_seed=init_seed, which="reference", compile_mode=cfg.compile_mode)
                if not r["ok"]:
                    return result(False, Reason.reference_error, r["message"])
                r = w.request("time", cfg.timing_timeout_s, "timing the reference (eager)", variant="eager",
                              seed=seed, cfg=timing_cfg)
                if not r["ok"]:
                    return result(False, Reason.reference_error, r["message"])
                cached = {"eager": r["timing"], "compiled": None, "compile_error": None,
                          "device": device_name, "torch_version": torch_version, "created": time.time()}
                r = w.request("time", cfg.baseline_timeout_s, "timing the reference under torch.compile",
                              variant="compiled", seed=seed, cfg=timing_cfg)
                if r["ok"]:
                    cached["compiled"] = r["timing"]
                else:
                    cached["compile_error"] = r["message"][:2000]
            _store(key, cached)
        out["eager"] = Timing(**cached["eager"])
        out["compiled"] = Timing(**cached["compiled"]) if cached.get("compiled") else None
        out["compile_error"] = cached.get("compile_error")
        with Session(device) as s:
            w = s.spawn("timer")
            # the reference process checks timed outputs; it starts now, and idles while timing runs
            ref = s.spawn("reference") if cfg.spot_checks else None
            if ref is not None:
                ref.send("setup", task=task, device=device, init_seed=init_seed, shm_dir=str(s.dir))
            r = w.request("setup", cfg.setup_timeout_s, "loading the extension and building ModelNew", task=task,
                          device=device, init_seed=init_seed, which="candidate", shm_dir=str(s.dir),
                          extension=str(extension_path(ws)), model_new=str(ws.root / "model_new.py"))
            if not r["ok"]:
                return result(False, _reason(r["reason"], Reason.init_error), r["message"])
            if ref is not None:
                rr = ref.recv(cfg.setup_timeout_s, "building the reference")
                if not rr["ok"]:
                    return result(False, Reason.reference_error, rr["message"])
            r = w.request("time", cfg.timing_timeout_s, "timing ModelNew", variant="candidate", seed=seed,
                          cfg=timing_cfg, spot_checks=cfg.spot_checks, top=cfg.top_kernels)
            if not r["ok"]:
                return result(False, _reason(r["reason"], Reason.runtime_error), r["message"])
            out["candidate"] = Timing(**r["timing"])
            out["checks"] = r.get("checks", {})
            for i, spot in enumerate(r.get("spots", [])):
                what = f"spot check {i + 1} of the timed calls"
                rr = ref.request("run", cfg.timing_timeout_s, f"the reference for {what}", seed=spot["seed"])
                if not rr["ok"]:
                    return result(False, Reason.reference_error, rr["message"])
                cmp = ref.request("compare", cfg.timing_timeout_s, what, outputs=spot["outputs"],
                                  inputs={"kind": "none"}, tolerances=_tolerances(VerifyConfig()))
                bad = [c for c in cmp.get("checks", []) if not c.get("ok")] if cmp["ok"] else [cmp]
                if bad:
                    return result(False, Reason.spot_check_failed,
                                  f"a timed call returned a wrong answer ({bad[0].get('message', '')}): the timed "
                                  "calls must compute the same thing as the verified ones")
            if cfg.top_kernels:
                if "kernels" in r:
                    out["top_kernels"] = [KernelStat(**k) for k in r["kernels"]]
                else:
                    k = w.request("kernels", cfg.timing_timeout_s, "profiling ModelNew's kernels", seed=seed,
                                  top=cfg.top_kernels)
                    if k["ok"]:
                        out["top_kernels"] = [KernelStat(**x) for x in k["kernels"]]
                        out["profiler"] = ProfilerCost(**k["profiler"])
    except WorkerError as e:
        return result(False, _reason(e.reason, Reason.crash), e.message)
    cand = out["candidate"].median_ms
    out["speedup_vs_eager"] = out["eager"].median_ms / cand if cand > 0 else None
    if out["compiled"] is not None and cand > 0:
        out["speedup_vs_compile"] = out["compiled"].median_ms / cand
    msg = f"ModelNew {cand:.4g} ms vs eager {out['eager'].median_ms:.4g} ms ({out['speedup_vs_eager']:.2f}x)"
    if out.get("speedup_vs_compile") is not None:
        msg += f", torch.compile {out['compiled'].median_ms:.4g} ms ({out['speedup_vs_compile']:.2f}x)"
    return result(True, None, msg)
