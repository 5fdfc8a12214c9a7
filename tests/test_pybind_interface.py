"""pybind11's members compiled once per toolchain, in the infrastructure object (sandbox/build/pybind_interface.py):
bindings built against the interface header leave them out, the object holds every one they need, the link keeps
only those, and a build that needs one the object lacks is done again against the plain header."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from sandbox.api import compile_workspace
from sandbox.build import pybind_interface
from sandbox.build.compile import (
    INFRA_TIMEOUT_S,
    PLAIN_MARK,
    PLAIN_NOTE,
    infra_header,
    infra_object,
    infrastructure,
)
from sandbox.build.ninja_file import host_flags
from sandbox.build.toolchain import get_toolchain
from sandbox.scan import symbol_scan
from sandbox.scan.elf_exports import defined_by_libraries

# ---- the text the judge writes ------------------------------------------------------------------------


def test_the_interface_header_marks_each_pybind11_header_before_anything_includes_it():
    text = "// about\n#pragma once\n#include <x.h>\nint a;\n"
    out = pybind_interface.interface_header(text, ["/t/pybind11/a.h", '/t/we"ird/pybind11/b.h'],
                                            Path("/c/binding_registry.h")).splitlines()
    assert out[:2] == ["// about", "#pragma once"]
    assert out[2:6] == ['#line 1 "/t/pybind11/a.h"', "#pragma interface", r'#line 1 "/t/we\"ird/pybind11/b.h"',
                        "#pragma interface"]
    # the line map is set back to the file, at the line the include really is on (3), so diagnostics still say
    # binding_registry.h:3
    assert out[6:] == ['#line 3 "/c/binding_registry.h"', "#include <x.h>", "int a;"]
    assert pybind_interface.interface_header(text, [], Path("/c/h")).count("#pragma interface") == 0


def test_the_infrastructure_source_asks_for_each_headers_members_once_by_base_name():
    out = pybind_interface.implementation_source('#include "binding_registry.h"\n',
                                                 ["/t/pybind11/cast.h", "/t/pybind11/detail/cast.h", "/t/pybind11/gil.h"])
    assert out.splitlines() == ['#pragma implementation "cast.h"', '#pragma implementation "gil.h"',
                                '#line 1 "binding.cpp"', '#include "binding_registry.h"']
    assert pybind_interface.implementation_source("int x;\n", []) == "int x;\n"


def test_only_a_link_that_missed_a_pybind11_member_is_built_again():
    missed = ("/usr/bin/ld: swish_bias.cpp.o: in function `register_swish_bias(pybind11::module_&)':\n"
              "swish_bias.cpp:(.text+0x577): undefined reference to `pybind11::cpp_function::make_function_record()'\n"
              "/usr/bin/ld: cuda_extension.so: hidden symbol `_ZN8pybind1112cpp_function20make_function_recordEv' "
              "isn't defined\n/usr/bin/ld: final link failed: bad value\n")
    assert pybind_interface.link_missed_a_member(missed)
    assert pybind_interface.link_missed_a_member(missed.splitlines()[2])
    own = ("/usr/bin/ld: a.cpp.o: in function `register_a(pybind11::module_&)':\n"
           "a.cpp:(.text+0x12): undefined reference to `my_kernel_launch(at::Tensor const&)'\n")
    assert not pybind_interface.link_missed_a_member(own)
    assert not pybind_interface.link_missed_a_member("a.cpp:3:1: error: expected ';' before '}' token\n")


# ---- the real build (the session's cache: one infrastructure build for every test) --------------------


@pytest.fixture(scope="module")
def infra() -> dict:
    tc = get_toolchain("cpu")
    if not pybind_interface.is_gcc(tc.cxx):
        pytest.skip("the pragmas are GCC's; other compilers build with the plain header")
    obj = infra_object(tc, INFRA_TIMEOUT_S)
    iface, plain = infra_header(tc, INFRA_TIMEOUT_S), infra_header(tc, INFRA_TIMEOUT_S, interface=False)
    if iface is None:
        pytest.skip("no precompiled header here (the judge's cache is not trusted)")
    return {"tc": tc, "obj": obj, "iface": iface, "plain": plain}


def test_a_toolchains_first_build_makes_the_object_and_the_interface_header_side_by_side(tmp_path, monkeypatch):
    """Both come from the header list, which is made first: a header built before the list existed would be the
    plain one, and every binding would pay pybind11's members again."""
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    tc = get_toolchain("cpu")
    if not pybind_interface.is_gcc(tc.cxx):
        pytest.skip("the pragmas are GCC's; other compilers build with the plain header")
    obj, pch = infrastructure(tc, INFRA_TIMEOUT_S, header=True, interface=True)
    if pch is None:
        pytest.skip("no precompiled header here (the judge's cache is not trusted)")
    assert obj.is_file() and pch.name == "pch-interface" and (pch / "binding_registry.h.gch").is_file()
    listed = (obj.parent / pybind_interface.HEADERS_FILE).read_text().split()
    assert listed and all("/pybind11/" in h for h in listed)
    assert not (obj.parent / "pch").exists()  # the plain header is built only for a build that needs it
    assert infrastructure(tc, INFRA_TIMEOUT_S, header=True, interface=True) == (obj, pch)


