"""What model_new.py may contain: the static scan's tables (sandbox/scan/static_scan.py walks the
source with them). docs/judge.md ("The static scan") holds the same rules as one table; tests check the
module tables against the installed torch."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------
# imports

# the only modules model_new.py may import (anything else is refused, with the reason below if known)
ALLOWED_IMPORTS: dict[str, str] = {
    "__future__": "language features",
    "typing": "annotations",
    "math": "scalar math for sizes and constants",
    "torch": "tensors, dtypes, allocation and views",
    "torch.nn": "nn.Module, nn.Parameter and layers as weight holders",
    "torch.nn.functional": "(its ops are compute: the op recorder refuses them in forward)",
    "torch.nn.init": "initialising parameters in __init__",
    "torch.cuda": "device queries (is_available, get_device_properties, current_stream, ...)",
    "cuda_extension": "your kernels",
}

# why some modules are refused (the rest: "not on the import allow-list")
REFUSED_MODULES: dict[str, str] = {
    "subprocess": "starting processes", "multiprocessing": "starting processes", "threading": "background threads",
    "concurrent": "background threads", "asyncio": "background work", "ctypes": "raw memory and C calls",
    "cffi": "raw memory and C calls", "gc": "reading other objects' memory", "inspect": "reading the judge's frames",
    "importlib": "loading code around the judge", "builtins": "patching builtins", "sandbox": "the judge itself",
    "socket": "network access", "urllib": "network access", "http": "network access", "requests": "network access",
    "numpy": "compute outside cuda_extension", "triton": "compute outside cuda_extension",
    "cupy": "compute outside cuda_extension", "numba": "compute outside cuda_extension",
    "jax": "compute outside cuda_extension", "tensorflow": "compute outside cuda_extension",
    "scipy": "compute outside cuda_extension", "array": "compute outside cuda_extension",
    "struct": "reading raw bytes", "model": "the reference model", "cuda_agent_task": "the reference model",
    "cuda_agent_reference": "the reference model", "torch._dynamo": "torch.compile", "torch._inductor": "torch.compile",
    "torch._C": "dispatcher internals", "torch.utils": "dispatcher internals, DLPack and run-time builds",
    "torch.library": "registering kernels for PyTorch's ops", "torch.overrides": "overriding the dispatcher",
    "pickle": "loading stored results", "shelve": "loading stored results", "marshal": "loading code",
    "time": "the clock", "operator": "attribute access by computed name (attrgetter)",
    "functools": "wrapping refused builtins (partial(getattr, ...))", "sys": "the interpreter's module table",
    "os": "files and processes", "io": "files and buffers",
}

# ---------------------------------------------------------------------------------------------------
# modules used by attribute access: which attributes lead to which allowed module, and which are refused

# attribute -> the allowed module it is (`torch.nn`, `F.torch`); other module-valued attributes are refused
CHILDREN: dict[str, dict[str, str]] = {
    "torch": {"nn": "torch.nn", "cuda": "torch.cuda", "ops": "torch.ops", "torch": "torch", "math": "math"},
    "torch.nn": {"functional": "torch.nn.functional", "init": "torch.nn.init"},
    "torch.nn.functional": {"torch": "torch", "math": "math"},
    "torch.nn.init": {"torch": "torch", "math": "math"},
    "torch.cuda": {},
    "torch.ops": {},
    "math": {},
    "typing": {},
    "cuda_extension": {},
}

# torch.cuda: only device queries
CUDA_ALLOWED = frozenset({
    "is_available", "device_count", "current_device", "get_device_name", "get_device_capability",
    "get_device_properties", "current_stream", "default_stream", "is_bf16_supported", "is_tf32_supported",
    "get_arch_list", "mem_get_info", "device", "OutOfMemoryError",
})

_MODULE_ATTR = "a module outside the allow-list"
# attributes refused on one allowed module: its module-valued attributes other than CHILDREN (tests check
# the installed torch has no others), and functions with no place in a ModelNew
MODULE_REFUSED: dict[str, dict[str, str]] = {
    "torch": {
        **dict.fromkeys((
            "accelerator amp ao autograd backends builtins classes compiler cpp cpu ctypes distributed "
            "distributions export fft func functional functools futures fx glob hub importlib inspect jit "
            "library linalg masked monitor mps mtia multiprocessing nested onnx optim os overrides package "
            "platform profiler quantization quasirandom random return_types serialization signal sparse "
            "special storage sys testing textwrap threading torch_version types utils version warnings "
            "windows xpu").split(), _MODULE_ATTR),
        "load": "unpickling files", "save": "writing files", "seed": "the judge's random streams",
        "initial_seed": "the judge's random streams", "get_rng_state": "the judge's random streams",
        "vmap": "function transforms", "cond": "compiled control flow", "while_loop": "compiled control flow",
        "CompilationUnit": "TorchScript", "Graph": "TorchScript", "FileCheck": "TorchScript",
        "PyTorchFileReader": "reading files", "PyTorchFileWriter": "writing files",
        "DeserializationStorageContext": "unpickling", "SerializationStorageContext": "pickling",
        "LiteScriptModule": "TorchScript", "import_ir_module": "TorchScript",
        "import_ir_module_from_buffer": "TorchScript", "ConcreteModuleType": "TorchScript",
        "ConcreteModuleTypeBuilder": "TorchScript", "GraphExecutorState": "TorchScript", "StaticModule": "TorchScript",
    },
    "torch.nn": dict.fromkeys(
        "attention common_types grad intrinsic modules parallel parameter qat quantizable quantized utils".split(),
        _MODULE_ATTR),
    "torch.nn.functional": dict.fromkeys("dataclasses grad importlib np warnings".split(), _MODULE_ATTR),
    "torch.nn.init": dict.fromkeys(["warnings"], _MODULE_ATTR),
    "typing": {
        **dict.fromkeys("collections contextlib functools operator stdlib_re sys types warnings".split(),
                        _MODULE_ATTR),
        "get_type_hints": "evaluating strings as code",
    },
}
# torch.set_* changes process-wide state; only this one is harmless
TORCH_SET_ALLOWED = frozenset({"set_grad_enabled"})

# ---------------------------------------------------------------------------------------------------
# attribute names refused on any object

OUT_OF_TORCH = "a conversion out of torch: the output must come from your kernels"
_ENGINE = "compute or code outside cuda_extension"
_DISPATCH = "getting around the op recorder"
REFUSED_ATTRS: dict[str, str] = {
    # conversions out of torch, raw storage, Python callables over elements
    **dict.fromkeys(("numpy", "tolist", "__array__", "__array_interface__", "__array_struct__", "__array_wrap__",
                     "__array_priority__", "__cuda_array_interface__", "__dlpack__", "__dlpack_device__",
                     "from_numpy", "from_dlpack", "to_dlpack", "dlpack", "frombuffer", "from_buffer", "from_file",
                     "asarray", "untyped_storage", "storage", "_storage", "_typed_storage"), OUT_OF_TORCH),
    **dict.fromkeys(("apply_", "map_", "map2_"), "Python code over a tensor's elements"),
    # the dispatcher and the op recorder
    **dict.fromkeys(("redispatch", "DispatchKey", "DispatchKeySet", "ExcludeDispatchKeyGuard", "DisableTorchFunction",
                     "DisableTorchFunctionSubclass", "py_impl", "py_kernels", "python_key_table", "functorch_table",
                     "py_functionalize_impl", "library", "Library", "overrides", "load_library", "import_module"),
                    _DISPATCH),
    "_C": "dispatcher internals",
    # other engines and code generators
    **dict.fromkeys(("compile", "export", "jit", "fx", "compiler", "jiterator", "CUDAGraph", "make_graphed_callables",
                     "graph_pool_handle", "graphs", "higher_order", "autograd", "vmap", "hub", "package", "onnx", "np", "triton"),
                    _ENGINE),
    **dict.fromkeys(("caching_allocator_alloc", "caching_allocator_delete", "change_current_allocator",
                     "CUDAPluggableAllocator", "MemPool", "use_mem_pool"), "raw device memory"),
    "get_device_module": "reaching modules by name",
    # modules that torch and typing carry as attributes (torch.sys, F.np, typing.operator, ...)
    **dict.fromkeys(("builtins", "sys", "os", "ctypes", "importlib", "inspect", "gc", "glob", "threading",
                     "multiprocessing", "subprocess", "operator", "functools", "contextlib", "traceback",
                     "platform", "dataclasses", "textwrap", "stdlib_re", "pickle", "marshal", "copyreg", "shutil",
                     "pathlib", "tempfile", "socket", "weakref", "utils", "testing", "distributed", "profiler",
                     "serialization", "futures", "monitor"), "reaching modules outside the allow-list"),
    "backends": "changing global backend flags", "set_printoptions": "changing global state",
    "set_float32_matmul_precision": "changing global precision", "set_flush_denormal": "changing global numerics",
    "use_deterministic_algorithms": "changing global flags", "set_default_dtype": "changing global numerics",
    "set_default_device": "changing global defaults", "set_default_tensor_type": "changing global numerics",
    "manual_seed": "the judge's random streams", "set_rng_state": "the judge's random streams",
    "Event": "the timer", "synchronize": "the timer", "elapsed_time": "the timer",
    "Stream": "side streams", "stream": "side streams", "ExternalStream": "side streams", "set_stream": "side streams",
    "cuda_agent_task": "the reference model", "get_type_hints": "evaluating strings as code",
    "ForwardRef": "evaluating strings as code",
    "_getframe": "reading the judge's frames", "f_back": "frames", "f_globals": "frames", "f_locals": "frames",
    "f_builtins": "frames", "f_code": "frames", "gi_frame": "frames", "cr_frame": "frames", "ag_frame": "frames",
    "tb_frame": "frames", "tb_next": "frames", "gi_code": "patching code", "cr_code": "patching code",
    "ag_code": "patching code",
    "__subclasses__": "walking the class tree", "__globals__": "reading other modules", "__code__": "patching code",
    "__dict__": "attribute access by computed name", "__getattribute__": "attribute access by computed name",
    "__getattr__": "attribute access by computed name", "__setattr__": "patching objects",
    "__delattr__": "patching objects", "__builtins__": "patching builtins", "__class__": "walking the class tree",
    "__bases__": "walking the class tree", "__base__": "walking the class tree", "__mro__": "walking the class tree",
    "__self__": "reaching the module behind a builtin", "__closure__": "reading other functions' state",
    "__loader__": "loading code", "__spec__": "loading code", "__module__": "reaching other modules",
}
# dunder attributes an honest ModelNew uses (super().__init__(), type(self).__name__)
ALLOWED_DUNDER_ATTRS = frozenset({"__init__", "__name__", "__qualname__", "__doc__"})
# dunder names a module may use or define
ALLOWED_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__all__"})
ALLOWED_DUNDER_METHODS = frozenset({"__init__", "__repr__"})

# builtins refused wherever they appear, called or not (`e = eval; e(...)` too)
REFUSED_NAMES: dict[str, str] = {
    "exec": "running generated code", "eval": "running generated code", "compile": "running generated code",
    "__import__": "importing around the scan", "globals": "patching module state", "locals": "patching module state",
    "vars": "patching module state", "setattr": "patching objects", "delattr": "patching objects",
    "open": "reading files", "breakpoint": "the debugger", "memoryview": "raw memory", "input": "reading stdin",
    "help": "importing modules (pydoc)", "exit": "stopping the process", "quit": "stopping the process",
    "cuda_agent_task": "the reference model", "cuda_agent_reference": "the reference model",
}
# allowed only as a direct call with a literal attribute name: getattr(obj, "name"[, default])
LITERAL_NAME_CALLS = frozenset({"getattr", "hasattr"})

ALLOWED_SUMMARY = (
    "model_new.py may import only " + ", ".join(ALLOWED_IMPORTS) + "; use modules by attribute access (torch.x, "
    "nn.X, F.x; not stored, passed or rebound); call cuda_extension functions; build parameters and buffers with "
    "torch/nn, assigning attributes only on self; use tensor allocation, view and metadata ops (torch.empty*, "
    ".view, .shape, .stride(), ...). "
    "getattr/hasattr only with a literal attribute name; no private (_x) attributes except on self; no dunder "
    "attributes except " + ", ".join(sorted(ALLOWED_DUNDER_ATTRS)) + "; no conversions out of torch (numpy, "
    "tolist, DLPack, storages); no exec/eval/open/vars/globals. The table is in docs/judge.md (The static scan)."
)
