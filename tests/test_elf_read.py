"""The ELF reader behind the symbol scan (sandbox/scan/elf_read.py): struct's reading matches pyelftools' on real
objects, libraries and extensions; a file is read again whenever its content changes, whatever its times say."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox.build.toolchain import get_toolchain
from sandbox.scan import elf_read
from sandbox.scan.elf_exports import needed_libraries, symbol_entries
from sandbox.scan.symbol_scan import demangle, imported_symbols, own_kernels

CXX = shutil.which("c++") or "g++"


@pytest.fixture(scope="module")
def small_so(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("elf")
    src = d / "a.cpp"
    src.write_text('#include <cmath>\nnamespace k { template <int N> __attribute__((noinline)) void aaaa_kernel(float* x) { x[0] = std::sqrt(x[N]); } }\n'
                   "void launch(float* x) { k::aaaa_kernel<3>(x); }\nextern double imported_fn(double);\n"
                   "double use(double v) { return imported_fn(v); }\n")
    out = d / "libsmall.so"
    subprocess.run([CXX, "-shared", "-fPIC", "-O1", "-Wl,-soname,libsmall.so.7", f"-Wl,-rpath,{d}:$ORIGIN/lib",
                    str(src), "-o", str(out)], check=True)
    return out


def test_struct_reads_what_pyelftools_reads(small_so, built_cpu_workspace):
    files = [small_so, built_cpu_workspace / "build" / "cuda_extension.so"]
    files += [Path(d) / f"lib{n}.so" for d in get_toolchain("cpu").library_dirs for n in ("c10", "torch")
              if (Path(d) / f"lib{n}.so").is_file()]
    files += sorted((built_cpu_workspace / "build").glob("*.o"))[:1]
    for f in files:
        data = f.read_bytes()
        fast = elf_read._read_fast(data)
        slow = elf_read._read_slow(io.BytesIO(data))
        assert fast is not None, f
        assert fast.tables == slow.tables and fast.dynamic == slow.dynamic, f
        assert fast.tables, f
        # through a memory map, the dynamic tags alone or one table: the same as the whole read's
        assert elf_read.read_uncached(f, ()).dynamic == fast.dynamic and not elf_read.read_uncached(f, ()).tables
        assert elf_read.read_uncached(f, (".dynsym",)).tables == {k: v for k, v in fast.tables.items() if k == ".dynsym"}
    info = elf_read.elf_info(small_so)
    assert info.tag_values("DT_SONAME") == ["libsmall.so.7"]
    assert info.tag_values("DT_RUNPATH") + info.tag_values("DT_RPATH") == [f"{small_so.parent}:$ORIGIN/lib"]
    names = {n for n, undefined, _ in symbol_entries(small_so) if undefined}
    assert "_Z11imported_fnd" in names and "_Z11imported_fnd" in imported_symbols(small_so)
    assert "k::aaaa_kernel" in own_kernels(small_so) and "launch" in own_kernels(small_so)
    assert demangle(["_Z11imported_fnd", "plain"]) == ["imported_fn(double)", "plain"]


def test_other_elf_files_are_read_by_pyelftools(tmp_path, small_so):
    """A 32-bit object, where the compiler can make one: struct's reader declines it, pyelftools reads it."""
    src = tmp_path / "b.c"
    src.write_text("int thirty_two(void) { return 32; }\n")
    obj = tmp_path / "b.o"
    if subprocess.run([CXX, "-m32", "-x", "c", "-c", str(src), "-o", str(obj)], capture_output=True).returncode != 0:
        pytest.skip("no 32-bit target here")
    assert elf_read._read_fast(obj.read_bytes()) is None
    assert ("thirty_two", False, True) in elf_read.elf_info(obj).tables[".symtab"]


def test_a_file_is_read_again_when_its_content_changes_whatever_its_times(tmp_path, small_so):
    f = tmp_path / "libswap.so"
    shutil.copyfile(small_so, f)
    assert "k::aaaa_kernel" in own_kernels(f)
    st = f.stat()
    # the same size, the same modification time: only the bytes differ (the kernel's name, in both string tables)
    f.write_bytes(f.read_bytes().replace(b"aaaa_kernel", b"bbbb_kernel"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert "k::bbbb_kernel" in own_kernels(f) and "k::aaaa_kernel" not in own_kernels(f)


def test_unreadable_files_raise_and_the_callers_say_none(tmp_path):
    empty, text = tmp_path / "empty.so", tmp_path / "text.so"
    empty.write_bytes(b"")
    text.write_text("not an elf file\n")
    for f in (empty, text):
        with pytest.raises(ValueError):
            elf_read.elf_info(f)
        assert needed_libraries(f) == [] and own_kernels(f) == []
        with pytest.raises(ValueError):
            elf_read.read_uncached(f)
    with pytest.raises(OSError):
        elf_read.elf_info(tmp_path / "missing.so")
