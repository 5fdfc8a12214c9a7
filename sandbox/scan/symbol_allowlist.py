"""What the built extension may import: the symbol scan's allow-list (sandbox/scan/symbol_scan.py reads the
.so and asks `classify` about each undefined dynamic symbol).

The rule, stated once for agents in skills/SKILL.md and docs/judge.md ("Symbol scan"): kernels/ may call the
C and C++ runtime, OpenMP, the CUDA runtime, pybind11 and the Python C API it needs, and PyTorch's tensor
plumbing (allocation, metadata, data pointers, checks, streams and guards). Anything else is refused, so a
library libtorch happens to export (MKL's BLAS, Sleef, fbgemm, oneDNN) or a way into ATen that runs no
profiling hooks (the dispatcher's redispatch) is refused without anyone having listed it first. FAMILIES
names what is refused on purpose, so the message can say what was found and what to do instead; a symbol
that is in no family and not allowed is refused as `not_allowed`. tests/test_symbol_allowlist.py checks
that both documents name every family and that each family's examples are refused from a real ELF file.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass

from sandbox.scan.mangled import qualified_name
from sandbox.worker.recorder import ALLOWED_OPS


@dataclass(frozen=True)
class Family:
    label: str  # what the refusal message calls it
    advice: str  # what to do instead
    # symbols of the family, all refused: exported by this torch (2.13, CPU), glibc or CPython, else the
    # library's documented API name (cuBLAS's, LAPACKE's, XNNPACK's; other torch builds export some of them)
    examples: tuple[str, ...]


FAMILIES: dict[str, Family] = {
    "embedded_python": Family(
        "embedded Python (evaluation, imports, interpreter state, functions made from code)",
        "pybind11's bindings need none of it",
        ("PyRun_SimpleStringFlags", "PyEval_EvalCode", "PyImport_ImportModule", "PySys_GetObject",
         "_PyFunction_CopyWithNewCode", "PyObject_SetAttr")),
    "dynamic_loader": Family(
        "the dynamic loader and process memory",
        "call your own functions directly",
        ("dlopen", "dlsym", "dl_iterate_phdr", "_r_debug", "ptrace", "process_vm_writev", "mprotect")),
    "profiler_controls": Family(
        "the profiler's and the op callbacks' controls",
        "leave the judge's instruments alone",
        ("_ZN2at20enableRecordFunctionEb", "_ZN2at14clearCallbacksEv",
         "_ZN5torch8autograd8profiler21disableProfilerLegacyESt8optionalINS1_22ProfilerDisableOptionsEE")),
    "dispatcher": Family(
        "PyTorch's dispatcher from C++ (redispatch, ops looked up by name, explicit dispatch key sets, "
        "kernel registration, the dispatch TLS)",
        "it reaches ATen's kernels past the judge's op recorder; write the computation in your own kernel",
        ("_ZN2at4_ops4relu10redispatchEN3c1014DispatchKeySetERKNS_6TensorE",
         "_ZN2at4_ops20_slow_conv2d_forward10redispatchEN3c1014DispatchKeySetERKNS_6TensorES6_NS2_8ArrayRefINS2_6SymIntEEERKSt8optionalIS4_ES9_S9_",
         "_ZN3c1010Dispatcher13realSingletonEv", "_ZN3c1010Dispatcher17findSchemaOrThrowEPKcS2_",
         "_ZNK3c104impl13OperatorEntry24assertSignatureIsCorrectERKNS0_12CppSignatureEb",
         "_ZN3c104impl26raw_local_dispatch_key_setE",
         "_ZN5torch7LibraryC1ENS0_4KindENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEESt8optionalIN3c1011DispatchKeyEEPKcj")),
    "aten_compute": Family(
        "ATen compute from C++ (at::_ops calls of ops other than allocation, views and metadata, at::native, "
        "at::cpu, the composite and meta entry points, at::Tensor's compute methods, the aoti_torch_* C shims)",
        "allocate with at::empty*/at::zeros* and write the math yourself",
        ("_ZN2at4_ops4relu4callERKNS_6TensorE", "_ZN2at6native4reluERKNS_6TensorE", "_ZN2at3cpu4reluERKNS_6TensorE",
         "_ZN2at25compositeexplicitautograd13_sparse_addmmERKNS_6TensorES3_S3_RKN3c106ScalarES7_",
         "_ZNK2at6Tensor5relu_Ev", "aoti_torch_cpu_repeat_interleave_Tensor")),
    "blas": Family(
        "BLAS, LAPACK and MKL (the Fortran names such as sgemm_, cblas_*, LAPACKE_*, mkl_*, ATen's cpublas)",
        "libtorch exports MKL's BLAS, but a library GEMM is not your kernel: write the GEMM yourself",
        ("sgemm_", "dgemm_", "sgemv_", "SGEMM", "SGEMM_64", "cblas_sgemm", "cblas_sgemm_batch", "cblas_saxpy", "LAPACKE_sgesv",
         "mkl_serv_allocate", "MKL_Set_Num_Threads_Local", "vsExp", "_ZN2at6native7cpublas21gemm_no_downcast_stubE")),
    "vector_math": Family(
        "Sleef's vector math (Sleef_*)",
        "use <cmath> (expf, tanhf, ...) or your own polynomial",
        ("Sleef_expf8_u10", "Sleef_tanhf16_u10")),
    "cpu_kernel_libraries": Family(
        "the CPU kernel libraries inside libtorch (fbgemm, oneDNN/mkldnn/ideep, XNNPACK, QNNPACK, NNPACK)",
        "write the kernel yourself",
        ("_ZN6fbgemm10BCSRMatrixIaLi1ELi4EE4packEPKa", "dnnl_primitive_execute", "xnn_create_fully_connected_nc_f32",
         "pytorch_qnnp_run_operator", "nnp_convolution_inference", "_ZN2at18get_mkldnn_versionB5cxx11Ev")),
    "cuda_libraries": Family(
        "CUDA libraries (cuBLAS, cuBLASLt, cuDNN, cuFFT, cuRAND's host API, cuSPARSE, cuSOLVER, cuTENSOR, NCCL, "
        "NVRTC, NPP, and ATen's handles to them)",
        "write the kernel yourself; CUTLASS, CuTe and CUB are headers that compile into your own kernels and are fine",
        ("cublasSgemm_v2", "cublasLtMatmul", "cudnnConvolutionForward", "cufftExecC2C", "curandGenerateUniform",
         "ncclAllReduce", "nvrtcCompileProgram", "_ZN2at4cuda25getCurrentCUDABlasHandleEv",
         "_ZN2at4cuda4blas4gemmIfEEvcclllfPKflS4_lfPfl")),
    "not_allowed": Family(
        "not on the allow-list",
        "an extension may import the C and C++ runtime, OpenMP, the CUDA runtime, pybind11's bindings, "
        "and PyTorch's tensor plumbing (allocation, metadata, data pointers, TORCH_CHECK, streams and guards)",
        ("_ZN2at13globalContextEv", "_ZN3c1017set_default_dtypeEN6caffe28TypeMetaE", "uv_tcp_connect",
         "_ZN5torch3jit4loadERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEESt8optionalIN3c106DeviceEEb")),
}

# ---------------------------------------------------------------------------------------------------
# refused on purpose: checked before the allow-list, so nothing the allow-list admits by pattern (a
# Py* name, a glibc function) can carry them

# pybind11 and torch's headers import these from PyEval_*: holding and dropping the GIL, the builtins
_PYEVAL_ALLOWED = frozenset({"PyEval_AcquireThread", "PyEval_SaveThread", "PyEval_RestoreThread",
                             "PyEval_ReleaseThread", "PyEval_GetBuiltins", "PyEval_InitThreads",
                             "PyEval_ThreadsInitialized"})
_PY_PREFIXES = ("PyRun_", "Py_Compile", "PyEval_", "PyImport_", "PySys_", "PyMarshal_", "PyCode_", "PyFunction_",
                "_PyEval_", "_PyRun_", "_PyImport_", "_PySys_", "_PyFunction_", "_PyCode_")
_PY_EXACT = frozenset({"PyObject_SetAttr", "PyObject_GenericSetAttr", "Py_Main", "Py_RunMain", "Py_Initialize",
                       "Py_InitializeEx", "Py_NewInterpreter"})
# not `dladdr` (it names the library an address is in) and not `syscall` (torch's CUDA headers import it, so
# every honest CUDA extension does); Landlock and seccomp bound a raw system call. Walking the loader's link
# maps (dl_iterate_phdr, _r_debug, dladdr1, dlinfo) finds any library's symbols without importing them.
_LOADER_EXACT = frozenset({"dlopen", "dlmopen", "dlsym", "dlvsym", "dlinfo", "dladdr1", "dl_iterate_phdr", "_r_debug",
                           "ptrace", "process_vm_readv", "process_vm_writev", "mprotect", "pkey_mprotect"})
_LOADER_PREFIXES = ("_dl_", "__libc_dl")
# switching the dispatcher's op callbacks off, or stopping the profiler, blinds the op audit below Python
_PROFILER_SUBSTRINGS = ("enableRecordFunction", "clearCallbacks", "removeCallback", "clearGlobalCallbacks",
                        "clearThreadLocalCallbacks", "set_record_function_tls_", "get_record_function_tls_",
                        "_ZN5torch8autograd8profiler", "_ZN5torch8profiler")
# the dispatcher's own classes, kernel registration and its thread-local state; `redispatch` anywhere (the
# at::_ops entry points and at::redispatch::) runs no profiling hooks and, with a backend key set, skips the
# Python key the recorder lives on
_DISPATCH_QUALIFIED = (("c10", "Dispatcher"), ("c10", "OperatorHandle"), ("c10", "TypedOperatorHandle"),
                       ("c10", "KernelFunction"), ("c10", "BoxedKernel"), ("c10", "RegisterOperators"),
                       ("c10", "impl", "OperatorEntry"), ("c10", "impl", "TorchDispatchModeTLS"),
                       ("c10", "impl", "PythonDispatcherTLS"), ("c10", "impl", "IncludeDispatchKeyGuard"),
                       ("c10", "impl", "raw_local_dispatch_key_set"), ("c10", "impl", "LocalDispatchKeySet"),
                       ("c10", "impl", "_force_tls_local_dispatch_key_set"), ("c10", "impl", "dispatch_mode_enabled"),
                       ("torch", "Library"), ("torch", "CppFunction"), ("torch", "detail", "TorchLibraryInit"),
                       ("c10", "DispatchKeySet"), ("c10", "initializeFunctionalityOffsetsAndMasks"),
                       ("c10", "show_dispatch_trace"), ("c10", "dispatch_trace_nesting_incr"),
                       ("c10", "dispatch_trace_nesting_decr"), ("c10", "detail", "_print_dispatch_trace"))
_DISPATCH_TLS_PREFIX = ("c10", "impl", "tls_")
_BLAS_PREFIXES = ("cblas_", "LAPACKE_", "lapack_", "mkl_", "MKL_", "dfti", "Dfti", "DFTI")
_FORTRAN = re.compile(r"^[A-Za-z][A-Za-z0-9]*_$|^[SDCZ][A-Z0-9_]{3,}$")  # sgemm_, SGEMM, SGEMM_64
_VML = re.compile(r"^v(m)?[sdcz][A-Z][A-Za-z0-9]*$")  # MKL's vector math: vsExp, vmdLn
_CPU_LIBRARY_SUBSTRINGS = ("fbgemm", "dnnl", "mkldnn", "onednn", "ideep", "xnnpack", "qnnp", "nnpack")
_CPU_LIBRARY_PREFIXES = ("xnn_", "nnp_", "pytorch_qnnp")
_CUDA_LIBRARY_PREFIXES = ("cublas", "cudnn", "cufft", "curand", "cusparse", "cusolver", "cutensor", "nccl", "nvrtc",
                          "npp", "nvjpeg", "nvshmem", "cufile", "cudss", "cudla")
_ATEN_CUDA_LIBRARY = re.compile(r"(?i)blas|solver|sparse|cudnn|cufft|nvrtc|nccl")
# ATen's entry points that skip the dispatcher, and the C shims AOTInductor's code calls ops through
_ATEN_BYPASS = frozenset({"native", "cpu", "compositeexplicitautograd", "compositeimplicitautograd", "meta",
                          "compositeexplicitautogradnonfunctional"})

# ---------------------------------------------------------------------------------------------------
# allowed

# plain (C) names by pattern: the Python C API (less the families above), torch's Python type objects, the
# CUDA runtime and the registration stubs nvcc emits, the driver API, OpenMP, and the weak references that
# crt files and libstdc++'s static parts carry (transactional memory: _ITM_*, the _ZGTt clones of operator
# new/delete; seen on the GPU hosts' toolchain). Every other plain name must be exported by the C/C++
# runtime itself (_in_runtime).
_PLAIN_ALLOWED = re.compile(r"^(_?Py[A-Z_]|THP[A-Z]|cuda[A-Z]|__cuda|__nv|cu[A-Z]|GOMP_|omp_|_ITM_|_ZGTt)")
_CRT_WEAK = frozenset({"__gmon_start__"})
_RUNTIME_LIBS = ("libstdc++.so.6", "libm.so.6", "libc.so.6", "libgcc_s.so.1")

# ops that are no-ops on the inputs honest kernels expect, so the recorder refuses them only at run time
LINK_ALLOWED_OPS = ALLOWED_OPS | {"contiguous", "to", "size", "stride", "numel", "dim", "sizes", "strides"}
# at::TensorBase / at::Tensor methods that libtorch defines out of line and that only read metadata, hand out
# data pointers or dispatch an allowed op (the others, relu_ or index, compute)
_TENSOR_METHODS = frozenset({"data_ptr", "const_data_ptr", "mutable_data_ptr", "data", "item", "__dispatch_contiguous",
                             "expect_contiguous", "to", "print", "toString", "name", "enforce_invariants", "is_leaf",
                             "is_view", "output_nr", "_version", "C1", "C2", "D1", "D2"})
# the rest of ATen an honest kernel uses: at::parallel_for's thread bookkeeping, dispatch-free allocation,
# RecordFunction scopes (RECORD_FUNCTION labels a range; it cannot switch the callbacks off), device queries
_AT_ALLOWED = frozenset({
    ("at", "get_thread_num"), ("at", "get_num_threads"), ("at", "init_num_threads"), ("at", "in_parallel_region"),
    ("at", "internal", "set_thread_num"), ("at", "internal", "lazy_init_num_threads"),
    ("at", "internal", "invoke_parallel"), ("at", "internal", "expand_slow_path"),
    ("at", "detail", "empty_cpu"), ("at", "detail", "empty_strided_cpu"), ("at", "detail", "empty_cuda"),
    ("at", "detail", "empty_strided_cuda"),
    ("at", "RecordFunction"), ("at", "getStepCallbacksUnlessEmpty"), ("at", "getStepCallbacks"),
    ("at", "shouldRunRecordFunction"), ("at", "isRecordFunctionEnabled"),
    ("at", "cuda", "getCurrentDeviceProperties"), ("at", "cuda", "getDeviceProperties"), ("at", "cuda", "warp_size"),
    ("at", "cuda", "getNumGPUs"), ("at", "cuda", "is_available"), ("at", "cuda", "canDeviceAccessPeer"),
    ("at", "cuda", "getCurrentCUDAStream"), ("at", "cuda", "getDefaultCUDAStream"), ("at", "cuda", "CUDAEvent"),
})
# c10: the tensor's own classes, errors and warnings, symbolic sizes, devices, streams and guards (all of c10::cuda)
_C10_ALLOWED = frozenset({
    "TensorImpl", "UndefinedTensorImpl", "StorageImpl", "Storage", "Allocator", "DataPtr", "GetAllocator",
    "GetCPUAllocator", "GetDefaultCPUAllocator", "alloc_cpu", "free_cpu", "Device", "DeviceTypeName", "Stream",
    "TensorOptions", "Scalar", "SymInt", "SymFloat", "SymBool", "SymNodeImpl", "ConstantSymNodeImpl",
    "SymbolicShapeMeta", "intrusive_ptr_target", "SmallVectorBase", "AutogradMetaInterface", "VariableVersion",
    "ParallelGuard", "IValue", "Error", "ValueError", "TypeError", "IndexError", "NotImplementedError",
    "OutOfMemoryError", "LinAlgError", "EnforceFiniteError", "ErrorAlwaysShowCppStacktrace", "BufferError",
    "AcceleratorError", "Warning", "WarningUtils", "warn", "SourceLocation", "report_overflow", "ThrowEnforceNotMet",
    "ThrowEnforceFiniteNotMet", "demangle", "get_backtrace", "toString", "ls", "cuda",
    # the untyped data_ptr(): its null check and its deprecation warning (Judge IX: honest bindings were refused)
    "throwNullDataPtrError", "warnDeprecatedDataPtr",
})
_C10_DETAIL_ALLOWED = frozenset({"torchCheckFail", "torchInternalAssertFail", "maybe_wrap_dim_slow", "torchCheckMsgImpl",
                                 "StripBasename", "CompileTimeEmptyString", "ListImpl", "deleteNothing"})
# ExcludeDispatchKeyGuard: torch/extension.h's inline make_variable path takes it, and nvcc emits that path
# into every .cu that includes the header. Excluding a key only hides the allowed ops an extension may link.
_C10_IMPL_ALLOWED = frozenset({"cow", "device_guard_impl_registry", "DeviceGuardImplInterface", "VirtualGuardImpl",
                               "SizesAndStrides", "GPUTrace", "getGlobalPyInterpreter", "PyObjectSlot",
                               "ExcludeDispatchKeyGuard"})
_OTHER_ALLOWED = frozenset({("caffe2", "TypeMeta"), ("caffe2", "detail"), ("torch", "autograd", "AutogradMeta")})


def aten_op(symbol: str) -> str | None:
    """`at::_ops::<struct>::call` -> the struct's name (op, or op_overload)."""
    q = qualified_name(symbol)
    return q[2] if q and len(q) >= 3 and q[:2] == ("at", "_ops") else None


