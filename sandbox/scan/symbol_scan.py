"""Static evidence about the built extension: the dynamic symbols it imports.

Code in kernels/ runs inside the processes that verify and time it, so in-process verdicts can be
patched from C++ (embedded Python, a looked-up symbol, rewritten memory). The linked cuda_extension.so
is read here, outside any process that ran it, and refused if it imports the Python C API's evaluation,
import or interpreter-state functions, the dynamic loader, process-memory access, or ATen compute ops
that the op recorder would refuse. pybind11 itself needs part of the C API (attribute setting, the GIL
calls, PyEval_GetBuiltins): those stay allowed, so this layer stops embedded source code and symbol
lookups, not pybind11-level patching; the parent's timing bound (sandbox/timing/timing_bound.py) covers that.
Writes through /proc/self/mem are file I/O and cannot be seen here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sandbox.worker.kernel_names import kernel_identifier
from sandbox.worker.recorder import ALLOWED_OPS

# pybind11 and torch's headers import these from PyEval_*: holding and dropping the GIL, the builtins
_PYEVAL_ALLOWED = frozenset({"PyEval_AcquireThread", "PyEval_SaveThread", "PyEval_RestoreThread",
                             "PyEval_ReleaseThread", "PyEval_GetBuiltins", "PyEval_InitThreads",
                             "PyEval_ThreadsInitialized"})
_DENY_PREFIXES = ("PyRun_", "Py_Compile", "PyEval_", "PyImport_", "PySys_", "PyMarshal_", "PyCode_",
                  "_PyEval_", "_PyRun_", "_PyImport_", "_PySys_")
# not `dladdr` (it names the library an address is in, and resolves nothing by name) and
# not `syscall`: torch's CUDA headers import it, so every honest CUDA extension does (seen on the H200);
# the seccomp filter and Landlock bound what a raw system call can do
_DENY_EXACT = frozenset({"dlopen", "dlmopen", "dlsym", "dlvsym", "dlinfo", "ptrace",
                         "process_vm_readv", "process_vm_writev", "mprotect", "pkey_mprotect",
                         "PyObject_SetAttr", "PyObject_GenericSetAttr", "Py_Main", "Py_RunMain",
                         "Py_Initialize", "Py_InitializeEx", "Py_NewInterpreter"})
# switching the dispatcher's op callbacks off, or stopping the profiler, blinds the op audit below Python
# (sandbox/worker/op_audit.py). Honest extensions import RecordFunction's own symbols (the dispatcher's
# inline fast path runs callbacks), never these controls.
_DENY_SUBSTRINGS = ("enableRecordFunction", "clearCallbacks", "removeCallback", "clearGlobalCallbacks",
                    "clearThreadLocalCallbacks", "set_record_function_tls_", "get_record_function_tls_",
                    "_ZN5torch8autograd8profiler", "_ZN5torch8profiler")
# compute that bypasses the dispatcher (so neither the recorder nor the op audit sees it): ATen's
# per-backend and native entry points (`at::cpu::relu`, `at::native::add`), its BLAS wrappers, and the
# CUDA libraries themselves. The paper forbids falling back to libraries; CUTLASS and CuTe are headers
# whose kernels compile into the extension, so they stay allowed.
_DENY_BYPASS = ("_ZN2at6native", "_ZN2at3cpu", "_ZN2at27compositeexplicitautograd",
                "_ZN2at27compositeimplicitautograd", "_ZN2at4cuda4blas", "_ZN2at4meta")
_DENY_LIBRARIES = ("cublas", "cudnn", "cufft", "cusparse", "cusolver", "cutensor")
_ATEN_OP = re.compile(r"^_ZN2at4_ops(\d+)")
DISABLE_ENV = "CUDA_AGENT_SYMBOL_SCAN"  # "0" turns the scan off: tests prove the other layers alone


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def imported_symbols(path: Path) -> set[str]:
    """Undefined symbols of an ELF file's dynamic table (a shared object) or symbol table (an object)."""
    from elftools.elf.elffile import ELFFile

    out: set[str] = set()
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        for name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(name)
            if sec is None:
                continue
            for sym in sec.iter_symbols():
                if sym["st_shndx"] == "SHN_UNDEF" and sym.name:
                    out.add(sym.name.split("@", 1)[0])
    return out


def aten_op(symbol: str) -> str | None:
    """`at::_ops::<struct>::call` -> the struct's name (op, or op_overload)."""
    m = _ATEN_OP.match(symbol)
    if not m:
        return None
    n = int(m.group(1))
    start = m.end()
    return symbol[start:start + n]


# ops that are no-ops on the inputs honest kernels expect, so the recorder refuses them only at run time
_LINK_ALLOWED = ALLOWED_OPS | {"contiguous", "to", "size", "stride", "numel", "dim", "sizes", "strides"}


def _aten_allowed(struct: str) -> bool:
    # structs are named op or op_overload; an allowed op's overloads are allowed too
    return any(struct == op or (struct.startswith(op + "_") and struct != op + "_") for op in _LINK_ALLOWED)


def forbidden(symbols: set[str]) -> list[str]:
    bad = []
    for s in sorted(symbols):
        if (s in _DENY_EXACT or (s.startswith(_DENY_PREFIXES) and s not in _PYEVAL_ALLOWED)
                or any(d in s for d in _DENY_SUBSTRINGS) or s.startswith(_DENY_BYPASS + _DENY_LIBRARIES)):
            bad.append(s)
            continue
        struct = aten_op(s)
        if struct is not None and not _aten_allowed(struct):
            bad.append(f"at::_ops::{struct}")
    return sorted(set(bad))


def scan(path: Path) -> str | None:
    """None when the built extension imports nothing forbidden, else the message of the refusal."""
    if not enabled():
        return None
    try:
        bad = forbidden(imported_symbols(path))
    except (OSError, ValueError) as e:
        return f"the built extension could not be read ({e})"
    if not bad:
        return None
    return ("the built extension imports functions your kernels may not call: " + ", ".join(bad[:8])
            + (" ..." if len(bad) > 8 else "") + " (embedded Python, the dynamic loader, process memory and "
            "PyTorch compute ops (also its native and per-backend entry points), cuBLAS/cuDNN and the profiler's controls are off limits: write the computation yourself)")


def demangle(names: list[str]) -> list[str]:
    """C++ names as the profiler shows kernels (libstdc++'s __cxa_demangle); a name that is not mangled
    stays as it is."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return list(names)
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    out = []
    for n in names:
        status = ctypes.c_int(0)
        ptr = fn(n.encode(), None, None, ctypes.byref(status)) if n.startswith("_Z") else None
        if ptr and status.value == 0:
            out.append(ctypes.string_at(ptr).decode(errors="replace"))
            free(ptr)
        else:
            out.append(n)
    return out


def defined_functions(path: Path) -> set[str]:
    """Mangled names of the functions a built object defines (a kernel's host-side symbol is among them)."""
    from elftools.elf.elffile import ELFFile

    out: set[str] = set()
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        for sec_name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(sec_name)
            if sec is None:
                continue
            for sym in sec.iter_symbols():
                if sym["st_shndx"] != "SHN_UNDEF" and sym["st_info"]["type"] == "STT_FUNC" and sym.name:
                    out.add(sym.name)
    return out


def own_kernels(path: Path) -> list[str]:
    """Identifiers of everything the extension defines: on CUDA a kernel in the forward whose identifier
    is not among them is not the extension's own (a library's or PyTorch's)."""
    try:
        names = sorted(defined_functions(path))
    except (OSError, ValueError):
        return []
    return sorted({kernel_identifier(n) for n in demangle(names)})
