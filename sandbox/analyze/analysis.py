"""analyze: the candidate's forward under Nsight Compute, read as a roofline and a few ranked bottleneck sentences.

Advice, never a reward: ncu replays each kernel with its caches flushed, so its durations are not the profile's, and
nothing here feeds the milestones. The analysed process is confined as a candidate's worker is (sandbox.analyze.
target); it holds the device's lock shared, as a verify does, so it never runs inside (or beside) a timing, and one
analysis at a time runs on a device (two ncu processes cannot read one GPU's counters at once). Its result is cached
by the build's content, the task, the device and the settings: asking twice costs a file read.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

from pydantic import BaseModel, Field

from sandbox.analyze import ncu_csv, ncu_run, roofline, rules
from sandbox.analyze.result import AnalyzeLimits, AnalyzeResult, KernelAnalysis, TorchKernelRow, Unavailable
from sandbox.backend import device_for
from sandbox.build.compile import extension_path
from sandbox.config import cache_dir
from sandbox.correctness.verify import new_seed, preflight
from sandbox.results import Reason
from sandbox.workspace import Workspace

VERSION = "1"  # part of the cache key: a change of rules or metrics makes earlier analyses stale


class AnalyzeConfig(BaseModel):
    max_kernels: int = Field(48, ge=2, le=500, description="kernels ncu profiles at most, both sides together")
    kernels: int = Field(5, ge=1, le=50, description="kernels kept per side in the result, largest first")
    timeout_s: float = Field(180.0, gt=0, description="the analysis is killed past this")
    attach_s: float = Field(60.0, gt=0, description="under ncu, the analysed process is given up when its device has "
                            "not opened within this (ncu's library in it could not reach ncu)")
    replay_mode: str = Field("kernel", pattern="^(kernel|application)$")
    eager: bool = Field(True, description="analyse the reference's eager kernels of the same forward too")
    use_cache: bool = True


def analyze_workspace(ws: Workspace, config: AnalyzeConfig | None = None) -> AnalyzeResult:
    cfg = config or AnalyzeConfig()
    t0 = time.perf_counter()
    restored, _, err = preflight(ws, True)
    base = dict(backend=ws.backend, restored_files=restored)
    if err:
        reason, _, msg = err.partition(":")
        return AnalyzeResult(ok=False, reason=Reason(reason), message=msg, duration_s=time.perf_counter() - t0, **base)
    device_name = _device_name(ws.backend)
    ncu = ncu_run.find_ncu() if ws.backend == "cuda" else None
    version = ncu_run.ncu_version(ncu) if ncu else None
    key = cache_key(ws, device_name, version, cfg)
    base.update(device=device_name, ncu_version=version, key=key)
    if cfg.use_cache and (hit := _cached(key)) is not None:
        return hit.model_copy(update=dict(cached=True, duration_s=time.perf_counter() - t0, restored_files=restored,
                                          compiled_kernels=compiled_kernels(ws)))
    request = dict(task=str(ws.reference_path), extension=str(extension_path(ws)), model_new=str(ws.root / "model_new.py"),
                   device=device_for(ws.backend), seed=new_seed(), eager=cfg.eager)
    limits = AnalyzeLimits(max_kernels=cfg.max_kernels, replay_mode=cfg.replay_mode, sections=list(ncu_run.SECTIONS),
                           timeout_s=cfg.timeout_s)
    if ws.backend != "cuda":
        result = _fallback(request, cfg, base, Unavailable.cpu_backend,
                           "the CPU backend has no hardware counters for ncu to read", t0)
    elif ncu is None:
        result = _fallback(request, cfg, base, Unavailable.no_ncu, "Nsight Compute (ncu) is not installed here "
                           f"(not on PATH; ${ncu_run.NCU_ENV} names one)", t0)
    else:
        result = _with_ncu(request, ncu, cfg, base, limits, device_name, t0)
    # kept: an analysis, or the fallback's table where the cause cannot change without a new key (the backend, an
    # ncu installed later); not a failure, a timeout, or counters an administrator may open
    if cfg.use_cache and (result.ok or (result.unavailable in (Unavailable.cpu_backend, Unavailable.no_ncu)
                                        and result.reason is None and result.fallback)):
        _store(key, result)
    return result.model_copy(update=dict(compiled_kernels=compiled_kernels(ws)))


def compiled_kernels(ws: Workspace) -> list[TorchKernelRow]:
    """torch.compile's top kernels of the task, from the baseline a profile with the default settings measured on
    this device and kept (sandbox.timing.baseline); none where no profile has yet. Read at each call, so an analysis
    cached before the baseline existed shows them once it does."""
    from sandbox.config import ProfileConfig
    from sandbox.timing.baseline import baseline_key, load_cached
    from sandbox.timing.profile import device_identity

    try:
        device, torch_version = device_identity(ws.backend)
        cached = load_cached(baseline_key(ws.meta.task_sha256, device, torch_version, ws.backend, ProfileConfig()))
    except (OSError, RuntimeError, ValueError):
        return []
    rows = (cached or {}).get("compiled_kernels") or []
    return [TorchKernelRow(name=r["name"], total_us=1000.0 * r["total_ms"], calls=r["calls"]) for r in rows]


def _device_name(backend: str) -> str | None:
    from sandbox.build.toolchain import get_toolchain

    try:
        return get_toolchain(backend).device_name or backend
    except RuntimeError:
        return backend


def cache_key(ws: Workspace, device: str | None, ncu_version: str | None, cfg: AnalyzeConfig) -> str:
    """The build's content (the extension and model_new.py), the task, the device, ncu and the settings."""
    h = hashlib.sha256()
    for path in (extension_path(ws), ws.root / "model_new.py"):
        h.update(hashlib.sha256(path.read_bytes()).digest())
    settings = cfg.model_dump(exclude={"use_cache", "timeout_s", "attach_s"})
    h.update(json.dumps([VERSION, ws.meta.task_sha256, ws.backend, device, ncu_version, settings],
                        sort_keys=True).encode())
    return h.hexdigest()[:32]


