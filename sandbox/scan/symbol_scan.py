"""Static evidence about the built extension: the dynamic symbols it imports.

Code in kernels/ runs inside the processes that verify and time it, so in-process verdicts can be
patched from C++ (embedded Python, a looked-up symbol, rewritten memory), and compute can be reached
where no in-process check looks (ATen's kernels through the dispatcher's redispatch, which runs no
profiling hooks; MKL's BLAS, Sleef or fbgemm, which libtorch exports). The linked cuda_extension.so is
read here, outside any process that ran it, and every undefined dynamic symbol must be on the allow-list
of sandbox/scan/symbol_allowlist.py (the C and C++ runtime, OpenMP, the CUDA runtime, pybind11 and the
Python C API, PyTorch's tensor plumbing); anything else is refused, named by its family where it has one.
pybind11 itself needs part of the C API (attribute access, the GIL calls, PyEval_GetBuiltins): those stay
allowed here, where the infrastructure object's imports and the agent's are one list; the agent's own objects are
read before the link by sandbox/scan/object_scan.py, where the Python C API is refused beyond what pybind11's
def and casters leave in an honest binding (Judge IX). Writes through /proc/self/mem, and
addresses computed by walking memory, are not imports and cannot be seen here.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from sandbox.scan.elf_exports import defined_by_libraries, symbol_entries
from sandbox.scan.symbol_allowlist import FAMILIES, aten_op, classify, needs_a_definer, qualified_name
from sandbox.worker.kernel_names import kernel_identifier

__all__ = ["DISABLE_ENV", "aten_op", "demangle", "display_names", "enabled", "forbidden", "imported_symbols", "own_kernels",
           "refusals", "scan"]

DISABLE_ENV = "CUDA_AGENT_SYMBOL_SCAN"  # "0" turns the scan off: tests prove the other layers alone
_SHOWN_PER_FAMILY = 4


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def imported_symbols(path: Path) -> set[str]:
    """Undefined symbols of an ELF file's dynamic table (a shared object) or symbol table (an object)."""
    return {name.split("@", 1)[0] for name, undefined, _ in symbol_entries(path) if undefined}


def refusals(symbols: set[str], extension: Path | None = None) -> dict[str, list[str]]:
    """The refused symbols by family (symbol_allowlist.FAMILIES), in the families' order. Given the extension,
    a name on no list counts only where one of its libraries defines it (elf_exports); without it, always."""
    found: dict[str, list[str]] = {}
    undecided: dict[str, str] = {}
    for s in sorted(symbols):
        family = classify(s)
        if family and extension is not None and needs_a_definer(s, family):
            undecided[s] = family
        elif family:
            found.setdefault(family, []).append(s)
    if undecided:
        for s in sorted(defined_by_libraries(extension, set(undecided))):
            found.setdefault(undecided[s], []).append(s)
    return {f: sorted(found[f]) for f in FAMILIES if f in found}


def _short(symbol: str) -> str:
    """An ATen op entry point as `at::_ops::<op>` (or `...::redispatch`), anything else as it is."""
    struct = aten_op(symbol)
    if struct is None:
        return symbol
    q = qualified_name(symbol) or ()
    return f"at::_ops::{struct}::redispatch" if q[3:4] == ("redispatch",) else f"at::_ops::{struct}"


def forbidden(symbols: set[str]) -> list[str]:
    return sorted({_short(s) for group in refusals(symbols).values() for s in group})


def display_names(names: list[str]) -> list[str]:
    """Demangled and without the parameter list: `at::_ops::convolution::redispatch`."""
    out = []
    for raw, name in zip(names, demangle(names), strict=True):
        if name == raw or "operator" in name or " for " in name:  # vtable for X, typeinfo for X, TLS init ...
            out.append(name[:160])
            continue
        depth, cut = 0, len(name)
        for i, c in enumerate(name):  # the first '(' outside template arguments opens the parameters
            if c == "<":
                depth += 1
            elif c == ">":
                depth -= 1
            elif c == "(" and depth == 0:
                cut = i
                break
        head = name[:cut]
        depth, start = 0, 0
        for i, c in enumerate(head):  # a return type ("float* at::TensorBase::data_ptr<float>") goes
            if c == "<":
                depth += 1
            elif c == ">":
                depth -= 1
            elif c == " " and depth == 0:
                start = i + 1
        out.append(head[start:] or name)
    return out


def scan(path: Path) -> str | None:
    """None when the built extension imports only what the allow-list admits, else the refusal's message."""
    if not enabled():
        return None
    try:
        found = refusals(imported_symbols(path), path)
    except (OSError, ValueError) as e:
        return f"the built extension could not be read ({e})"
    if not found:
        return None
    parts = []
    for family, names in found.items():
        shown = ", ".join(display_names(names[:_SHOWN_PER_FAMILY])) + (" ..." if len(names) > _SHOWN_PER_FAMILY else "")
        parts.append(f"{FAMILIES[family].label}: {shown} ({FAMILIES[family].advice})")
    return ("the built extension imports what your kernels may not call: " + "; ".join(parts)
            + ". The rule is in SKILL.md (Rules): no PyTorch compute, dispatcher or library from C++.")


@functools.cache
def _demangler():
    """libstdc++'s __cxa_demangle and libc's free, or None where they cannot be loaded."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    return fn, free


def _demangle_one(name: str) -> str:
    import ctypes

    tools = _demangler()
    if tools is None or not name.startswith("_Z"):
        return name
    fn, free = tools
    status = ctypes.c_int(0)
    ptr = fn(name.encode(), None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode(errors="replace") if status.value == 0 else name
    finally:
        free(ptr)


def demangle(names: list[str]) -> list[str]:
    """C++ names as the profiler shows kernels (libstdc++'s __cxa_demangle); a name that is not mangled
    stays as it is."""
    return [_demangle_one(n) for n in names]


@functools.lru_cache(maxsize=1 << 16)
def _identifier(mangled: str) -> str:
    # most of an extension's functions are the same in every extension (pybind11's, the binding registry's): a
    # judging process names each once
    return kernel_identifier(_demangle_one(mangled))


def defined_functions(path: Path) -> set[str]:
    """Mangled names of the functions a built object defines (a kernel's host-side symbol is among them)."""
    return {name for name, undefined, function in symbol_entries(path) if function and not undefined}


def own_kernels(path: Path) -> list[str]:
    """Identifiers of everything the extension defines: on CUDA a kernel in the forward whose identifier
    is not among them is not the extension's own (a library's or PyTorch's)."""
    try:
        names = defined_functions(path)
    except (OSError, ValueError):
        return []
    return sorted({_identifier(n) for n in names})
