"""The link against stand-ins for torch's libraries (sandbox/build/link_stubs.py): each carries the real
library's SONAME and nothing else, an extension linked against them needs the real libraries and loads them
from the real folders, and a cache the judge cannot trust gets none."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox.build import compile as compile_mod
from sandbox.build import link_stubs
from sandbox.build.infra_cache import link_stub_folder
from sandbox.build.toolchain import get_toolchain
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.scan.elf_exports import needed_libraries, symbol_entries

CXX = shutil.which("c++") or "g++"


def _needed(so: Path) -> set[str]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(so, "rb") as fh:
        return {t.needed for sec in ELFFile(fh).iter_sections() if isinstance(sec, DynamicSection)
                for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"}


def test_each_stand_in_carries_the_real_soname_and_defines_nothing(tmp_path):
    tc = get_toolchain("cpu")
    # a library of the link's folders without a SONAME: linked as it is
    plain = tmp_path / "dirs"
    plain.mkdir()
    subprocess.run([CXX, "-shared", "-fPIC", "-x", "c", "-", "-o", str(plain / "libplain.so")],
                   input="int plain_fn(void) { return 1; }\n", text=True, check=True)
    made = link_stubs.write(tmp_path / "stubs", CXX, [*tc.libraries, "plain", "no_such_library"],
                            [*tc.library_dirs, str(plain)])
    assert made == tc.libraries, made  # every torch library the link names, in its order; not the other two
    assert (tmp_path / "stubs" / link_stubs.DONE).read_text().split() == made
    for name in made:
        real = link_stubs.library_file(name, tc.library_dirs)
        stub = tmp_path / "stubs" / f"lib{name}.so"
        assert real is not None and link_stubs.soname(stub) == link_stubs.soname(real) is not None
        assert stub.stat().st_size < 64 * 1024
        assert not [n for n, undefined, _ in symbol_entries(stub, (".dynsym",)) if not undefined and n], name
    assert not (tmp_path / "stubs" / "libplain.so").exists() and link_stubs.soname(plain / "libplain.so") is None
    assert link_stubs.soname(tmp_path / "stubs" / link_stubs.DONE) is None  # not an ELF file


@pytest.mark.skipif(not shared_caches_trusted(), reason="no Landlock: the judge's cache is not trusted (tested below)")
def test_an_extension_linked_against_stand_ins_loads_the_real_libraries(cpu_ws, monkeypatch):
    stubs = link_stub_folder(get_toolchain("cpu"))
    assert stubs is not None and (stubs / link_stubs.DONE).is_file()
    r = compile_mod.compile_workspace(cpu_ws)
    assert r.ok, r.log_tail
    ninja = (cpu_ws.build_dir / "build.ninja").read_text()
    assert f"-L{stubs}" in ninja
    ext = compile_mod.extension_path(cpu_ws)
    with_stubs = _needed(ext)
    # found where the loader finds them: the real folders of the RUNPATH, never the stand-ins' folder
    found = needed_libraries(ext)
    real_dirs = {Path(d).resolve() for d in get_toolchain("cpu").library_dirs}
    assert found and all(p.parent.resolve() in real_dirs and stubs not in p.parents for p in found), found
    # the real libraries linked directly: the same needs, less any the linker dropped as unused (--as-needed)
    monkeypatch.setenv(link_stubs.ENV, "0")
    assert link_stub_folder(get_toolchain("cpu")) is None
    r = compile_mod.compile_workspace(cpu_ws)
    assert r.ok and list(r.steps) == ["link"], (r.log_tail, r.steps)
    assert f"-L{stubs}" not in (cpu_ws.build_dir / "build.ninja").read_text()
    direct = _needed(ext)
    torch_names = {link_stubs.soname(stubs / f"lib{n}.so") for n in get_toolchain("cpu").libraries}
    assert direct <= with_stubs and with_stubs - direct <= torch_names, (direct, with_stubs)
    assert {link_stubs.soname(p) for p in found} >= torch_names - {None}


def test_stand_ins_are_made_only_where_the_cache_is_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_AGENT_CONFINE", "off")
    assert link_stub_folder(get_toolchain("cpu")) is None
    assert not list((tmp_path / "cache").rglob(link_stubs.DONE))