def _cache_file(key: str) -> Path:
    return Path(cache_dir()) / "analyze" / f"{key}.json"


def _cached(key: str) -> AnalyzeResult | None:
    try:
        return AnalyzeResult.model_validate_json(_cache_file(key).read_text())
    except (OSError, ValueError):
        return None


def _store(key: str, result: AnalyzeResult) -> None:
    path = _cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(result.model_dump_json())
    os.replace(tmp, path)


def _device_hold(device: str):
    """The device's lock shared (never beside a timing), and this device's one analysis at a time."""
    from sandbox.timing.device_lock import device_key, device_lock, file_lock, lock_dir

    stack = ExitStack()
    stack.enter_context(file_lock(lock_dir() / f"analyze-{device_key(device)}"))
    stack.enter_context(device_lock(device, exclusive=False))
    return stack


def _candidate_failure(run: ncu_run.Run) -> tuple[Reason, str] | None:
    """The candidate's own failure (its import, its forward), read from the target's reply."""
    r = run.reply
    if r is None or r.get("ok"):
        return None
    try:
        reason = Reason(r.get("reason", "runtime_error"))
    except ValueError:
        reason = Reason.runtime_error
    return reason, r.get("message", "")


def _with_ncu(request: dict, ncu: str, cfg: AnalyzeConfig, base: dict, limits: AnalyzeLimits,
              device_name: str | None, t0: float) -> AnalyzeResult:
    with _device_hold(request["device"]):
        run = ncu_run.launch(dict(request, mode="ncu"), ncu, cfg.timeout_s, cfg.max_kernels, cfg.replay_mode,
                             cfg.attach_s)
    notes = _notes(run.reply)
    if run.stalled:
        return _fallback(request, cfg, base, Unavailable.ncu_failed, "the analysed process did not open its device "
                         f"under ncu within {cfg.attach_s:.0f} s (ncu's library could not reach ncu: its network namespace? "
                         f"{ncu_run.NETNS_ENV}=none runs both in the host's); killed", t0, limits)
    if run.timed_out:
        return AnalyzeResult(ok=False, unavailable=Unavailable.timeout, limits=limits, sandbox_notes=notes,
                             message=f"the analysis did not finish within {cfg.timeout_s:.0f} s and was killed",
                             duration_s=time.perf_counter() - t0, **base)
    if (failed := _candidate_failure(run)) is not None:
        return AnalyzeResult(ok=False, reason=failed[0], message=failed[1], limits=limits, sandbox_notes=notes,
                             duration_s=time.perf_counter() - t0, **base)
    why = ncu_csv.failure(run.ncu_text + "\n" + run.output)
    try:
        kernels = ncu_csv.parse(run.ncu_text)
    except ncu_csv.NcuError as e:
        kind, message = why or ("ncu_failed", f"{e}; ncu's output ends:\n{(run.ncu_text or run.output)[-1500:]}")
        return _fallback(request, cfg, base, Unavailable(kind), message, t0, limits)
    result = from_kernels(kernels, device_name, cfg, limits)
    result.sandbox_notes = notes
    return result.model_copy(update=dict(duration_s=time.perf_counter() - t0, **base))


