"""The object scan (sandbox/scan/object_scan.py): the agent's own objects, read before the link, may not import
the Python C API beyond what pybind11's def and casters leave in an honest binding's object (Judge IX, item 1).

Objects are built here with the judge's compiler: small ones importing exact names (asm labels), and the honest
bindings of tests/fixtures/symbols through compile_workspace (the ninja step between compiles and link), so that
both the rule and where the build calls it are what is tested.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox.api import compile_workspace, init_workspace
from sandbox.build.compile import extension_path
from sandbox.build.ninja_file import SCAN_STAMP
from sandbox.build.toolchain import get_toolchain
from sandbox.results import Reason
from sandbox.scan import object_scan, symbol_scan

REPO = Path(__file__).resolve().parent.parent
SYMBOLS = REPO / "tests" / "fixtures" / "symbols"

# what the three Judge IX routes imported, and their kin
REFUSED = ["PyEval_GetBuiltins", "PyEval_GetGlobals", "PyEval_SaveThread", "PyGILState_Ensure", "PyGILState_Release",
           "PyObject_CallMethod", "PyObject_CallFunction", "PyObject_CallObject", "PyObject_Call", "PyObject_Vectorcall",
           "_PyObject_Call", "PyObject_GetAttr", "PyObject_SetAttrString", "PyObject_SetAttr", "PyObject_GetItem",
           "PyDict_GetItemString", "PyDict_New", "PyDict_SetItemString", "PyFrame_GetBack", "PyRun_SimpleString",
           "PyImport_ImportModule", "PySys_GetObject", "PyThreadState_Get", "PyModule_GetDict",
           "_Z16THPVariable_WrapRKN2at10TensorBaseE", "THPVariable_Unpack", "_Z18THPVariable_UnpackP7_object",
           "_ZN8pybind117module_6importEPKc", "_ZN8pybind116detail17accessor_policies8str_attr3getENS_6handleEPKc",
           "_ZN8pybind116detail13get_internalsEv"]
# what honest bindings' objects import of the Python family (tests/fixtures/symbols, compiled thin, against the
# interface header and against the plain one)
ALLOWED = ["PyErr_Occurred", "PyErr_Clear", "PyExc_RuntimeError", "PyFloat_AsDouble", "PyLong_AsLong", "PyGILState_Check",
           "PyObject_GetAttrString", "PyType_IsSubtype", "PyTuple_New", "PySequence_Size", "PyIter_Next",
           "PyUnicode_AsUTF8AndSize", "_Py_Dealloc", "_Py_NoneStruct", "THPDtypeType",
           "_ZN8pybind1112cpp_function18initialize_genericEOSt10unique_ptrINS_6detail15function_recordENS3_"
           "13InitializingFunctionRecordDeleterEEPKcPKPKSt9type_infom",
           "_ZN8pybind116detail11type_casterIN2at6TensorEvE4loadENS_6handleEb", "_ZN8pybind116handle7inc_refEv",
           "_ZN8pybind117module_10add_objectEPKcNS_6handleEb", "_ZTIN8pybind1117error_already_setE",
           # not of the Python family at all: left to the linked extension's scan
           "_GLOBAL_OFFSET_TABLE_", "memcpy", "_ZNK2at10TensorBase8data_ptrIfEEPT_v"]


@pytest.fixture(scope="module")
def cxx() -> str:
    return get_toolchain("cpu").cxx


def _object(cxx: str, symbols: list[str], out: Path) -> Path:
    """A relocatable object whose undefined symbols are `symbols` (each referenced from its own .text)."""
    decls = "".join(f'extern "C" void ref{i}() __asm__("{s}");\n' for i, s in enumerate(symbols))
    calls = "".join(f"  ref{i}();\n" for i in range(len(symbols)))
    src = decls + 'extern "C" void use_them() {\n' + calls + "}\n"
    subprocess.run([cxx, "-c", "-fPIC", "-x", "c++", "-", "-o", str(out)], input=src, text=True, check=True,
                   capture_output=True)
    return out


@pytest.mark.parametrize("symbol", REFUSED)
def test_the_python_c_api_is_refused_in_the_agents_objects(symbol):
    assert object_scan.refused(symbol), symbol


@pytest.mark.parametrize("symbol", ALLOWED)
def test_what_honest_bindings_import_is_not(symbol):
    assert not object_scan.refused(symbol), symbol


def test_a_real_object_is_refused_naming_its_source_the_symbols_and_the_rule(cxx, tmp_path):
    bad = _object(cxx, ["PyEval_GetBuiltins", "PyDict_GetItemString", "PyObject_CallFunction", "PyErr_Occurred"],
                  tmp_path / "sub@route.cpp.o")
    good = _object(cxx, ["PyErr_Occurred", "_Py_Dealloc", "memcpy"], tmp_path / "fine.cpp.o")
    found = object_scan.refusals([bad, good])
    assert found == {"sub@route.cpp.o": ["PyDict_GetItemString", "PyEval_GetBuiltins", "PyObject_CallFunction"]}
    msg = object_scan.message(found)
    assert "kernels/sub/route.cpp" in msg and "PyEval_GetBuiltins" in msg and object_scan.FAMILY in msg
    assert "SKILL.md" in msg and "m.def" in msg
    # the build's step: no stamp, the refusal printed for compile_workspace to read, exit status 1
    stamp = tmp_path / SCAN_STAMP
    r = subprocess.run([shutil.which("python3") or "python3", "-I", object_scan.__file__, str(stamp), str(bad), str(good)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout.startswith(object_scan.FORBIDDEN_MARK) and not stamp.exists(), r
    r = subprocess.run([shutil.which("python3") or "python3", "-I", object_scan.__file__, str(stamp), str(good)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and stamp.is_file(), r.stdout + r.stderr


@pytest.fixture(scope="module")
def honest_build(tmp_path_factory, small_task_path) -> Path:
    """The honest idioms (thin and full bindings: untyped and typed data_ptr(), TORCH_CHECK, at::empty, options,
    AT_DISPATCH_FLOATING_TYPES, accessors, py::arg) and the tensor-plumbing fixture, in one workspace."""
    ws, _ = init_workspace(str(small_task_path), tmp_path_factory.mktemp("idioms") / "ws", backend="cpu", check=False)
    for folder in ("honest_idioms", "cpu_plumbing"):
        shutil.copytree(SYMBOLS / folder / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    r = compile_workspace(ws)
    assert r.ok, (r.reason, r.message, r.log_tail)
    return ws.root


def test_honest_idioms_pass_both_scans(honest_build):
    build = honest_build / "build"
    objects = sorted(build.glob("*.o"))
    assert {o.name for o in objects} >= {"idioms.cpp.o", "thin_idioms.cpp.o", "plumbing.cpp.o"}
    assert (build / SCAN_STAMP).is_file()  # the scan ran, between the compiles and the link
    assert object_scan.refusals(objects) == {}
    assert symbol_scan.scan(extension_path_of(honest_build)) is None
    # the untyped data_ptr()'s null check and deprecation warning are imported, and allowed
    imported = symbol_scan.imported_symbols(build / "idioms.cpp.o")
    assert any("throwNullDataPtrError" in s for s in imported), sorted(imported)[:20]


def extension_path_of(root: Path) -> Path:
    from sandbox.workspace import Workspace

    return extension_path(Workspace(root))


def test_a_binding_that_reaches_python_is_refused_before_the_link(honest_build, tmp_path, small_task_path):
    ws, _ = init_workspace(str(small_task_path), tmp_path / "ws", backend="cpu", check=False)
    shutil.copytree(honest_build / "build", ws.root / "build", dirs_exist_ok=True)
    shutil.copytree(honest_build / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    (ws.root / "build" / "cuda_extension.so").unlink()
    (ws.root / "kernels" / "builtins.cpp").write_text(
        '#include "binding_registry.h"\n\n'
        "static at::Tensor run(const at::Tensor& x) {\n"
        "  PyObject* b = PyEval_GetBuiltins();\n"
        '  PyObject* exec = PyDict_GetItemString(b, "exec");\n'
        '  PyObject_CallFunction(exec, "s", "pass");\n'
        "  return at::empty_like(x);\n}\n\n"
        'static void register_builtins(pybind11::module& m) { m.def("run", &run); }\n'
        "REGISTER_BINDING(builtins, register_builtins);\n")
    r = compile_workspace(ws)
    assert not r.ok and r.reason == Reason.forbidden_symbol, (r.reason, r.message, r.log_tail[-2000:])
    assert "kernels/builtins.cpp" in r.message and "PyEval_GetBuiltins" in r.message, r.message
    assert "PyObject_CallFunction" in r.message and "SKILL.md" in r.message, r.message
    assert not (ws.root / "build" / "cuda_extension.so").exists()  # never linked
