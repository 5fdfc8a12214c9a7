"""A static look at model_new.py before any of it runs, in the judge's own process.

The dynamic checks run inside the candidate's process, where a determined candidate could
patch the judge's code; this scan refuses the constructs such patching (and the usual shortcuts)
needs. It is a first line, not the only one: every dynamic check stays on.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# modules whose import in model_new.py has no honest use in a forward built on cuda_extension
FORBIDDEN_MODULES = {
    "subprocess": "starting processes", "multiprocessing": "starting processes", "threading": "background threads",
    "concurrent": "background threads", "asyncio": "background work", "ctypes": "raw memory and C calls",
    "cffi": "raw memory and C calls", "gc": "reading other objects' memory", "inspect": "reading the judge's frames",
    "importlib": "loading code around the judge", "builtins": "patching builtins", "sandbox": "the judge itself",
    "socket": "network access", "urllib": "network access", "http": "network access", "requests": "network access",
    "triton": "compute outside cuda_extension", "cupy": "compute outside cuda_extension",
    "numba": "compute outside cuda_extension", "jax": "compute outside cuda_extension",
    "tensorflow": "compute outside cuda_extension", "model": "the reference model",
    "cuda_agent_task": "the reference model", "cuda_agent_reference": "the reference model",
    "torch._dynamo": "torch.compile", "torch._inductor": "torch.compile", "torch._C": "dispatcher internals",
    "torch.utils._python_dispatch": "dispatcher internals", "torch.utils.cpp_extension": "building code at run time",
    "pickle": "loading stored results", "shelve": "loading stored results", "time": "the clock",
}
FORBIDDEN_CALLS = {
    "exec": "running generated code", "eval": "running generated code", "compile": "running generated code",
    "__import__": "importing around the scan", "globals": "patching module state", "setattr": "patching objects",
    "delattr": "patching objects", "vars": "patching module state", "open": "reading files",
}
FORBIDDEN_ATTRS = {
    "_getframe": "reading the judge's frames",
    "set_float32_matmul_precision": "changing global precision", "backends": "changing global backend flags",
    "Event": "the timer", "synchronize": "the timer", "elapsed_time": "the timer", "_C": "dispatcher internals",
    "set_flush_denormal": "changing global numerics", "use_deterministic_algorithms": "changing global flags",
    "set_default_dtype": "changing global numerics", "manual_seed": "the judge's random streams",
    "Stream": "side streams", "stream": "side streams", "cuda_agent_task": "the reference model",
    "__subclasses__": "walking the class tree", "__globals__": "reading other modules", "f_back": "frames",
    "f_globals": "frames", "gi_frame": "frames", "__code__": "patching code",
}


# attributes forbidden only on a given owner (`self.modules()` is fine, `sys.modules` is not)
OWNED_ATTRS = {("sys", "modules"): "sys.modules access", ("torch", "compile"): "torch.compile"}


@dataclass(frozen=True)
class Finding:
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what} ({self.why})"


def _module_hit(name: str) -> str | None:
    for mod, why in FORBIDDEN_MODULES.items():
        if name == mod or name.startswith(mod + "."):
            return why
    return None


def scan_model_new(source: str) -> list[Finding]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # the import in the worker reports syntax errors with their location
    out: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if why := _module_hit(a.name):
                    out.append(Finding(node.lineno, f"import {a.name}", why))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if why := _module_hit(node.module):
                out.append(Finding(node.lineno, f"from {node.module} import ...", why))
            for a in node.names:
                if why := _module_hit(f"{node.module}.{a.name}"):
                    out.append(Finding(node.lineno, f"from {node.module} import {a.name}", why))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            out.append(Finding(node.lineno, f"{node.func.id}(...)", FORBIDDEN_CALLS[node.func.id]))
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            out.append(Finding(node.lineno, f".{node.attr}", FORBIDDEN_ATTRS[node.attr]))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and (node.value.id, node.attr) in OWNED_ATTRS):
            out.append(Finding(node.lineno, f"{node.value.id}.{node.attr}", OWNED_ATTRS[(node.value.id, node.attr)]))
        elif isinstance(node, ast.Name) and node.id in ("cuda_agent_task", "cuda_agent_reference"):
            out.append(Finding(node.lineno, node.id, "the reference model"))
        elif isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            for base in node.bases:
                text = ast.unparse(base)
                if text.split(".")[-1] not in ("Module",):
                    out.append(Finding(node.lineno, f"class ModelNew({text})",
                                       "ModelNew must derive from nn.Module directly, not wrap or extend Model"))
    out.sort(key=lambda f: f.line)
    return out


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
