"""The link's linker: the toolchain takes the fastest one that links here (lld, then gold, else the compiler's
default), every build links with it, and what each linker says of a failed link is read alike (a pybind11
member left to the infrastructure object, the agent's own missing or doubled symbols)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox.build import compile as compile_mod
from sandbox.build import pybind_interface
from sandbox.build.diagnostics import parse_diagnostics
from sandbox.build.toolchain import LINKER_ENV, LINKERS, get_toolchain, links_with, pick_linker

CXX = shutil.which("c++") or "g++"
HERE = [n for n in ("bfd", *LINKERS) if links_with(CXX, n)]


def test_the_first_linker_that_links_is_taken(monkeypatch, capsys):
    monkeypatch.delenv(LINKER_ENV, raising=False)
    assert pick_linker(CXX) == next((n for n in LINKERS if n in HERE), None)
    for default in ("default", "bfd"):
        monkeypatch.setenv(LINKER_ENV, default)
        assert pick_linker(CXX) is None
    monkeypatch.setenv(LINKER_ENV, "no-such-linker")
    assert pick_linker(CXX) is None
    assert f"{LINKER_ENV}=no-such-linker does not link here" in capsys.readouterr().err
    for name in LINKERS:
        monkeypatch.setenv(LINKER_ENV, name)
        assert pick_linker(CXX) == (name if name in HERE else None)
    monkeypatch.delenv(LINKER_ENV)
    assert pick_linker("/no/such/compiler/c++") is None
    assert not links_with(CXX, "no-such-linker")


def test_the_probe_records_the_linker_and_the_compiles_key_leaves_it_out():
    tc = get_toolchain("cpu")
    assert tc.linker == pick_linker(tc.cxx)
    other = tc.model_copy(update={"linker": "something-else"})
    assert other.key != tc.key and other.compile_key == tc.compile_key


SOURCE = """namespace pybind11 { struct cpp_function { __attribute__((visibility("hidden"))) static void record(); }; }
__attribute__((visibility("hidden"))) void my_kernel_launch(int);
int doubled() { return 1; }
void use_member() { pybind11::cpp_function::record(); }
void use_own() { my_kernel_launch(3); }
"""


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ld")
    (d / "a.cpp").write_text(SOURCE)
    (d / "b.cpp").write_text("int doubled() { return 2; }\n")
    (d / "member.cpp").write_text("void my_kernel_launch(int) {}\n")
    (d / "own.cpp").write_text('namespace pybind11 { struct cpp_function { static void record(); }; }\n'
                               "void pybind11::cpp_function::record() {}\n")
    subprocess.run([CXX, "-c", "-fPIC", "a.cpp", "b.cpp", "member.cpp", "own.cpp"], cwd=d, check=True)
    return d


def _link(d: Path, linker: str, *objs: str) -> str:
    r = subprocess.run([CXX, "-shared", f"-fuse-ld={linker}", *objs, "-o", "x.so"], cwd=d, capture_output=True,
                       text=True, check=False)
    assert r.returncode != 0, f"{objs} linked with {linker}"
    return r.stdout + r.stderr


@pytest.mark.parametrize("linker", ["bfd", *LINKERS])
def test_each_linkers_words_are_read_alike(objects, linker):
    if linker not in HERE:
        pytest.skip(f"{linker} does not link here")
    # a pybind11 member none of the objects holds: built again against the plain header
    log = _link(objects, linker, "a.o", "member.o")
    assert pybind_interface.link_missed_a_member(log), log
    assert any("pybind11::cpp_function::record" in d.message for d in parse_diagnostics(log, objects, objects)), log
    # the agent's own function missing: not pybind11's, and the diagnostic names it
    log = _link(objects, linker, "a.o", "own.o")
    assert not pybind_interface.link_missed_a_member(log), log
    assert [d for d in parse_diagnostics(log, objects, objects)
            if "my_kernel_launch(int)" in d.message and d.severity == "error"], log
    # one function defined twice
    log = _link(objects, linker, "a.o", "b.o", "member.o", "own.o")
    assert not pybind_interface.link_missed_a_member(log), log
    assert [d for d in parse_diagnostics(log, objects, objects) if "doubled()" in d.message], log


def _linked_by(so: Path) -> str:
    """Which linker wrote a shared object, from the marks lld and gold leave (GNU ld leaves none)."""
    sections = subprocess.run(["readelf", "-S", "-p", ".comment", str(so)], capture_output=True, text=True).stdout
    return "lld" if "LLD" in sections else "gold" if ".note.gnu.gold-version" in sections else "bfd"


@pytest.mark.parametrize("linker", ["bfd", *LINKERS])
def test_the_build_links_with_the_toolchains_linker(cpu_ws, monkeypatch, linker):
    if linker not in HERE:
        pytest.skip(f"{linker} does not link here")
    if not shutil.which("readelf"):
        pytest.skip("no readelf to read the linker's mark")
    tc = get_toolchain("cpu").model_copy(update={"linker": None if linker == "bfd" else linker})
    monkeypatch.setattr(compile_mod, "get_toolchain", lambda backend: tc)
    r = compile_mod.compile_workspace(cpu_ws)
    # the compiles are the same for every linker (the objects' cache key leaves it out): only the link runs again
    assert r.ok and set(r.steps) <= {"link"}, (r.log_tail, r.steps)
    ldflags = next(ln for ln in (cpu_ws.build_dir / "build.ninja").read_text().splitlines() if ln.startswith("ldflags"))
    assert ("-fuse-ld=" in ldflags) == (linker != "bfd") and (linker == "bfd" or f"-fuse-ld={linker}" in ldflags)
    assert _linked_by(compile_mod.extension_path(cpu_ws)) == linker


@pytest.mark.parametrize("linker", ["gold", "mold"])
def test_linkers_that_keep_imports_of_collected_code_are_not_taken(cpu_ws, monkeypatch, linker):
    """gold and mold are faster than GNU ld too, but keep in the dynamic table the imports of the infrastructure
    members --gc-sections removed (embedded Python's API): the symbol scan refuses what every binding then
    imports. So neither is in LINKERS."""
    if not links_with(CXX, linker):
        pytest.skip(f"{linker} does not link here")
    assert linker not in LINKERS
    tc = get_toolchain("cpu").model_copy(update={"linker": linker})
    monkeypatch.setattr(compile_mod, "get_toolchain", lambda backend: tc)
    r = compile_mod.compile_workspace(cpu_ws)
    assert not r.ok and r.reason == "forbidden_symbol" and "PyEval_GetGlobals" in r.message, r.message
