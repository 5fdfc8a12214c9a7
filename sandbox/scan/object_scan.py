"""The agent's own objects, scanned before they are linked: the Python C API is one family there.

The linked extension's scan (symbol_scan.py) must let the Python C API through, because the infrastructure object
linked into every extension is pybind11's own code and needs a good part of it (the builtins, the GIL, attribute
access, dicts). Read from the linked .so, the agent's imports are mixed with pybind11's, so `PyEval_GetBuiltins`
gave `exec`, `PyGILState_Ensure` and `PyObject_CallMethod` ran `torch.Tensor.mm` on a thread no op recorder
watched, and `PyObject_CallFunction` rebound the judge's timer (Judge IX). Here each object compiled from
kernels/ is read before the link, and its undefined symbols of the Python family (the C API, torch's THP* Python
objects, pybind11's members) must be on an allow-list of what an honest binding's object imports: what
pybind11's `module::def`, its argument casters and torch's tensor casters leave in the object that instantiates
them (tests/fixtures/symbols/honest_idioms, cpu_plumbing, cuda_plumbing, the repository's solutions). Evaluation,
imports, calls of Python objects, attribute writes, dicts, frames, the GIL's acquisition, `THPVariable_*` and
pybind11's ways to them (`module_::import`, `.attr()`, `eval`) are not on it.

A build runs this file by path as a ninja step between the compiles and the link (`python -I`, no torch): it
prints FORBIDDEN_MARK and the refusal and exits 1, so nothing is linked; compile_workspace returns
`forbidden_symbol`. A binding compiled against pybind11's full header (one that uses a pybind11 member the
shared infrastructure object does not hold) carries pybind11's inline code itself, with its imports; such a
binding is refused too, and the message says to keep to `m.def` of plain functions.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path from build.ninja: the repository root, for the package's own modules
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sandbox.scan.elf_read import elf_info  # noqa: E402
from sandbox.scan.mangled import qualified_name  # noqa: E402

FAMILY = "python_c_api"
FORBIDDEN_MARK = "cuda-agent: forbidden_symbol: "
LABEL = "the Python C API in your own code"
RULE = ("kernels/ may not use the Python C API, torch's Python objects (THPVariable_*) or pybind11 beyond "
        "binding functions with m.def: no embedded Python, no Python calls, attribute or dict access, no GIL "
        "acquisition, no frames or imports. The rule is in SKILL.md (Rules)")
_SHOWN = 12
# shown first: the names that run Python, call into it or take the GIL, which tell an agent (and a reader) what its
# code did; an object compiled by nvcc imports dozens of pybind11's internals beside them (PyCapsule_*, PyType_*),
# which sorted first by name and hid the telling ones past the twelve shown (H200, 2026-12-03). Matched inside
# mangled names too (torch's THPVariable_Wrap is a C++ function)
_TELLING = ("PyEval_", "PyRun_", "PyImport_", "PyGILState_Ensure", "PyObject_Call", "PyObject_GetAttr",
            "PyObject_SetAttr", "PyDict_GetItem", "PyCFunction_Call", "PyThreadState_New", "THPVariable_")

# what an honest binding's object imports of the C API (pybind11's def, casters and error handling, torch's tensor
# and dtype casters): errors, numbers, bytes and strings read, sequences read, references counted. Two names of
# the refused kinds stay because pybind11's `module::def`, instantiated in the binding, uses them: it looks up an
# overload sibling by name (PyObject_GetAttrString) and checks that the GIL is held (PyGILState_Check).
_PY_EXACT = frozenset({
    "PyGILState_Check", "PyObject_GetAttrString", "PyType_IsSubtype", "PyIndex_Check", "PyIter_Next",
    "PyObject_GetIter", "PyList_New", "PyList_Size", "PyList_Append", "PyTuple_New", "PyTuple_Size",
    "PySequence_Check", "PySequence_Size", "PySequence_Fast", "PyUnicode_AsUTF8AndSize", "PyUnicode_AsUTF8",
    "PyUnicode_AsUTF8String", "PyUnicode_AsEncodedString", "PyUnicode_FromString", "PyUnicode_FromStringAndSize",
    "PyUnicode_DecodeUTF8", "PyNumber_Check", "PyNumber_Float", "PyNumber_Long", "PyNumber_Index",
    "PyObject_IsTrue", "PyObject_Free", "PyMem_Free", "Py_IncRef", "Py_DecRef", "_Py_Dealloc", "_Py_NoneStruct",
    "_Py_TrueStruct", "_Py_FalseStruct", "_Py_NotImplementedStruct", "_Py_IncRef", "_Py_DecRef",
    "PyBool_Type", "PyFloat_Type", "PyLong_Type", "PyTuple_Type", "PyList_Type", "PyUnicode_Type", "PyBytes_Type",
    "PyByteArray_Type", "PyComplex_Type",
    # pybind11/stl.h's list, vector and set casters (a std::vector or std::set argument or result): they read a
    # sequence as a tuple, tell sets and generators apart by type, and build a set to return
    "PySequence_Tuple", "PySequence_GetItem", "PySet_Type", "PyFrozenSet_Type", "PyGen_Type", "PySet_New",
    "PySet_Add",
    # torch's casters of dtypes, layouts, memory formats and devices
    "THPDtypeType", "THPLayoutType", "THPMemoryFormatType", "THPDeviceType",
})
_PY_PREFIXES = ("PyErr_", "PyExc_", "PyException_", "PyFloat_", "PyLong_", "PyBool_", "PyBytes_", "PyByteArray_",
                "PyComplex_")
# pybind11's members an honest binding's object calls (qualified-name prefixes): function records, the argument
# and result casters, the exception types, the handles' reference counts, tuples and iterators its casters fill
_PYBIND_ALLOWED = (
    ("pybind11", "cpp_function"), ("pybind11", "detail", "type_caster"), ("pybind11", "detail", "type_caster_base"),
    ("pybind11", "detail", "type_caster_generic"), ("pybind11", "detail", "process_attribute"),
    ("pybind11", "detail", "clean_type_id"), ("pybind11", "detail", "object_is_convertible_to_std_vector"),
    ("pybind11", "detail", "get_type_info"), ("pybind11", "detail", "function_record"),
    ("pybind11", "detail", "error_string"), ("pybind11", "detail", "loader_life_support"),
    ("pybind11", "module_", "add_object"), ("pybind11", "handle", "inc_ref"), ("pybind11", "handle", "dec_ref"),
    ("pybind11", "handle", "throw_gilstate_error"), ("pybind11", "object"), ("pybind11", "pybind11_fail"),
    ("pybind11", "error_already_set"), ("pybind11", "builtin_exception"), ("pybind11", "cast_error"),
    ("pybind11", "reference_cast_error"), ("pybind11", "type_error"), ("pybind11", "value_error"),
    ("pybind11", "index_error"), ("pybind11", "key_error"), ("pybind11", "stop_iteration"),
    ("pybind11", "attribute_error"), ("pybind11", "buffer_error"), ("pybind11", "tuple"), ("pybind11", "iterator"),
    ("pybind11", "arg"), ("pybind11", "arg_v"), ("pybind11", "none"), ("pybind11", "int_"), ("pybind11", "float_"),
    ("pybind11", "sequence"), ("pybind11", "list"),
)


def _python_family(symbol: str) -> bool:
    """Whether the symbol is of the Python family at all: the C API, torch's THP* objects, pybind11."""
    if symbol.startswith(("Py", "_Py", "THP")):
        return True
    q = qualified_name(symbol[:2] + symbol[3:] if symbol.startswith("_ZZ") else symbol)
    return bool(q) and (q[0] == "pybind11" or q[0].startswith(("THP", "Py", "_Py")))


