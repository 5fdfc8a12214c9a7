"""Which names and attributes belong to model_new.py's own objects: what the file binds, the private
names it gives `self`, and the attribute chains rooted at a method's own `self` (the static scan allows
private names and attribute stores there only)."""

from __future__ import annotations

import ast

from sandbox.scan.allowlist import LITERAL_NAME_CALLS


def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def binds(n: ast.AST) -> set[str]:
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


def bound_names(node: ast.AST, skip: ast.arg | None = None) -> set[str]:
    """Every name bound anywhere under node, but for the parameter `skip`."""
    return {name for n in ast.walk(node) if n is not skip for name in binds(n)}


_REGISTERS = frozenset({"register_buffer", "register_parameter", "add_module", "register_module"})


def own_private_names(tree: ast.Module) -> set[str]:
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
                out |= {name for name in binds(stmt) if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)}
                if isinstance(stmt, ast.Assign | ast.AnnAssign):
                    out |= {t.id for t in ast.walk(stmt) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    return {name for name in out if name.startswith("_") and not is_dunder(name)}


# decorators that leave a method's self the instance: torch.no_grad(), torch.inference_mode(), property
_PLAIN_DECORATORS = frozenset({"no_grad", "inference_mode", "enable_grad"})


def plain_decorator(node: ast.expr, torch_names: set[str]) -> bool:
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
    if isinstance(node, ast.Name):
        return node.id == "property"
    return (isinstance(node, ast.Attribute) and node.attr in _PLAIN_DECORATORS and isinstance(node.value, ast.Name)
            and node.value.id in torch_names)


def self_attributes(tree: ast.Module, torch_names: set[str]) -> tuple[set[int], set[int]]:
    """ids of `self._x` Attribute nodes allowed a private name: `self` is the first parameter (no default) of
    a function defined in a class body (undecorated, or under torch.no_grad() or property), never rebound inside it, and `_x` is a name the file
    itself gives self (an attribute it assigns, a method or class attribute it defines). Also the ids of
    every attribute chain rooted at such a `self` (`self.x`, `self.conv.weight`): the only ones assigned."""
    own = own_private_names(tree)
    ok: set[int] = set()
    chains: set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or not all(
                    plain_decorator(d, torch_names) for d in fn.decorator_list):
                continue
            positional = fn.args.posonlyargs + fn.args.args
            if not positional or len(fn.args.defaults) >= len(positional):
                continue
            first = positional[0]
            if first.arg in bound_names(fn, skip=first) - {fn.name}:
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
