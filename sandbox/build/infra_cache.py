"""What every build shares, made once per toolchain in the judge's cache: the infrastructure object (binding.cpp), the
precompiled binding headers (the pybind11 interface header, the plain one, the thin one) and the object cache's folder
(docs/judge.md, "What one build shares with the next" and "Bindings compiled thin")."""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import shutil
from pathlib import Path

from sandbox.build import link_stubs, pybind_interface, thin_shadow
from sandbox.build.ninja_file import PCH_RULE, RULES, host_flags, quote_all, thin_flags
from sandbox.build.ninja_run import _run_ninja
from sandbox.build.toolchain import Toolchain
from sandbox.config import cache_dir
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.timing.device_lock import file_lock
from sandbox.workspace import INFRA_DIR

INFRA_TIMEOUT_S = 900.0  # a one-time setup cost per toolchain, not the agent's budget
INFRA_SECTIONS = ["-ffunction-sections", "-fdata-sections"]


def _infra_folder(tc: Toolchain) -> Path:
    return cache_dir() / "infra" / f"{tc.compile_key}-{_infra_hash(tc)}"


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
        if thin:  # before the header is compiled: it includes the copy, and so does every thin compile after it
            thin_shadow.write(folder, tc.include_dirs)
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


def link_stub_folder(tc: Toolchain) -> Path | None:
    """The folder of this toolchain's link stand-ins for torch's libraries (sandbox/build/link_stubs.py), made on
    first use, or None: turned off (CUDA_AGENT_LINK_STUBS=0), or where the judge's cache is not trusted, since
    what the link reads there decides which libraries every later extension loads."""
    if not (link_stubs.enabled() and shared_caches_trusted()):
        return None
    folder = _infra_folder(tc) / link_stubs.SCHEME
    if not (folder / link_stubs.DONE).is_file():
        with file_lock(folder.parent.parent / f"{folder.parent.name}-{folder.name}.lock"):
            if not (folder / link_stubs.DONE).is_file():
                link_stubs.write(folder, tc.cxx, tc.libraries, tc.library_dirs)
    return folder


def _infra_hash(tc: Toolchain) -> str:
    """The infrastructure's sources and the host flags they are built with: g++ silently ignores a precompiled
    header made with other flags, so a header cached before a flag changed must not be found."""
    import hashlib

    h = hashlib.sha256(" ".join([pybind_interface.SCHEME, thin_shadow.scheme(), *host_flags(tc, [])]).encode())
    for name in ("binding.cpp", "binding_registry.h"):
        h.update((INFRA_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def object_cache(tc: Toolchain, base: str | Path | None = None) -> Path | None:
    """The folder of this toolchain's object cache (sandbox/build/objcache.py), where the judge's cache is
    trusted: an object kept there is linked into later candidates' extensions. None elsewhere. `base`: a cache
    of its own (the MCP server's per client, under its root, which no confined process can reach either)."""
    if not shared_caches_trusted():
        return None
    return (Path(base) if base is not None else cache_dir() / "objects") / tc.compile_key