def refused(symbol: str) -> bool:
    """Whether an object compiled from kernels/ may not import `symbol` (the Python family, less the allow-list)."""
    if not _python_family(symbol):
        return False
    if symbol in _PY_EXACT or symbol.startswith(_PY_PREFIXES):
        return False
    q = qualified_name(symbol[:2] + symbol[3:] if symbol.startswith("_ZZ") else symbol)
    if q and q[0] == "pybind11":
        return not any(q[:len(a)] == a for a in _PYBIND_ALLOWED)
    return True


def refusals(objects: list[Path]) -> dict[str, list[str]]:
    """The refused imports of each object (by its file name), objects with none left out."""
    out: dict[str, list[str]] = {}
    for path in objects:
        names = {name.split("@", 1)[0] for name, undefined, _ in elf_info(path).tables.get(".symtab", ()) if undefined}
        bad = sorted((s for s in names if refused(s)), key=_shown_first)
        if bad:
            out[path.name] = bad
    return out


def _shown_first(symbol: str) -> tuple[int, str]:
    return (0 if any(t in symbol for t in _TELLING) else 1, symbol)


def _source(object_name: str) -> str:
    """kernels/a/b.cpp for a@b.cpp.o (sandbox/build/ninja_file.object_name)."""
    return "kernels/" + object_name.removesuffix(".o").replace("@", "/")


def message(found: dict[str, list[str]]) -> str:
    from sandbox.scan.symbol_scan import display_names

    parts = []
    for obj, names in found.items():
        shown = ", ".join(display_names(names[:_SHOWN])) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        parts.append(f"{_source(obj)}: {shown}")
    return (f"your kernels' objects import what they may not call ({FAMILY}: {LABEL}): " + "; ".join(parts)
            + f". {RULE}.")


def main(argv: list[str]) -> int:
    """`object_scan.py STAMP OBJECT...`: writes STAMP where every object passes, else prints the refusal."""
    stamp, objects = Path(argv[0]), [Path(a) for a in argv[1:]]
    try:
        found = refusals(objects)
    except (OSError, ValueError) as e:
        print(f"{FORBIDDEN_MARK}an object of kernels/ could not be read ({e})")
        return 1
    if found:
        print(FORBIDDEN_MARK + message(found))
        return 1
    stamp.write_text("".join(f"{o.name}\n" for o in objects))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
