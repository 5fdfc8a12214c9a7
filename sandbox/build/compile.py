"""Build a workspace's kernels into the `cuda_extension` module with ninja.

We write the ninja file ourselves (paths and flags from torch.utils.cpp_extension via the cached
toolchain probe) so that: the fixed infrastructure object is compiled once per toolchain and shared
by every workspace; .cu files get no torch-imposed half-precision macros; paths are relative, so a
copied workspace stays up to date; and the build runs in its own process group with a timeout.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from sandbox.build import jail, pybind_interface
from sandbox.build.diagnostics import parse_diagnostics

# the shared infrastructure and ninja's running, re-exported: callers and tests name them through this module
from sandbox.build.infra_cache import (  # noqa: F401
    INFRA_SECTIONS,
    INFRA_TIMEOUT_S,
    infra_header,
    infra_object,
    infrastructure,
    link_stub_folder,
    object_cache,
    pybind_header_list,
    thin_header,
)
from sandbox.build.ninja_file import (
    EXTENSION_FILE,
    FULL_MARK,
    jail_env,
    object_name,
    write_build_file,
)
from sandbox.build.ninja_run import BUILD_NICE, _ninja, _run_ninja, build_placement  # noqa: F401
from sandbox.build.objcache import HIT_MARK
from sandbox.build.toolchain import get_toolchain
from sandbox.config import CompileConfig
from sandbox.confinement.processes import start_daemon_early
from sandbox.results import CompileResult, Reason
from sandbox.scan import object_scan, symbol_scan
from sandbox.timing.device_lock import file_lock
from sandbox.workspace import Workspace, WorkspaceError

PLAIN_MARK = ".plain-header"  # in a build folder: its bindings needed the plain header once (pybind_interface)
PLAIN_NOTE = ("cuda-agent: a binding needed a pybind11 member that the shared infrastructure object does not hold; "
              "the bindings were compiled again against the plain header\n")


def _steps(ws: Workspace, offset: int) -> dict[str, float]:
    """Seconds each step of the last ninja run took, from the lines it appended to .ninja_log after `offset`
    (its size before the run). Empty when ninja rewrote the log in that run (it compacts it now and then)."""
    path = ws.build_dir / ".ninja_log"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset:
                return {}
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    names = {object_name(src.relative_to(ws.root).as_posix()): src.relative_to(ws.root).as_posix()
             for src in ws.sources()} | {EXTENSION_FILE: "link"}
    out: dict[str, float] = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) == 5 and parts[3] in names and parts[0].isdigit() and parts[1].isdigit():
            out[names[parts[3]]] = (int(parts[1]) - int(parts[0])) / 1000
    return out


def _reused_sources(log: str) -> list[str]:
    return [m.group(1) for m in re.finditer("^" + re.escape(HIT_MARK) + r"\.\./(\S+)$", log, re.M)]


def _rebuilt_sources(log: str) -> list[str]:
    out = []
    for m in re.finditer(r"^\[\d+/\d+\] (?:CXX|NVCC) \.\./(\S+)$", log, re.M):
        out.append(m.group(1))
    return out


def _full_sources(log: str) -> list[str]:
    # sorted: ninja finishes the compiles in any order, and the result (and the note that names them) should not
    return sorted({m.group(1) for m in re.finditer("^" + re.escape(FULL_MARK) + r"\.\./(\S+)$", log, re.M)})


def _first_error(log: str) -> str:
    """The line of a build log that says why it failed, where no diagnostic was parsed: ninja's own error, else
    the first line that speaks of an error (an assembler's, a launcher's), else the last line of output."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("ninja: error:")]
    said = said or [ln for ln in lines if "error" in ln.lower() and not ln.startswith(("ninja: ", "FAILED: "))]
    return (said or lines or ["no output"])[0 if said else -1]


