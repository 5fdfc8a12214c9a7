"""Bindings compiled thin first (binding_registry.h's stand-in for pybind11, bound by the infrastructure object with
pybind11's own casters): the same sources built thin and built against the pybind11 header answer every call alike,
a source that needs more of pybind11 is compiled again against the header, and a broken one is reported once."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from sandbox.api import compile_workspace, init_workspace
from sandbox.build import thin_shadow
from sandbox.build.ninja_file import FULL_MARK, THIN_DEFINE
from sandbox.config import CompileConfig
from sandbox.present import compile_text
from sandbox.workspace import Workspace

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    """The fixture's two sources built both ways, once for the module."""
    out = {}
    for name, thin in (("thin", True), ("full", False)):
        root = tmp_path_factory.mktemp(name) / "ws"
        ws, _ = init_workspace(str(FIXTURES / "cpu_multi" / "small_task.py"), root, backend="cpu", check=False)
        shutil.copytree(FIXTURES / "thin_binding" / "kernels", ws.root / "kernels", dirs_exist_ok=True)
        result = compile_workspace(ws, CompileConfig(thin_bindings=thin))
        assert result.ok, result.log_tail
        out[name] = (ws, result)
    return out


def _pybind_symbols(obj: Path) -> list[str]:
    with open(obj, "rb") as f:
        return [s.name for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols() if "pybind11" in s.name]


def test_a_binding_of_tensors_and_numbers_compiles_thin_and_one_that_needs_more_against_the_header(builds):
    ws, thin = builds["thin"]
    # lists.cpp calls the device-guard overload a thin compile's copy of the header leaves out (thin_shadow)
    assert thin.full_bindings == (["kernels/lists.cpp"] if thin_shadow.enabled() else []) + ["kernels/uses_more.cpp"]
    assert FULL_MARK in thin.log_tail and "uses_more.cpp" in thin.log_tail
    # the thin compile's own complaint about py::arg is not in the log: the compile against the header succeeded
    assert "is not a member of" not in thin.log_tail, thin.log_tail
    # the thin object holds nothing of pybind11, the one compiled against the header does
    assert _pybind_symbols(ws.build_dir / "signatures.cpp.o") == []
    assert _pybind_symbols(ws.build_dir / "uses_more.cpp.o")
    ninja = (ws.build_dir / "build.ninja").read_text()
    assert "rule cxxthin" in ninja and THIN_DEFINE in ninja and "pch-thin" in ninja
    # the agent is told which file took the slow path, and why
    assert "kernels/uses_more.cpp compiled against the full pybind11 header" in compile_text(thin)
    if thin_shadow.enabled():
        assert "kernels/lists.cpp, kernels/uses_more.cpp compiled against the full pybind11 header" in compile_text(thin)
    ws_full, full = builds["full"]
    assert full.full_bindings == [] and _pybind_symbols(ws_full.build_dir / "signatures.cpp.o")
    assert THIN_DEFINE not in (ws_full.build_dir / "build.ninja").read_text()