def _symbols(obj: Path) -> list[tuple[str, str, str]]:
    """(name, binding, section index) of an object's symbol table."""
    with open(obj, "rb") as f:
        table = ELFFile(f).get_section_by_name(".symtab")
        return [(s.name, s.entry.st_info.bind, s.entry.st_shndx) for s in table.iter_symbols()]


def _weak_pybind(obj: Path) -> int:
    return sum(1 for n, b, ndx in _symbols(obj) if b == "STB_WEAK" and ndx != "SHN_UNDEF" and "pybind11" in n)


def test_a_binding_against_the_interface_header_leaves_pybind11s_members_out(infra, tmp_path):
    """An empty binding emits most of pybind11 against the plain header (its key function drags it in) and next
    to none against the interface one: the pragmas took, spelled as g++ opened the headers."""
    headers = (infra["obj"].parent / pybind_interface.HEADERS_FILE).read_text().split()
    assert any(h.endswith("/pybind11/pybind11.h") for h in headers) and all("/pybind11/" in h for h in headers)
    src = tmp_path / "empty.cpp"
    src.write_text('#include "binding_registry.h"\n')
    counts = {}
    for name in ("iface", "plain"):
        out = tmp_path / f"{name}.o"
        subprocess.run([infra["tc"].cxx, *host_flags(infra["tc"], [str(infra[name])]), "-Winvalid-pch", "-c",
                        str(src), "-o", str(out)], check=True, capture_output=True)
        counts[name] = _weak_pybind(out)
    assert counts["plain"] >= 50 and counts["iface"] * 5 < counts["plain"], counts


def test_the_infrastructure_object_holds_every_member_a_built_binding_left_out(infra, cpu_ws, monkeypatch):
    """Every pybind11 symbol the fixture's objects (built by the judge against the interface header) leave
    undefined is defined by the infrastructure object or exported by torch's libraries (the tensor casters)."""
    # the fallback to the plain header is what is tested: pybind11 beyond m.def is refused by the object scan in an
    # agent's build (Judge IX), so it is off here
    monkeypatch.setenv("CUDA_AGENT_SYMBOL_SCAN", "0")
    assert "pch-interface" in (cpu_ws.build_dir / "build.ninja").read_text()
    defined = {n for n, _, ndx in _symbols(infra["obj"]) if ndx != "SHN_UNDEF"}
    wanted = {n for o in cpu_ws.build_dir.glob("*.o") for n, _, ndx in _symbols(o)
              if ndx == "SHN_UNDEF" and "pybind11" in n}
    # since the fixture's ATen-through-Python variant left kernels/ (3b57bb5), its honest bindings may leave no
    # pybind11 member to the object at all; the interface header's use is checked above (pch-interface)
    so = cpu_ws.build_dir / "cuda_extension.so"
    assert wanted - defined - defined_by_libraries(so, wanted - defined) == set()


