"""KernelBench-style single-file solutions (ModelNew + torch.utils.cpp_extension.load_inline) turned
into workspace form, so the sandbox's judge scores them exactly as it scores an agent's workspace.

The judge refuses run-time builds in model_new.py and requires the forward to go through
cuda_extension, so a load_inline file cannot be judged as it is. The conversion moves the
kernel sources into kernels/ and leaves the Python alone except for the build:
  cuda_sources  -> kernels/NAME.cu
  cpp_sources   -> kernels/NAME_binding.cpp, plus a REGISTER_BINDING that defines `functions`
                   (or the file's own PYBIND11_MODULE body, renamed into a registration function)
  load_inline(...) in model_new.py -> cuda_extension, and the cpp_extension import removed.
Sources must be string constants of the file (literals, concatenations, names bound to them at
module level); the file itself is never executed here.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

_PYBIND_MODULE = re.compile(r"PYBIND11_MODULE\s*\(\s*\w+\s*,\s*(\w+)\s*\)")
_LOAD_INLINE_PARAMS = ("name", "cpp_sources", "cuda_sources", "functions")


class ConversionError(ValueError):
    """The file cannot be converted; the message says which part."""


@dataclass
class Converted:
    files: dict[str, str]
    notes: list[str] = field(default_factory=list)


class _Consts:
    """Module-level names bound to string constants, evaluated without running the file."""

    def __init__(self, tree: ast.Module):
        self.env: dict[str, Any] = {}
        for node in tree.body:
            targets: list[ast.expr] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            if value is None:
                continue
            try:
                v = self.eval(value)
            except ConversionError:
                continue
            for t in targets:
                if isinstance(t, ast.Name):
                    self.env[t.id] = v

    def eval(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            raise ConversionError(f"{node.id} is not a string constant of the file")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.eval(node.left) + self.eval(node.right)
        if isinstance(node, ast.List | ast.Tuple):
            return [self.eval(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                elif isinstance(v, ast.FormattedValue) and v.format_spec is None and v.conversion == -1:
                    parts.append(str(self.eval(v.value)))
                else:
                    raise ConversionError("an f-string with formatting")
            return "".join(parts)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and isinstance(node.func.value, ast.Constant) and len(node.args) == 1 and not node.keywords):
            return node.func.value.value.join(self.eval(node.args[0]))
        raise ConversionError(f"a {type(node).__name__} expression where a string constant was expected")


def _is_load_inline(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == "load_inline") or (isinstance(f, ast.Attribute)
                                                                   and f.attr == "load_inline")


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _functions(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return list(value)
    return [str(v) for v in value]


def _ident(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "ext"
    if base[0].isdigit():
        base = "ext_" + base
    out, n = base, 2
    while out in taken:
        out, n = f"{base}_{n}", n + 1
    taken.add(out)
    return out


def _binding(ident: str, cpp: str, functions: list[str]) -> str:
    reg = f"cuda_agent_register_{ident}"
    # binding_registry.h first: pybind11's headers are then opened as the judge's interface header marks them, so
    # its inline code (and the Python C API that code imports) stays in the infrastructure object; the object scan
    # refuses that API in the agent's own objects (sandbox/scan/object_scan.py)
    head = ["// converted from a load_inline solution by the cuda-agent harness",
            '#include "binding_registry.h"', "#include <torch/extension.h>", ""]
    if _PYBIND_MODULE.search(cpp):
        body = _PYBIND_MODULE.sub(lambda m: f"static void {reg}(pybind11::module& {m.group(1)})", cpp, count=1)
        return "\n".join(head) + body + f"\n\nREGISTER_BINDING({ident}, {reg});\n"
    if not functions:
        raise ConversionError(f"load_inline(name={ident!r}) has neither `functions` nor a PYBIND11_MODULE")
    defs = "\n".join(f'  m.def("{f}", &{f}, "{f}");' for f in functions)
    return "\n".join(head) + cpp + f"\n\nstatic void {reg}(pybind11::module& m) {{\n{defs}\n}}\n\n" \
        f"REGISTER_BINDING({ident}, {reg});\n"


def _byte_offsets(source: str) -> list[int]:
    starts, total = [], 0
    for line in source.encode().splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    starts.append(total)
    return starts


def _span(node: ast.AST, starts: list[int]) -> tuple[int, int]:
    return (starts[node.lineno - 1] + node.col_offset,  # type: ignore[attr-defined]
            starts[node.end_lineno - 1] + node.end_col_offset)  # type: ignore[attr-defined]


def _import_replacement(node: ast.stmt) -> str | None:
    """What an import of cpp_extension becomes (None: leave the statement alone)."""
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.startswith("torch.utils.cpp_extension"):
            return "pass"
        if node.module == "torch.utils" and any(a.name == "cpp_extension" for a in node.names):
            rest = [a for a in node.names if a.name != "cpp_extension"]
            if not rest:
                return "pass"
            return "from torch.utils import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                          for a in rest)
    if isinstance(node, ast.Import) and any(a.name.startswith("torch.utils.cpp_extension") for a in node.names):
        keep = [a for a in node.names if not a.name.startswith("torch.utils.cpp_extension")]
        # `import torch.utils.cpp_extension` also binds `torch`
        binds_torch = any(a.asname is None for a in node.names if a.name.startswith("torch.utils.cpp_extension"))
        names = [a.name + (f" as {a.asname}" if a.asname else "") for a in keep] + (["torch"] if binds_torch else [])
        return "import " + ", ".join(names) if names else "pass"
    return None


def convert_load_inline(source: str) -> Converted:
    """Workspace files (model_new.py and kernels/...) for a load_inline solution."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ConversionError(f"not valid Python: {e.msg} (line {e.lineno})") from None
    consts = _Consts(tree)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_load_inline(n)]
    if not calls:
        raise ConversionError("no load_inline(...) call")
    files: dict[str, str] = {}
    taken: set[str] = set()
    functions_seen: set[str] = set()
    notes: list[str] = []
    for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
        args: dict[str, Any] = {}
        for name, node in zip(_LOAD_INLINE_PARAMS, call.args, strict=False):
            args[name] = consts.eval(node)
        for kw in call.keywords:
            if kw.arg in _LOAD_INLINE_PARAMS:
                args[kw.arg] = consts.eval(kw.value)
            elif kw.arg in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths"):
                try:
                    flags = [f for f in _functions(consts.eval(kw.value)) if f.strip()]
                except ConversionError:
                    flags = ["(not constant)"]
                if flags:
                    notes.append(f"{kw.arg}={flags} ignored: the sandbox builds with its own flags")
        ident = _ident(str(args.get("name") or "ext"), taken)
        cpp, cuda = _text(args.get("cpp_sources")), _text(args.get("cuda_sources"))
        functions = _functions(args.get("functions"))
        dup = functions_seen & set(functions)
        if dup:
            raise ConversionError(f"functions defined by two load_inline calls: {', '.join(sorted(dup))}")
        functions_seen.update(functions)
        if cuda:
            files[f"kernels/{ident}.cu"] = "// converted from a load_inline solution by the cuda-agent harness\n" + cuda
        files[f"kernels/{ident}_binding.cpp"] = _binding(ident, cpp, functions)

    starts = _byte_offsets(source)
    edits: list[tuple[int, int, str]] = [(*_span(c, starts), "cuda_extension") for c in calls]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            replacement = _import_replacement(node)
            if replacement is not None:
                edits.append((*_span(node, starts), replacement))
    # an import of cuda_extension where the file's imports start (after a docstring and __future__)
    insert_at = 0
    for node in tree.body:
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        if is_doc or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            insert_at = starts[node.end_lineno]  # type: ignore[attr-defined]
            continue
        break
    edits.append((insert_at, insert_at, "import cuda_extension  # built from kernels/ by the sandbox\n"))
    data = source.encode()
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        data = data[:start] + text.encode() + data[end:]
    files["model_new.py"] = data.decode()
    try:
        ast.parse(files["model_new.py"])
    except SyntaxError as e:
        raise ConversionError(f"the rewritten model_new.py does not parse: {e.msg} (line {e.lineno})") from None
    return Converted(files=files, notes=notes)