def aten_allowed(struct: str) -> bool:
    # structs are named op or op_overload; an allowed op's overloads are allowed too, its backward and scatter
    # relatives (unfold_backward, slice_scatter) compute
    if struct.endswith(("_backward", "_scatter")):
        return False
    return any(struct == op or (struct.startswith(op + "_") and struct != op + "_") for op in LINK_ALLOWED_OPS)


@functools.cache
def _runtime() -> tuple[ctypes.CDLL, ...]:
    out = []
    for name in _RUNTIME_LIBS:
        try:
            out.append(ctypes.CDLL(name))
        except OSError:
            continue
    return tuple(out)


def _in_runtime(symbol: str) -> bool:
    """Whether the C and C++ runtime libraries (or the loader they depend on) define it: dlsym on each handle
    searches that library and its dependencies, never torch's, whatever this process has loaded."""
    for lib in _runtime():
        try:
            lib[symbol]  # [] looks up without caching the name on the handle, as attribute access would
            return True
        except AttributeError:
            continue
    return False


def _refused_on_purpose(s: str, q: tuple[str, ...] | None) -> str | None:
    if s in _PY_EXACT or (s.startswith(_PY_PREFIXES) and s not in _PYEVAL_ALLOWED):
        return "embedded_python"
    if s in _LOADER_EXACT or s.startswith(_LOADER_PREFIXES):
        return "dynamic_loader"
    if any(d in s for d in _PROFILER_SUBSTRINGS):
        return "profiler_controls"
    if "redispatch" in s or (q and (any(q[:len(p)] == p for p in _DISPATCH_QUALIFIED)
                                    or (len(q) >= 3 and q[:2] == _DISPATCH_TLS_PREFIX[:2]
                                        and q[2].startswith(_DISPATCH_TLS_PREFIX[2])))):
        return "dispatcher"
    # library names are matched in a plain name or in the scope path of a mangled one, never in the mangled
    # string itself, where the letters of other names run together (data_ptr<double> is ...data_ptrIdEE...)
    words = [w.lower() for w in (q or (s,))]
    if (s.startswith(_BLAS_PREFIXES) or "cpublas" in words or (q is None and (_FORTRAN.match(s) or _VML.match(s)))):
        return "blas"
    if any(w.startswith("sleef") for w in words):
        return "vector_math"
    if s.startswith(_CPU_LIBRARY_PREFIXES) or any(d in w for w in words for d in _CPU_LIBRARY_SUBSTRINGS):
        return "cpu_kernel_libraries"
    if s.startswith(_CUDA_LIBRARY_PREFIXES) or (q and q[:2] == ("at", "cuda") and len(q) >= 3
                                                  and _ATEN_CUDA_LIBRARY.search(q[2])):
        return "cuda_libraries"
    if s.startswith("aoti_") or (q and len(q) >= 2 and q[0] == "at" and q[1] in _ATEN_BYPASS):
        return "aten_compute"
    return None