def from_kernels(kernels: list[ncu_csv.NcuKernel], device: str | None, cfg: AnalyzeConfig,
                 limits: AnalyzeLimits) -> AnalyzeResult:
    """The result from ncu's kernels in launch order: eager's before the first marker, the candidate's after it."""
    limits = limits.model_copy(update={"truncated": len(kernels) >= cfg.max_kernels})
    marks = [i for i, k in enumerate(kernels) if ncu_run.MARKER in k.name]
    if marks:
        eager, cand = kernels[: marks[0]], [k for k in kernels[marks[0] + 1:] if ncu_run.MARKER not in k.name]
    else:  # no marker: the candidate's range never ran (the limit was spent on eager's), or eager was off
        eager, cand = (kernels, []) if cfg.eager else ([], kernels)
    sides = {name: _side(ks, name, device, cfg.kernels) for name, ks in (("candidate", cand), ("eager", eager))}
    if not sides["candidate"]:
        msg = ("ncu profiled none of ModelNew's kernels: " + (f"the limit of {cfg.max_kernels} kernels was spent on "
               "the reference's" if limits.truncated else "its forward launched no kernel"))
        return AnalyzeResult(ok=False, unavailable=Unavailable.ncu_failed, message=msg, eager_kernels=sides["eager"],
                             limits=limits, backend="cuda", duration_s=0.0)
    return AnalyzeResult(ok=True, summary=summary(sides["candidate"]), kernels=sides["candidate"],
                         eager_kernels=sides["eager"], limits=limits, backend="cuda", duration_s=0.0,
                         message=f"{len(cand)} kernel launch(es) of ModelNew analysed, {len(eager)} of eager")


def _side(kernels: list[ncu_csv.NcuKernel], side: str, device: str | None, keep: int) -> list[KernelAnalysis]:
    total = sum(k.get("gpu__time_duration.sum") or 0.0 for k in kernels)
    out = [rules.apply(roofline.analyse(k, side, device, total)) for k in kernels]
    out.sort(key=lambda a: -a.duration_us)
    return out[:keep]


def summary(kernels: list[KernelAnalysis], limit: int = 4) -> list[str]:
    """The ranked sentences a model reads first: the top kernel's, then the headline of any other kernel that takes
    a fifth of the time or more."""
    if not kernels:
        return []
    top = kernels[0]
    lines = [f"{top.name[:80]} ({top.share:.0%} of ModelNew's kernel time, {top.duration_us:.1f} us): "
             f"{top.bottleneck[0]}"] + top.bottleneck[1:]
    for k in kernels[1:]:
        if k.share >= 0.2 and k.bottleneck:
            lines.append(f"{k.name[:80]} ({k.share:.0%}): {k.bottleneck[0]}")
    return lines[:limit]


def _notes(reply: dict | None) -> list[str]:
    if not reply:
        return []
    notes = list(reply.get("confinement_notes") or []) + list(reply.get("limits") or [])
    if reply.get("confinement"):
        notes.insert(0, f"confinement: {reply['confinement']}")
    if reply.get("network_isolated") is False:
        notes.append("the analysed process kept the host's network (no network namespace)")
    return notes


def _rows(table: list[dict]) -> list[TorchKernelRow]:
    return [TorchKernelRow(**r) for r in table]


def _fallback(request: dict, cfg: AnalyzeConfig, base: dict, why: Unavailable, message: str, t0: float,
              limits: AnalyzeLimits | None = None) -> AnalyzeResult:
    """No counters: the structured reason, and torch.profiler's table of the same forward (the candidate's and
    eager's), made in the same confined process."""
    hold = _device_hold(request["device"]) if request["device"].startswith("cuda") else ExitStack()
    with hold:
        run = ncu_run.launch(dict(request, mode="torch"), None, cfg.timeout_s)
    notes = _notes(run.reply)
    out = dict(ok=False, unavailable=why, limits=limits, sandbox_notes=notes, **base)
    if run.timed_out:
        return AnalyzeResult(message=message + f"; the torch profiler's fallback did not finish within "
                             f"{cfg.timeout_s:.0f} s", duration_s=time.perf_counter() - t0, **out)
    if (failed := _candidate_failure(run)) is not None:
        return AnalyzeResult(reason=failed[0], message=failed[1], duration_s=time.perf_counter() - t0,
                             **{**out, "unavailable": why})
    sides = (run.reply or {}).get("sides", {})
    if run.reply is None:
        message += f"; the torch profiler's fallback wrote no table: {run.output[-1500:]}"
    return AnalyzeResult(message=message, fallback=_rows(sides.get("candidate", [])),
                         fallback_eager=_rows(sides.get("eager", [])), duration_s=time.perf_counter() - t0, **out)