def test_the_link_keeps_only_the_members_a_binding_reaches(infra, cpu_ws):
    """The infrastructure object holds all of pybind11, eval and imports included, which the symbol scan refuses;
    the extension the judge links from it imports none of that."""
    assert symbol_scan.refusals(symbol_scan.imported_symbols(infra["obj"]))
    so = cpu_ws.build_dir / "cuda_extension.so"
    assert symbol_scan.scan(so) is None
    assert pybind_interface.unresolved_pybind_imports(so) == set()


NEEDS = ('#include "binding_registry.h"\n'
         'namespace pybind11 { __attribute__((visibility("hidden"))) int not_in_the_infrastructure(); }\n'
         "int needs_fn() { return {call}; }\n")


def test_a_build_that_needs_a_member_the_object_lacks_is_built_again_against_the_plain_header(infra, cpu_ws, monkeypatch):
    """A hidden pybind11 symbol no object defines fails the link: the judge builds the bindings again against the
    plain header (which fails here too, the symbol being nowhere), says so, and keeps this workspace on the plain
    header, where the fixed source then builds."""
    # the fallback to the plain header is what is tested: pybind11 beyond m.def is refused by the object scan in an
    # agent's build (Judge IX), so it is off here
    monkeypatch.setenv("CUDA_AGENT_SYMBOL_SCAN", "0")
    cpu_ws.write_text("kernels/needs.cpp", NEEDS.replace("{call}", "pybind11::not_in_the_infrastructure()"))
    r = compile_workspace(cpu_ws)
    assert not r.ok and r.reason == "compile_error"
    assert r.log_tail.startswith(PLAIN_NOTE) or PLAIN_NOTE.strip() in r.log_tail, r.log_tail[-2000:]
    assert "not_in_the_infrastructure" in r.log_tail
    assert (cpu_ws.build_dir / PLAIN_MARK).exists()
    ninja = (cpu_ws.build_dir / "build.ninja").read_text()
    assert "pch-interface" not in ninja and str(infra["plain"]) in ninja
    cpu_ws.write_text("kernels/needs.cpp", NEEDS.replace("{call}", "1"))
    r = compile_workspace(cpu_ws)
    assert r.ok, r.log_tail
    assert PLAIN_NOTE.strip() not in r.log_tail and "pch-interface" not in (cpu_ws.build_dir / "build.ninja").read_text()
    assert symbol_scan.scan(cpu_ws.build_dir / "cuda_extension.so") is None


def test_an_extension_importing_a_pybind11_symbol_nothing_defines_is_built_again_against_the_plain_header(infra,
                                                                                                          cpu_ws, monkeypatch):
    """A pybind11 symbol of default visibility left undefined links (a shared object may import it) and would
    fail at import: the judge reads the linked extension's imports against the libraries it links, and builds
    again against the plain header. There the build is what it always was: the agent's missing function, which
    verify reports at import."""
    # the fallback to the plain header is what is tested: pybind11 beyond m.def is refused by the object scan in an
    # agent's build (Judge IX), so it is off here
    monkeypatch.setenv("CUDA_AGENT_SYMBOL_SCAN", "0")
    src = ('#include "binding_registry.h"\n'
           'namespace pybind11 { __attribute__((visibility("default"))) int exported_nowhere(); }\n'
           "int uses_fn() { return pybind11::exported_nowhere(); }\n")
    cpu_ws.write_text("kernels/uses.cpp", src)
    r = compile_workspace(cpu_ws)
    assert r.ok, r.log_tail
    assert r.log_tail.startswith(PLAIN_NOTE) and (cpu_ws.build_dir / PLAIN_MARK).exists(), r.log_tail[-2000:]
    so = cpu_ws.build_dir / "cuda_extension.so"
    assert any("exported_nowhere" in s for s in pybind_interface.unresolved_pybind_imports(so))
    assert "pch-interface" not in (cpu_ws.build_dir / "build.ninja").read_text()