CALLS = r'''
import importlib.util, json, sys
import numpy as np
import torch

def load(path):
    spec = importlib.util.spec_from_file_location("cuda_extension", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

def show(v):
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype), list(v.shape), v.flatten().tolist()]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [show(x) for x in v]]
    return [type(v).__name__, v]

x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
calls = [("twice", (x,)), ("scale", (x, 2.0, 3, False)), ("scale", (x, 2, 3, True)), ("scale", (x, 2.5, 3.5, True)),
         ("scale", (x, 2.0, True, False)), ("scale", (x, np.float64(2.0), np.int64(3), np.bool_(True))),
         ("scale32", (x, 1.5, 2)), ("scale32", (x, 1, 2**40)), ("split2", (x,)), ("pair", (x, None)), ("pair", (x, x)),
         ("count", ([x, x], [1, 2, 3])), ("count", ((x,), (1,))), ("shaped", ([2, 3], torch.float64)),
         ("shaped", (torch.Size([4]), torch.int32)), ("shaped", (3, torch.float32)), ("total", (x,)),
         ("checked", (x,)), ("checked", (x[0],)), ("over", (x,)), ("over", (x, 2)), ("num", (3,)), ("num", (3.0,)),
         ("num", (True,)), ("lam", (x,)), ("on_device", (x, None)), ("on_device", (x, x)), ("same_device", ([x, x],)),
         ("twice", ("no",)), ("twice", ()), ("scaled", (x,)), ("scaled", (x, 2.0))]
out = {}
for tag, path in (("thin", sys.argv[1]), ("full", sys.argv[2])):
    mod, answers = load(path), []
    for name, args in calls:
        try:
            answers.append(["ok", show(getattr(mod, name)(*args))])
        except Exception as e:
            answers.append([type(e).__name__, str(e)])
    y = x.clone()
    mod.fill_(y, 7.0)
    answers.append(["filled", y.flatten().tolist()])
    try:
        mod.twice(x=x)
    except TypeError as e:
        answers.append(["kwargs", str(e)])
    answers.append(["doc", mod.twice.__doc__, mod.num.__doc__])
    out[tag] = answers
out["calls"] = [name for name, _ in calls]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def answers(builds) -> dict:
    sos = [str(builds[k][0].build_dir / "cuda_extension.so") for k in ("thin", "full")]
    proc = subprocess.run([sys.executable, "-c", CALLS, *sos], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _of(answers: dict, tag: str, name: str) -> list:
    """`tag`'s answers to every call of `name`, in order."""
    return [a for c, a in zip(answers["calls"], answers[tag], strict=False) if c == name]


def test_thin_and_full_bindings_answer_every_call_alike(answers):
    """Results (types, dtypes, values), overload choice, conversions and refusals as pybind11's: the infrastructure
    loads each argument with pybind11's caster of its C++ type."""
    for i, name in enumerate(answers["calls"]):
        thin, full = answers["thin"][i], answers["full"][i]
        assert thin[0] == full[0], (name, thin, full)
        if thin[0] == "ok":
            assert thin == full, name
    # num(3) took the int64 overload and num(3.0) the double one, as pybind11's no-conversion pass picks
    nums = _of(answers, "thin", "num")
    assert nums[0][1][3] == [3.0] and nums[1][1][3] == [30.0]
    checks = _of(answers, "thin", "checked")
    assert checks[0] == ["ok", ["bool", True]]
    assert checks[1][0] == "RuntimeError" and "checked: expected a 2-D tensor, got 1" in checks[1][1]
    pair = _of(answers, "thin", "pair")[0]
    assert pair[1][0] == "tuple" and pair[1][1][1][3] == [0.0] * 6
    split = _of(answers, "thin", "split2")[0]
    assert split[1][0] == "list" and len(split[1][1]) == 2
    assert [a[0] for a in _of(answers, "thin", "scale32")] == ["ok", "TypeError"]  # 2**40 is no int32


def test_thin_compiles_read_torchs_device_guard_header_without_its_list_overload(builds, answers):
    """ATen/DeviceGuard.h's list overload brings IListRef and IValue, whose templates GCC instantiates at the end of
    every thin compile: the thin header's folder holds torch's text without it (sandbox/build/thin_shadow.py), the
    first include directory of a thin compile. The one-tensor overloads compile thin and answer as torch's; a source
    that calls the list overload takes the full header's compile."""
    import torch

    if not thin_shadow.enabled():
        pytest.skip(f"{thin_shadow.ENV}=0: thin compiles read torch's header")
    ws, thin = builds["thin"]
    ninja = (ws.build_dir / "build.ninja").read_text()
    thin_flags = next(line for line in ninja.splitlines() if line.startswith("thin_cflags = "))
    folder = Path(next(t for t in shlex.split(thin_flags.split(" = ", 1)[1]) if t.startswith("-I")).removeprefix("-I"))
    assert folder.name == "pch-thin" and (folder / "binding_registry.h.gch").is_file(), thin_flags
    original = (Path(torch.__file__).parent / "include" / thin_shadow.SHADOWED).read_text()
    copy = (folder / thin_shadow.SHADOWED).read_text()
    assert "IListRef" in original and "IListRef" not in copy
    # every line of the copy is torch's, in torch's order: nothing added, only the list overload and its include gone
    lines = iter(original.splitlines())
    assert all(any(line == o for o in lines) for line in copy.splitlines())
    assert "inline std::optional<Device> device_of(const Tensor& t) {" in copy
    assert "kernels/lists.cpp" in thin.full_bindings and "kernels/signatures.cpp" not in thin.full_bindings
    assert _of(answers, "thin", "on_device") == _of(answers, "full", "on_device") == [["ok", ["bool", True]]] * 2
    assert _of(answers, "thin", "same_device") == _of(answers, "full", "same_device") == [["ok", ["bool", True]]]


def test_the_device_guard_copy_is_made_only_from_the_header_it_knows():
    import torch

    original = (Path(torch.__file__).parent / "include" / thin_shadow.SHADOWED).read_text()
    assert thin_shadow.shadow_text(original) is not None
    # another torch's header (the overload renamed, the include moved, a second overload): no copy, torch's is read
    assert thin_shadow.shadow_text(original.replace("device_of(ITensorListRef t)", "device_of(TensorList t)")) is None
    assert thin_shadow.shadow_text(original.replace("#include <ATen/core/IListRef.h>\n", "")) is None
    overload = original[original.index("inline std::optional<Device> device_of(ITensorListRef t)"):]
    assert thin_shadow.shadow_text(original + overload) is None


def test_a_thin_bindings_refusals_and_docstrings_read_as_pybind11s(answers):
    thin, full = answers["thin"], answers["full"]
    n = len(answers["calls"])
    assert thin[n] == full[n] == ["filled", [7.0] * 6]  # at::Tensor& reaches the caller's tensor
    assert thin[n + 1][0] == "kwargs" and "incompatible function arguments" in thin[n + 1][1]
    wrong = _of(answers, "thin", "twice")[1]
    assert wrong[0] == "TypeError"
    assert wrong[1].startswith("twice(): incompatible function arguments. The following argument types are supported:")
    assert "1. (arg0: torch.Tensor) -> torch.Tensor" in wrong[1] and "Invoked with: 'no'" in wrong[1]
    doc_thin, doc_full = thin[n + 2], full[n + 2]
    assert doc_thin[1] == doc_full[1]  # twice(arg0: torch.Tensor) -> torch.Tensor, then its docstring
    assert "doubles x" in doc_thin[1]
    assert "num(arg0: int) -> torch.Tensor" in doc_thin[2] and "num(arg0: float) -> torch.Tensor" in doc_thin[2]


def test_a_broken_source_is_reported_once_by_the_compile_against_the_header(builds, tmp_path):
    src = builds["thin"][0]
    dst = tmp_path / "ws"
    shutil.copytree(src.root, dst, symlinks=True)
    ws = Workspace(dst)
    ws.write_text("kernels/broken.cpp", '#include "binding_registry.h"\nstatic int broken() { return 1 }\n')
    r = compile_workspace(ws)
    assert not r.ok and r.reason == "compile_error"
    assert r.full_bindings == ["kernels/broken.cpp"]
    assert "broken.cpp:2" in r.message, r.message
    errors = [d for d in r.diagnostics if d.severity == "error"]
    assert len(errors) == 1 and errors[0].file.endswith("broken.cpp"), errors
    assert r.log_tail.count("broken.cpp:2:31: error:") == 1, r.log_tail
