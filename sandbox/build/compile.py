"""Build a workspace's kernels into the `cuda_extension` module with ninja.

We write the ninja file ourselves (paths and flags from torch.utils.cpp_extension via the cached
toolchain probe) so that: the fixed infrastructure object is compiled once per toolchain and shared
by every workspace; .cu files get no torch-imposed half-precision macros; paths are relative, so a
copied workspace stays up to date; and the build runs in its own process group with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from sandbox.backend import device_for
from sandbox.build import pybind_interface
from sandbox.build.diagnostics import parse_diagnostics
from sandbox.build.ninja_file import (
    EXTENSION_FILE,
    FULL_MARK,
    PCH_RULE,
    RULES,
    host_flags,
    jail_env,
    object_name,
    quote_all,
    thin_flags,
    write_build_file,
)
from sandbox.build.objcache import HIT_MARK
from sandbox.build.toolchain import Toolchain, get_toolchain
from sandbox.config import CompileConfig, cache_dir
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.confinement.processes import kill_tree, start_daemon_early
from sandbox.results import CompileResult, Reason
from sandbox.scan import symbol_scan
from sandbox.timing import cores
from sandbox.timing.device_lock import device_lock, file_lock
from sandbox.workspace import INFRA_DIR, Workspace, WorkspaceError

INFRA_TIMEOUT_S = 900.0  # a one-time setup cost per toolchain, not the agent's budget
INFRA_SECTIONS = ["-ffunction-sections", "-fdata-sections"]
# Builds yield the cores to judging: with eight judgments at a time on an H100, sixteen compilers ran on the cores
# where the verifies' workers set up, and a verify with its workers ready took 6-17 s against 1.6-2.1 s alone. A
# verify or a profile is nearer its reward than a build, and mostly waits on the device; at nice 10 the scheduler
# gives a compiler about a tenth of a contested core, and all of an idle one.
BUILD_NICE = 10
PLAIN_MARK = ".plain-header"  # in a build folder: its bindings needed the plain header once (pybind_interface)
PLAIN_NOTE = ("cuda-agent: a binding needed a pybind11 member that the shared infrastructure object does not hold; "
              "the bindings were compiled again against the plain header\n")


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError as e:
        raise RuntimeError("ninja is not installed (pip install ninja)") from e


def build_placement(backend: str) -> tuple[set[int] | None, contextlib.AbstractContextManager]:
    """Where a build runs beside the judge's timings: (the cores it may use, None for any; the lock it holds)."""
    cpus = cores.build_cores() if backend == "cuda" else None
    if cpus is not None:
        return cpus, contextlib.nullcontext()
    return None, device_lock(device_for(backend), exclusive=False)


def _run_ninja(build_dir: Path, log_path: Path, timeout_s: float, jobs: int | None,
               env: dict[str, str] | None = None, cpus: set[int] | None = None) -> tuple[int | None, str]:
    """Run ninja in its own process group; kill the whole group on timeout. rc None = timed out. `cpus`: the
    cores ninja and every compiler it starts may run on (inherited across fork and exec)."""
    cmd = [_ninja(), "-C", str(build_dir)]
    if jobs:
        cmd += ["-j", str(jobs)]
    elif cpus:
        cmd += ["-j", str(len(cpus) + 2)]  # ninja's default, counted on the cores it has
    env = {**(os.environ if env is None else env), "NINJA_STATUS": "[%f/%t] "}

    def place() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        with contextlib.suppress(OSError):
            os.nice(BUILD_NICE)

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=place)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(proc.pid)
            proc.wait()
    data = log_path.read_bytes()
    return rc, data.decode(errors="replace")


def _infra_folder(tc: Toolchain) -> Path:
    return cache_dir() / "infra" / f"{tc.key}-{_infra_hash(tc)}"


def pybind_header_list(tc: Toolchain, timeout_s: float) -> list[str]:
    """The pybind11 headers binding_registry.h includes, as GCC names them (pybind_interface.pybind_headers),
    listed once per toolchain beside the infrastructure; empty for a compiler other than GCC. Both the object and
    the interface header are made from this list, so it comes first and they can be built side by side."""
    folder = _infra_folder(tc)
    listed = folder / pybind_interface.HEADERS_FILE
    if not listed.is_file():
        with file_lock(folder.parent / f"{folder.name}-headers.lock"):
            if not listed.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(INFRA_DIR / "binding_registry.h", folder / "binding_registry.h")
                headers = (pybind_interface.pybind_headers(tc.cxx, host_flags(tc, [str(folder)]),
                                                           folder / "binding_registry.h", timeout_s)
                           if pybind_interface.is_gcc(tc.cxx) else [])
                tmp = folder / f"{pybind_interface.HEADERS_FILE}.tmp"
                tmp.write_text("".join(f"{h}\n" for h in headers))
                os.replace(tmp, listed)
    return listed.read_text().split()