def compile_workspace(ws: Workspace, config: CompileConfig | None = None) -> CompileResult:
    cfg = config or CompileConfig()
    t0 = time.perf_counter()
    start_daemon_early()  # the verify that follows a build finds its workers' template ready
    try:
        restored = ws.ensure_protected()
    except WorkspaceError as e:
        return CompileResult(ok=False, reason=Reason.protected_file_tampered, message=str(e),
                             backend=ws.backend, duration_s=time.perf_counter() - t0)

    def fail(reason: Reason, message: str, **kw) -> CompileResult:
        return CompileResult(ok=False, reason=reason, message=message, backend=ws.backend,
                             duration_s=time.perf_counter() - t0, restored_files=restored, **kw)

    try:
        sources = ws.sources()
    except WorkspaceError as e:
        return fail(Reason.compile_error, str(e))
    if not sources:
        exts = ".cu/.cpp" if ws.backend == "cuda" else ".cpp"
        return fail(Reason.compile_error, f"no sources: put your kernels in kernels/*{exts} (see SKILL.md)")
    try:
        tc = get_toolchain(ws.backend)
        if ws.backend == "cuda" and not (tc.nvcc and os.path.exists(tc.nvcc)):
            return fail(Reason.compile_error, "nvcc was not found; the cuda backend needs the CUDA toolkit")
        plain = (ws.build_dir / PLAIN_MARK).exists() or not cfg.pybind_interface
        infra, pch = infrastructure(tc, INFRA_TIMEOUT_S, cfg.precompiled_header, interface=not plain)
        thin_pch = thin_header(tc, INFRA_TIMEOUT_S) if cfg.thin_bindings and cfg.precompiled_header else None
        objects = object_cache(tc, cfg.object_cache_dir) if cfg.object_cache else None
        stubs = link_stub_folder(tc)
    except RuntimeError as e:  # the machine's setup, not the agent's code
        return fail(Reason.internal_error, str(e)[-3000:])
    # a build loads the host's cores, and timings need them: a CPU timing runs on them, and on CUDA a small
    # kernel's time is the host's launch latency (the judge's wall-clock bound reads a loaded host as a
    # forged timer). On CUDA the build is kept off the timing cores (cores.build_cores) and runs beside
    # timings; elsewhere, or where too few cores are left, it holds the device lock shared, as verify does:
    # builds run side by side, never beside a timing (docs/judge.md, "Judging in parallel")
    cpus, lock = build_placement(ws.backend)
    with file_lock(ws.build_dir / ".lock"), lock:
        try:
            write_build_file(ws, tc, infra, pch, objects, cfg.thin_bindings, thin_pch, stubs,
                             _cache_limit(cfg))
        except WorkspaceError as e:  # a source named against the rule, or linking out, that came after the check
            return fail(Reason.compile_error, str(e))
        except RuntimeError as e:
            return fail(Reason.internal_error, str(e))
        log_path = ws.build_dir / "compile.log"
        ninja_log = ws.build_dir / ".ninja_log"
        offset = ninja_log.stat().st_size if ninja_log.is_file() else 0
        usage: dict[str, float] = {}
        rc, log = _run_ninja(ws.build_dir, log_path, cfg.timeout_s, cfg.jobs, jail_env(ws, tc, infra), cpus, usage)
        if pch is not None and _needs_plain_header(ws, pch, rc, log):
            # a binding needs a pybind11 member the infrastructure object does not hold: this workspace's
            # bindings are compiled against the plain header from now on (pybind_interface)
            (ws.build_dir / PLAIN_MARK).touch()
            pch = infra_header(tc, INFRA_TIMEOUT_S, interface=False)
            try:
                write_build_file(ws, tc, infra, pch, objects, cfg.thin_bindings, thin_pch, stubs,
                                 _cache_limit(cfg))
            except (WorkspaceError, RuntimeError) as e:
                return fail(Reason.internal_error, str(e))
            left = max(1.0, cfg.timeout_s - (time.perf_counter() - t0))  # one build's limit covers both
            rc, log = _run_ninja(ws.build_dir, log_path, left, cfg.jobs, jail_env(ws, tc, infra), cpus, usage)
            log = PLAIN_NOTE + log
        steps = _steps(ws, offset)
    diagnostics = parse_diagnostics(log, ws.build_dir, ws.root)[: cfg.max_diagnostics]
    tail = log[-cfg.log_tail_chars:]
    common = dict(diagnostics=diagnostics, log_tail=tail, log_path=str(log_path), rebuilt=_rebuilt_sources(log),
                  reused=_reused_sources(log), steps=steps, full_bindings=_full_sources(log), cpu_s=usage.get("cpu_s"))
    if rc is None:
        return fail(Reason.compile_timeout, f"the build took longer than {cfg.timeout_s:.0f} s and was killed "
                    "(heavy templates or unrolling? simplify, or raise the compile timeout)", **common)
    if rc != 0 and object_scan.FORBIDDEN_MARK in log:  # the agent's objects were refused before the link
        said = log[log.index(object_scan.FORBIDDEN_MARK) + len(object_scan.FORBIDDEN_MARK):].split("\n", 1)[0]
        return fail(Reason.forbidden_symbol, said, **common)
    if rc != 0:
        limited = jail.limit_message(log)  # a tool stopped by the jail's memory or file-size limit
        if limited:
            return fail(Reason.compile_error, limited, **common)
        errors = [d for d in diagnostics if d.severity in ("error", "fatal error")]
        if not errors:  # ninja's own failure, or a tool's we do not parse: its words say more than "0 errors"
            return fail(Reason.compile_error, f"the build failed without a compiler diagnostic: {_first_error(log)} "
                        "(the log's tail is in log_tail)", **common)
        first = errors[0]
        where = f" first at {first.file}:{first.line}: {first.message}" if first.file else ""
        return fail(Reason.compile_error, f"compilation failed with {len(errors)} error(s);{where}", **common)
    refused = symbol_scan.scan(extension_path(ws))
    if refused:
        return fail(Reason.forbidden_symbol, refused, **common)
    return CompileResult(ok=True, backend=ws.backend, duration_s=time.perf_counter() - t0,
                         up_to_date="no work to do" in log, restored_files=restored,
                         message="built " + EXTENSION_FILE, **common)


def _cache_limit(cfg: CompileConfig) -> int:
    """The object cache's bound, passed on its command line: the build's environment is scrubbed."""
    if cfg.object_cache_max_bytes is not None:
        return cfg.object_cache_max_bytes
    return int(os.environ.get("CUDA_AGENT_OBJECT_CACHE_MB", "2048")) << 20


def _needs_plain_header(ws: Workspace, pch: Path, rc: int | None, log: str) -> bool:
    """Whether a build against the interface header must be done again against the plain one: its link named a
    pybind11 member left to the infrastructure object, or the linked extension imports one nothing defines."""
    if pch.name != "pch-interface" or rc is None:
        return False
    if rc != 0:
        return pybind_interface.link_missed_a_member(log)
    return bool(pybind_interface.unresolved_pybind_imports(extension_path(ws)))


def extension_path(ws: Workspace) -> Path:
    return ws.build_dir / EXTENSION_FILE


def is_stale(ws: Workspace) -> bool:
    """The extension is missing or older than a source: verify/profile would test old code."""
    so = extension_path(ws)
    if not so.is_file():
        return True
    built = so.stat().st_mtime
    kdir = ws.root / "kernels"
    newest = max((p.stat().st_mtime for p in kdir.rglob("*") if p.is_file()), default=0.0)
    return newest > built