def _allowed(s: str, q: tuple[str, ...] | None) -> bool:
    if q is None:
        return (s in _CRT_WEAK or bool(_PLAIN_ALLOWED.match(s))) or _in_runtime(s)
    head = q[0]
    if head in ("std", "__cxxabiv1") or s.startswith(("_Znw", "_Zna", "_Zdl", "_Zda")):
        return _in_runtime(s)
    if head == "pybind11" or head.startswith("THP"):
        return True
    if head == "at" and len(q) >= 3 and q[1] == "_ops":
        return len(q) >= 4 and q[3] == "call" and aten_allowed(q[2])
    if head == "at" and len(q) >= 3 and q[1] in ("TensorBase", "Tensor"):
        m = q[2]
        return m in _TENSOR_METHODS or m.removesuffix("_symint") in LINK_ALLOWED_OPS
    if head == "at":
        return any(q[:len(a)] == a for a in _AT_ALLOWED)
    if head == "c10" and len(q) >= 2:
        if q[1] == "detail":
            return len(q) >= 3 and q[2] in _C10_DETAIL_ALLOWED
        if q[1] == "impl":
            return len(q) >= 3 and q[2] in _C10_IMPL_ALLOWED
        return q[1] in _C10_ALLOWED
    return any(q[:len(a)] == a for a in _OTHER_ALLOWED)


def classify(symbol: str) -> str | None:
    """None when an extension may import the symbol, else the key of the FAMILIES entry that refuses it."""
    q = qualified_name(symbol)
    family = _refused_on_purpose(symbol, q)
    if family:
        return family
    if _allowed(symbol, q):
        return None
    if q and q[0] == "at" and len(q) >= 3 and q[1] in ("_ops", "TensorBase", "Tensor"):
        return "aten_compute"
    if "14DispatchKeySet" in symbol:
        return "dispatcher"
    return "not_allowed"


def needs_a_definer(symbol: str, family: str) -> bool:
    """Refused only where a library the extension loads defines it (sandbox/scan/elf_exports.py): a name on
    no list, or one that merely looks like Fortran BLAS (`scale_`), may be the agent's own function left
    undefined, which the import then reports as it always did."""
    if family == "not_allowed":
        return True
    return family == "blas" and qualified_name(symbol) is None and not symbol.startswith(_BLAS_PREFIXES)
