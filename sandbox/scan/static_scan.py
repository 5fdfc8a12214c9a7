"""A static look at model_new.py before any of it runs, in the judge's own process.

The dynamic checks run inside the candidate's process, where a determined candidate could patch the
judge's code or switch its op recorder off; this scan refuses the constructs such patching (and the
usual shortcuts) needs. It is an allow-list: model_new.py may import a few modules, use them by plain
attribute access, and call cuda_extension. It is a first line, not the only one: every dynamic check
stays on. docs/judge.md ("The static scan") holds the same rules as one table.

What the scan cannot see (Python arithmetic on scalars read out of a tensor with float() or .item(),
a tensor's text from str()/repr(), aliases of torch classes) is left to the dynamic layer.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

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

_OUT = "a conversion out of torch: the output must come from your kernels"
_ENGINE = "compute or code outside cuda_extension"
_DISPATCH = "getting around the op recorder"
REFUSED_ATTRS: dict[str, str] = {
    # conversions out of torch, raw storage, Python callables over elements
    **dict.fromkeys(("numpy", "tolist", "__array__", "__array_interface__", "__array_struct__", "__array_wrap__",
                     "__array_priority__", "__cuda_array_interface__", "__dlpack__", "__dlpack_device__",
                     "from_numpy", "from_dlpack", "to_dlpack", "dlpack", "frombuffer", "from_buffer", "from_file",
                     "asarray", "untyped_storage", "storage", "_storage", "_typed_storage"), _OUT),
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


@dataclass(frozen=True)
class Finding:
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what} ({self.why})"


def refusal_message(findings: list[Finding], limit: int = 8) -> str:
    """What verify and profile say when the scan refuses model_new.py: the findings, then what is allowed."""
    listed = "; ".join(str(f) for f in findings[:limit])
    if len(findings) > limit:
        listed += f"; and {len(findings) - limit} more"
    return f"model_new.py uses constructs the judge does not allow: {listed}. {ALLOWED_SUMMARY}"


def refusal(source: str) -> str | None:
    """The refusal message for a model_new.py source, or None when the scan finds nothing."""
    findings = scan_model_new(source)
    return refusal_message(findings) if findings else None


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _module_why(name: str) -> str | None:
    """None when the module may be imported; otherwise why not."""
    if name in ALLOWED_IMPORTS:
        return None
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:i])) in REFUSED_MODULES:
            return REFUSED_MODULES[prefix]
    if any(p.startswith("_") for p in parts):
        return "private module"
    return "not on the import allow-list"


def _attr_why(name: str, on_self: bool) -> str | None:
    """Why an attribute name is refused on any object (None: it is not)."""
    if name in REFUSED_ATTRS:
        return REFUSED_ATTRS[name]
    if name.endswith("Storage"):
        return _OUT
    if _is_dunder(name):
        return None if name in ALLOWED_DUNDER_ATTRS else "dunder attribute"
    if name.startswith("_") and not on_self:
        return "private attribute: allowed only as self._x, for names this file gives self"
    return None


def _member_why(module: str, name: str) -> str | None:
    """Why `name` is refused on an allowed module (None: it is not)."""
    if name in CHILDREN.get(module, {}):
        return None
    if module == "torch.cuda" and name not in CUDA_ALLOWED:
        return "torch.cuda offers only device queries here: " + ", ".join(sorted(CUDA_ALLOWED))
    if name in MODULE_REFUSED.get(module, {}):
        return MODULE_REFUSED[module][name]
    if module == "torch" and name.startswith("set_") and name not in TORCH_SET_ALLOWED:
        return "changing global state"
    if module == "torch" and name.startswith("Script"):
        return "TorchScript"
    return None


def _binds(n: ast.AST) -> set[str]:
    """The names one node binds (assignment targets, parameters, imports, handlers, patterns, defs)."""
    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del):
        return {n.id}
    if isinstance(n, ast.arg):
        return {n.arg}
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {n.name}
    if isinstance(n, ast.alias):
        return {n.asname or n.name.split(".")[0]}
    if isinstance(n, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and n.name:
        return {n.name}
    if isinstance(n, ast.MatchMapping) and n.rest:
        return {n.rest}
    if isinstance(n, ast.Global | ast.Nonlocal):
        return set(n.names)
    return set()


def _bound_names(node: ast.AST, skip: ast.arg | None = None) -> set[str]:
    """Every name bound anywhere under node, but for the parameter `skip`."""
    return {name for n in ast.walk(node) if n is not skip for name in _binds(n)}


_REGISTERS = frozenset({"register_buffer", "register_parameter", "add_module", "register_module"})


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names the file itself gives its objects: `self._x = ...`, and defs or assignments in class bodies."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name):
            out.add(n.attr)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _REGISTERS
              and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
            out.add(n.args[0].value)  # self.register_buffer("_scale", ...)
        elif isinstance(n, ast.ClassDef):
            for stmt in n.body:
                out |= {name for name in _binds(stmt) if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)}
                if isinstance(stmt, ast.Assign | ast.AnnAssign):
                    out |= {t.id for t in ast.walk(stmt) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    return {name for name in out if name.startswith("_") and not _is_dunder(name)}


# decorators that leave a method's self the instance: torch.no_grad(), torch.inference_mode(), property
_PLAIN_DECORATORS = frozenset({"no_grad", "inference_mode", "enable_grad"})


def _plain_decorator(node: ast.expr, torch_names: set[str]) -> bool:
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
    if isinstance(node, ast.Name):
        return node.id == "property"
    return (isinstance(node, ast.Attribute) and node.attr in _PLAIN_DECORATORS and isinstance(node.value, ast.Name)
            and node.value.id in torch_names)


def _self_attributes(tree: ast.Module, torch_names: set[str]) -> tuple[set[int], set[int]]:
    """ids of `self._x` Attribute nodes allowed a private name: `self` is the first parameter (no default) of
    a function defined in a class body (undecorated, or under torch.no_grad() or property), never rebound inside it, and `_x` is a name the file
    itself gives self (an attribute it assigns, a method or class attribute it defines). Also the ids of
    every attribute chain rooted at such a `self` (`self.x`, `self.conv.weight`): the only ones assigned."""
    own = _own_private_names(tree)
    ok: set[int] = set()
    chains: set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or not all(
                    _plain_decorator(d, torch_names) for d in fn.decorator_list):
                continue
            positional = fn.args.posonlyargs + fn.args.args
            if not positional or len(fn.args.defaults) >= len(positional):
                continue
            first = positional[0]
            if first.arg in _bound_names(fn, skip=first) - {fn.name}:
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.Attribute):
                    root = n.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id == first.arg:
                        chains.add(id(n))
                if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == first.arg
                        and n.attr in own):
                    ok.add(id(n))
                elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in LITERAL_NAME_CALLS
                      and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id == first.arg
                      and isinstance(n.args[1], ast.Constant) and n.args[1].value in own):
                    ok.add(id(n))  # getattr(self, "_cache", None)
    return ok, chains


class _Scan:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.out: list[Finding] = []
        self.nodes = list(ast.walk(tree))
        self.parent: dict[int, ast.AST] = {}
        for n in self.nodes:
            for c in ast.iter_child_nodes(n):
                self.parent[id(c)] = n
        self.modules: dict[str, str] = {}  # local name -> allowed module it is bound to by an import
        self.module_aliases: set[int] = set()  # ids of alias nodes that bound them
        self.classes = {n.name for n in self.nodes if isinstance(n, ast.ClassDef)}
        # annotations: stored in __annotations__, which nothing allowed here reads back
        notes = [n.annotation for n in self.nodes if isinstance(n, ast.arg | ast.AnnAssign) and n.annotation]
        notes += [n.returns for n in self.nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.returns]
        self.in_annotation = {id(x) for a in notes for x in ast.walk(a)}

    def add(self, node: ast.AST, what: str | Callable[[], str], why: str) -> None:
        text = what() if callable(what) else what
        if len(text) > 120:
            text = text[:117] + "..."
        self.out.append(Finding(getattr(node, "lineno", 0), text, why))

    # -- imports ------------------------------------------------------------------------------------

    def bind(self, node: ast.AST, alias: ast.alias, name: str, module: str) -> None:
        if self.modules.get(name, module) != module:
            self.add(node, f"{name} bound to both {self.modules[name]} and {module}", "rebinding a module name")
        self.modules[name] = module
        self.module_aliases.add(id(alias))

    def imports(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if why := _module_why(a.name):
                        self.add(node, f"import {a.name}", why)
                    elif a.asname:
                        self.bind(node, a, a.asname, a.name)
                    else:  # `import torch.nn` binds torch
                        self.bind(node, a, a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    self.add(node, f"from {'.' * node.level}{mod} import ...", "relative import")
                    continue
                if why := _module_why(mod):
                    self.add(node, f"from {mod} import ...", why)
                    continue
                for a in node.names:
                    if a.name == "*":
                        self.add(node, f"from {mod} import *", "star import: import the names you use")
                        continue
                    if child := CHILDREN.get(mod, {}).get(a.name):  # from torch import nn
                        self.bind(node, a, a.asname or a.name, child)
                    elif why := (_attr_why(a.name, False) or _member_why(mod, a.name)):
                        self.add(node, f"from {mod} import {a.name}", why)

    # -- module expressions -------------------------------------------------------------------------

    def module_of(self, node: ast.AST) -> str | None:
        """The allowed module an expression is, if it is one (`torch`, `torch.nn`, `F.torch`)."""
        if isinstance(node, ast.Name):
            return self.modules.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.module_of(node.value)
            if base is not None:
                return CHILDREN.get(base, {}).get(node.attr)
        return None

    def is_class_ref(self, node: ast.AST) -> bool:
        """A class this file defines, named (`ModelNew`), or type(...) of something."""
        if isinstance(node, ast.Name):
            return node.id in self.classes
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"

    def check_class_use(self, node: ast.Name | ast.Call) -> None:
        """A class this file defines, or type(...), only instantiated, named as a base, tested (isinstance,
        issubclass, super, as_subclass, comparisons) or asked for a dunder: never stored or passed on, where
        its methods could be reached through an alias and handed any object as self."""
        parent = self.parent.get(id(node))
        if id(node) in self.in_annotation:
            return
        if isinstance(parent, ast.Call) and parent.func is node and isinstance(node, ast.Name):
            return
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return  # checked as an attribute: dunders only
        if isinstance(parent, ast.ClassDef) and node in parent.bases or isinstance(parent, ast.Compare):
            return
        if isinstance(parent, ast.Call) and node in parent.args and (
                (isinstance(parent.func, ast.Name) and parent.func.id in ("isinstance", "issubclass", "super"))
                or (isinstance(parent.func, ast.Attribute) and parent.func.attr == "as_subclass")):
            return
        self.add(node, ast.unparse(node), "a class used as a value: instantiate it, test with isinstance, or "
                 "ask for __name__")

    def root(self, node: ast.AST) -> ast.AST:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node

    def check_module_use(self, node: ast.Name | ast.Attribute) -> None:
        mod = self.module_of(node)
        if mod is None or mod == "cuda_extension" or not isinstance(node.ctx, ast.Load):
            return  # (stores are rebindings, refused apart)
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return
        self.add(node, ast.unparse(node), f"the module {mod} used as a value: use it only as {ast.unparse(node)}.name")

    # -- the walk -----------------------------------------------------------------------------------

    def check_attribute(self, node: ast.AST, receiver: ast.AST | None, name: str,
                        what: str | Callable[[], str]) -> None:
        on_self = id(node) in self.self_attrs
        if why := _attr_why(name, on_self):
            self.add(node, what, why)
            return
        if receiver is not None and self.is_class_ref(receiver) and name not in ("__name__", "__qualname__", "__doc__"):
            self.add(node, what, "attributes through the class, not an instance: use self.name (a method "
                     "reached through its class can be handed any object as self)")
            return
        mod = self.module_of(receiver) if receiver is not None else None
        if mod is not None and (why := _member_why(mod, name)):
            self.add(node, what, why)

    def run(self) -> list[Finding]:
        self.imports()
        self.self_attrs, self.self_chains = _self_attributes(
            self.tree, {name for name, mod in self.modules.items() if mod == "torch"})
        for node in self.nodes:
            if isinstance(node, ast.Attribute):
                self.check_attribute(node, node.value, node.attr, lambda node=node: ast.unparse(node))
                if isinstance(node.ctx, ast.Store | ast.Del) and id(node) not in self.self_chains:
                    root = self.root(node)
                    self.add(node, lambda node=node: f"{ast.unparse(node)} = ..." if isinstance(node.ctx, ast.Store)
                             else f"del {ast.unparse(node)}",
                             "patching an imported module or its classes"
                             if isinstance(root, ast.Name) and root.id in self.modules
                             else "assigning attributes of anything but a method's self (patching other objects)")
                self.check_module_use(node)
            elif isinstance(node, ast.Name):
                self.check_name(node)
            elif isinstance(node, ast.Call):
                self.check_call(node)
                if self.is_class_ref(node):
                    self.check_class_use(node)
            elif isinstance(node, ast.MatchClass):
                for attr in node.kwd_attrs:
                    self.check_attribute(node, None, attr, f"case ...({attr}=...)")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _is_dunder(node.name) and node.name not in ALLOWED_DUNDER_METHODS:
                    self.add(node, f"def {node.name}", "defining this special method (allowed: "
                             + ", ".join(sorted(ALLOWED_DUNDER_METHODS)) + ")")
            elif isinstance(node, ast.ClassDef):
                self.check_class(node)
        self.check_rebinding()
        return sorted(set(self.out), key=lambda f: (f.line, f.what))

    def check_name(self, node: ast.Name) -> None:
        if node.id in self.classes and isinstance(node.ctx, ast.Load):
            self.check_class_use(node)
        if node.id in REFUSED_NAMES:
            self.add(node, node.id, REFUSED_NAMES[node.id])
        elif node.id in LITERAL_NAME_CALLS:
            call = self.parent.get(id(node))
            if not (isinstance(call, ast.Call) and call.func is node):
                self.add(node, node.id, f"{node.id} used as a value: call {node.id}(obj, 'name') directly")
        elif node.id == "type":
            call = self.parent.get(id(node))
            if not (isinstance(call, ast.Call) and call.func is node and len(call.args) == 1 and not call.keywords):
                self.add(node, "type", "type() only with one argument (building classes from strings is refused)")
        elif _is_dunder(node.id) and node.id not in ALLOWED_DUNDER_NAMES:
            self.add(node, node.id, "dunder name (allowed: " + ", ".join(sorted(ALLOWED_DUNDER_NAMES)) + ")")
        self.check_module_use(node)

    def check_call(self, node: ast.Call) -> None:
        f = node.func
        if not (isinstance(f, ast.Name) and f.id in LITERAL_NAME_CALLS):
            return
        name = node.args[1] if len(node.args) >= 2 else None
        if node.keywords or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            self.add(node, f"{f.id}({', '.join(ast.unparse(a) for a in node.args)})",
                     "attribute access by computed name: write the attribute out, or use "
                     "self.get_submodule(name) / self.get_parameter(name)")
            return
        self.check_attribute(node, node.args[0], name.value, f"{f.id}(..., {name.value!r})")

    def check_class(self, node: ast.ClassDef) -> None:
        for kw in node.keywords:
            self.add(node, f"class {node.name}(..., {kw.arg}=...)", "class keywords (metaclass)")
        if node.name == "ModelNew":
            for base in node.bases:
                text = ast.unparse(base)
                if text.split(".")[-1] != "Module":
                    self.add(node, f"class ModelNew({text})",
                             "ModelNew must derive from nn.Module directly, not wrap or extend Model")

    def check_rebinding(self) -> None:
        """A name an import binds to a module is never bound again: the module checks above follow names."""
        for n in self.nodes:
            if isinstance(n, ast.alias) and id(n) in self.module_aliases:
                continue
            for name in sorted(_binds(n) & set(self.modules)):
                self.add(n, name, f"rebinding {name}, the imported module {self.modules[name]}")


def scan_model_new(source: str) -> list[Finding]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # the import in the worker reports syntax errors with their location
    except (RecursionError, MemoryError, ValueError):
        return [Finding(1, "model_new.py", "too deeply nested to check: write it plainly")]
    try:
        return _Scan(tree).run()
    except (RecursionError, MemoryError):  # what cannot be checked is refused, never passed
        return [Finding(1, "model_new.py", "too deeply nested to check: write it plainly")]


def shape_overrides(task_source: str) -> dict[str, int]:
    """Module-level integer sizes that only get_inputs() reads, moved to other (odd) values.

    Sizes that Model or get_init_inputs() also read define the weights, so they stay; tiny ones
    (1-4) are usually structural (channels, dims) and stay too.
    """
    try:
        tree = ast.parse(task_source)
    except SyntaxError:
        return {}
    ints: dict[str, int] = {}
    used_elsewhere: set[str] = set()
    used_by_inputs: set[str] = set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
            ints[node.targets[0].id] = node.value.value
        elif isinstance(node, ast.FunctionDef) and node.name == "get_inputs":
            used_by_inputs |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            used_elsewhere |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Assign):  # derived globals (shape = (dim,)) carry their inputs along
            used_elsewhere |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return {name: value * 3 // 4 + 1 for name, value in ints.items()
            if name in used_by_inputs and name not in used_elsewhere and value > 4}
