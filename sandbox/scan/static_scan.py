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

from sandbox.scan.allowlist import (
    ALLOWED_DUNDER_ATTRS,
    ALLOWED_DUNDER_METHODS,
    ALLOWED_DUNDER_NAMES,
    ALLOWED_IMPORTS,
    ALLOWED_SUMMARY,
    CHILDREN,
    CUDA_ALLOWED,
    LITERAL_NAME_CALLS,
    MODULE_REFUSED,
    OUT_OF_TORCH,
    REFUSED_ATTRS,
    REFUSED_MODULES,
    REFUSED_NAMES,
    TORCH_SET_ALLOWED,
)
from sandbox.scan.selfnames import binds, is_dunder, self_attributes


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
        return OUT_OF_TORCH
    if is_dunder(name):
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
        self.self_attrs, self.self_chains = self_attributes(
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
                if is_dunder(node.name) and node.name not in ALLOWED_DUNDER_METHODS:
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
        elif is_dunder(node.id) and node.id not in ALLOWED_DUNDER_NAMES:
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
            for name in sorted(binds(n) & set(self.modules)):
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