def infra_object(tc: Toolchain, timeout_s: float) -> Path:
    """binding.cpp compiled once per toolchain, shared by every workspace. With GCC it is compiled with the
    pybind11 headers binding_registry.h includes (pybind_header_list) marked interface, and `#pragma
    implementation` for each, so that it holds the inline members that bindings built against the interface
    header leave out (pybind_interface)."""
    folder = _infra_folder(tc)
    obj = folder / "binding.o"
    if obj.is_file():
        return obj
    headers = pybind_header_list(tc, timeout_s)
    with file_lock(folder.parent / f"{folder.name}.lock"):
        if obj.is_file():
            return obj
        pybind_interface.write_infra_sources(folder, headers, (INFRA_DIR / "binding_registry.h").read_text(),
                                             (INFRA_DIR / "binding.cpp").read_text())
        # a section per function, so that the link keeps only the members some binding calls (link_flags): the
        # rest reach embedded Python (eval, imports) that the symbol scan refuses in an extension
        flags = host_flags(tc, [str(folder)])
        text = RULES + f"cxx = {shlex.quote(tc.cxx)}\ncflags = {quote_all([*flags, *INFRA_SECTIONS])}\n"
        text += "build binding.tmp.o: cxx binding.cpp\n"
        (folder / "build.ninja").write_text(text)
        rc, log = _run_ninja(folder, folder / "build.log", timeout_s, None)
        if rc != 0:
            raise RuntimeError(f"building the sandbox infrastructure failed (this is a setup problem, "
                               f"not the agent's):\n{log[-3000:]}")
        os.replace(folder / "binding.tmp.o", obj)
    return obj


def infrastructure(tc: Toolchain, timeout_s: float, header: bool, interface: bool) -> tuple[Path, Path | None]:
    """The infrastructure object and, with `header`, the precompiled header (infra_header): on a toolchain's first
    build the two compile side by side, each a single g++ of 20-30 s that would otherwise wait for the other
    (on this 2-core machine 30 s and 20 s one after the other; a first build on an H100 host paid about 40 s)."""
    if not header:
        return infra_object(tc, timeout_s), None
    # both start from pybind_header_list, which the first to reach it makes under its lock and the other waits for;
    # the thin header (thin_header) is made beside them, so that a toolchain's first build waits for one g++ only
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        obj = pool.submit(infra_object, tc, timeout_s)
        pch = pool.submit(infra_header, tc, timeout_s, interface)
        thin = pool.submit(thin_header, tc, timeout_s)
        thin.result()
        return obj.result(), pch.result()


def infra_header(tc: Toolchain, timeout_s: float, interface: bool = True) -> Path | None:
    """The folder holding binding_registry.h precompiled for this toolchain's host flags, or None.

    Every binding starts with `#include "binding_registry.h"` (SKILL.md, the examples), and parsing the torch
    and pybind11 headers it brings is about half of a binding's compile (docs/benchmarks.md). g++ looks for
    `binding_registry.h.gch` in each include directory just before the header, and uses it only where the
    include comes first and the flags match; anywhere else it reads the header beside it, so a source that
    does not start with it compiles as before. Built once per toolchain, like the infrastructure object, and
    only where the judge's cache is out of every candidate's reach (shared_caches_trusted): the header is
    compiled code that every later binding takes in. None where it is not trusted or g++ could not build it:
    a build without it is only slower.

    `interface`: the header that marks pybind11's headers interface-only (pybind_interface), where the
    infrastructure object holds their members (GCC); else, or where it could not be built, the plain one."""
    if not shared_caches_trusted():
        return None
    infra = _infra_folder(tc)
    headers = pybind_header_list(tc, timeout_s) if interface else []
    if headers:
        folder = _precompiled(tc, infra / "pch-interface", timeout_s, headers)
        if folder is not None:
            return folder
    return _precompiled(tc, infra / "pch", timeout_s, [])


def thin_header(tc: Toolchain, timeout_s: float) -> Path | None:
    """The folder holding binding_registry.h precompiled as a thin compile sees it (CUDA_AGENT_THIN_BINDING: ATen's
    headers and the stand-in for pybind11, no pybind11), or None, under infra_header's rules. A binding compiled
    against it spends about a second where one against the pybind11 header spends three (docs/benchmarks.md)."""
    if not shared_caches_trusted():
        return None
    return _precompiled(tc, _infra_folder(tc) / "pch-thin", timeout_s, [], thin=True)


def _precompiled(tc: Toolchain, folder: Path, timeout_s: float, interface: list[str],
                 thin: bool = False) -> Path | None:
    """binding_registry.h precompiled in `folder` (with `interface` marked interface-only; with `thin`, with the
    thin compile's flags), or None if g++ failed (the failure is kept there, so that no later build tries again)."""
    gch = folder / "binding_registry.h.gch"
    failed = folder / "failed.log"
    if gch.is_file():
        return folder
    if failed.is_file():
        return None
    with file_lock(folder.parent.parent / f"{folder.parent.name}-{folder.name}.lock"):
        if gch.is_file() or failed.is_file():
            return folder if gch.is_file() else None
        folder.mkdir(parents=True, exist_ok=True)
        header = folder / "binding_registry.h"
        text = (INFRA_DIR / "binding_registry.h").read_text()
        header.write_text(pybind_interface.interface_header(text, interface, header) if interface else text)
        flags = (thin_flags if thin else host_flags)(tc, [str(folder)])
        text = RULES + PCH_RULE + f"cxx = {shlex.quote(tc.cxx)}\ncflags = {quote_all(flags)}\n"
        text += "build binding_registry.tmp.gch: pch binding_registry.h\n"
        (folder / "build.ninja").write_text(text)
        rc, log = _run_ninja(folder, folder / "build.log", timeout_s, None)
        if rc != 0:  # kept, so that every build after it does not try again: say why in the infra folder
            failed.write_text(log[-20000:])
            return None
        os.replace(folder / "binding_registry.tmp.gch", gch)
    return folder


def _infra_hash(tc: Toolchain) -> str:
    """The infrastructure's sources and the host flags they are built with: g++ silently ignores a precompiled
    header made with other flags, so a header cached before a flag changed must not be found."""
    import hashlib

    h = hashlib.sha256(" ".join([pybind_interface.SCHEME, *host_flags(tc, [])]).encode())
    for name in ("binding.cpp", "binding_registry.h"):
        h.update((INFRA_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def object_cache(tc: Toolchain) -> Path | None:
    """The folder of this toolchain's object cache (sandbox/build/objcache.py), where the judge's cache is
    trusted: an object kept there is linked into later candidates' extensions. None elsewhere."""
    return cache_dir() / "objects" / tc.key if shared_caches_trusted() else None


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
    return [m.group(1) for m in re.finditer("^" + re.escape(FULL_MARK) + r"\.\./(\S+)$", log, re.M)]


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
        objects = object_cache(tc) if cfg.object_cache else None
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
            write_build_file(ws, tc, infra, pch, objects, cfg.thin_bindings, thin_pch)
        except WorkspaceError as e:  # a source named against the rule, or linking out, that came after the check
            return fail(Reason.compile_error, str(e))
        except RuntimeError as e:
            return fail(Reason.internal_error, str(e))
        log_path = ws.build_dir / "compile.log"
        ninja_log = ws.build_dir / ".ninja_log"
        offset = ninja_log.stat().st_size if ninja_log.is_file() else 0
        rc, log = _run_ninja(ws.build_dir, log_path, cfg.timeout_s, cfg.jobs, jail_env(ws, tc, infra), cpus)
        if pch is not None and _needs_plain_header(ws, pch, rc, log):
            # a binding needs a pybind11 member the infrastructure object does not hold: this workspace's
            # bindings are compiled against the plain header from now on (pybind_interface)
            (ws.build_dir / PLAIN_MARK).touch()
            pch = infra_header(tc, INFRA_TIMEOUT_S, interface=False)
            try:
                write_build_file(ws, tc, infra, pch, objects, cfg.thin_bindings, thin_pch)
            except (WorkspaceError, RuntimeError) as e:
                return fail(Reason.internal_error, str(e))
            left = max(1.0, cfg.timeout_s - (time.perf_counter() - t0))  # one build's limit covers both
            rc, log = _run_ninja(ws.build_dir, log_path, left, cfg.jobs, jail_env(ws, tc, infra), cpus)
            log = PLAIN_NOTE + log
        steps = _steps(ws, offset)
    diagnostics = parse_diagnostics(log, ws.build_dir, ws.root)[: cfg.max_diagnostics]
    tail = log[-cfg.log_tail_chars:]
    common = dict(diagnostics=diagnostics, log_tail=tail, log_path=str(log_path), rebuilt=_rebuilt_sources(log),
                  reused=_reused_sources(log), steps=steps, full_bindings=_full_sources(log))
    if rc is None:
        return fail(Reason.compile_timeout, f"the build took longer than {cfg.timeout_s:.0f} s and was killed "
                    "(heavy templates or unrolling? simplify, or raise the compile timeout)", **common)
    if rc != 0:
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
