"""The judge's object cache: a translation unit compiled once is reused by content, and only by content."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sandbox.api import compile_workspace
from sandbox.build.compile import extension_path
from sandbox.build.objcache import parse_depfile, prune
from sandbox.config import CompileConfig
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.workspace import Workspace
from tasks import load_task

TRUSTED = pytest.mark.skipif(not shared_caches_trusted(), reason="no Landlock: the judge's cache is not trusted here")
# light sources (no torch header): the mechanism, not the compiler, is under test
SOURCE = '#include "helper.h"\n#warning "a warning the compiler gives"\nint a_fn() { return HELPER; }\n'


def _ws(root: Path, small_task_path: Path, helper: str = "#define HELPER 3\n", source: str = SOURCE) -> Workspace:
    ws = Workspace.create(load_task(str(small_task_path)), root, backend="cpu")
    ws.write_text("kernels/a.cpp", source)
    ws.write_text("kernels/helper.h", helper)
    return ws


@TRUSTED
def test_an_identical_source_reuses_the_object_and_reports_the_same_warnings(tmp_path, small_task_path):
    first = compile_workspace(_ws(tmp_path / "one", small_task_path))
    assert first.ok and first.reused == [] and first.rebuilt == ["kernels/a.cpp"], first.log_tail
    again = _ws(tmp_path / "two", small_task_path)
    second = compile_workspace(again)
    assert second.ok and second.reused == ["kernels/a.cpp"] == second.rebuilt, second.log_tail
    assert (again.build_dir / "a.cpp.o").read_bytes() == (tmp_path / "one" / "build" / "a.cpp.o").read_bytes()
    warned = [(d.file, d.line, d.severity) for r in (first, second) for d in r.diagnostics]
    assert warned == [("kernels/a.cpp", 2, "warning")] * 2, warned
    assert extension_path(again).is_file()
    # ninja's dependency record came with the object: editing the header rebuilds it in this workspace
    time.sleep(0.01)
    again.write_text("kernels/helper.h", "#define HELPER 5\n")
    third = compile_workspace(again)
    assert third.ok and third.rebuilt == ["kernels/a.cpp"] and third.reused == [], third.log_tail


@TRUSTED
def test_a_changed_header_or_flag_is_compiled_again(tmp_path, small_task_path):
    assert compile_workspace(_ws(tmp_path / "one", small_task_path)).ok
    other_header = compile_workspace(_ws(tmp_path / "two", small_task_path, helper="#define HELPER 4\n"))
    assert other_header.ok and other_header.reused == [], "an object compiled against another header was reused"
    # the same source and header under another command line (here without the precompiled header's folder
    # on the include path): not the same compile
    plain = compile_workspace(_ws(tmp_path / "three", small_task_path), CompileConfig(precompiled_header=False))
    assert plain.ok and plain.reused == [], "an object compiled with other flags was reused"


@TRUSTED
def test_a_workspace_header_standing_in_for_a_system_ones_include_is_keyed(tmp_path, small_task_path):
    """A torch header includes <torch/headeronly/macros/cmake_macros.h>; the workspace's include path comes
    first, so kernels/torch/headeronly/macros/cmake_macros.h is what it gets. g++ -MMD leaves a header included
    from a system header out of the depfile: the same source beside another stand-in would have reused an
    object built from the first one's code. The build asks for every header (-MD), so it is compiled again."""
    source = "#include <c10/macros/cmake_macros.h>\nint a_fn() { return STAND_IN; }\n"
    objects = []
    for value in (1, 2):
        ws = _ws(tmp_path / f"ws{value}", small_task_path, source=source)
        ws.write_text("kernels/torch/headeronly/macros/cmake_macros.h", f"#define STAND_IN {value}\n")
        r = compile_workspace(ws)
        assert r.ok and r.reused == [], (value, r.reused, r.log_tail)
        objects.append((ws.build_dir / "a.cpp.o").read_bytes())
    assert objects[0] != objects[1]


@TRUSTED
def test_bytes_an_assembler_pulls_in_are_never_kept(tmp_path, small_task_path):
    """`.incbin` puts a file's bytes in the object and no depfile names the file: such an object has no key."""
    source = 'asm(".section .rodata\\n.incbin \\"../kernels/blob.bin\\"\\n.text");\nint a_fn() { return 1; }\n'
    for blob in (b"first", b"second"):
        ws = _ws(tmp_path / blob.decode(), small_task_path, source=source)
        (ws.root / "kernels" / "blob.bin").write_bytes(blob)
        r = compile_workspace(ws)
        assert r.ok and r.reused == [], r.log_tail
        assert blob in (ws.build_dir / "a.cpp.o").read_bytes()


@TRUSTED
def test_a_failed_compile_is_not_kept(tmp_path, small_task_path):
    bad = "int a_fn() { return undefined_name; }\n"
    for name in ("one", "two"):
        r = compile_workspace(_ws(tmp_path / name, small_task_path, source=bad))
        assert not r.ok and r.reason == "compile_error" and r.reused == [], r.log_tail
        assert r.diagnostics and "undefined_name" in r.diagnostics[0].message


@pytest.mark.full  # two cold builds (~50 s); an untrusted cache refused at build stays in the default tier as test_compile.py::test_an_untrusted_cache_gets_no_precompiled_header (the same trust decision: CUDA_AGENT_CONFINE=off)
def test_an_untrusted_cache_compiles_every_source(tmp_path, small_task_path, monkeypatch):
    """Where candidates may write the judge's cache (CUDA_AGENT_CONFINE=off, as without Landlock), no object is
    taken from it: one could carry code into every later extension."""
    monkeypatch.setenv("CUDA_AGENT_CONFINE", "off")
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    for name in ("one", "two"):
        ws = _ws(tmp_path / name, small_task_path)
        r = compile_workspace(ws)
        assert r.ok and r.reused == [], r.log_tail
        assert "objcache" not in (ws.build_dir / "build.ninja").read_text()
    assert not (tmp_path / "cache" / "objects").exists()


def test_depfiles_parse_with_continuations_and_escaped_spaces():
    text = "a.cpp.o: ../kernels/a.cpp \\\n ../kernels/my\\ dir/h.h /usr/include/x.h\n"
    assert parse_depfile(text) == ["../kernels/a.cpp", "../kernels/my dir/h.h", "/usr/include/x.h"]
    assert parse_depfile("x.cu.o : ../kernels/x.cu\n") == ["../kernels/x.cu"]


def test_prune_drops_the_least_recently_used_keys(tmp_path):
    now = time.time()
    for i, age in enumerate((300, 100, 200)):
        key = tmp_path / "ab" / f"key{i}"
        key.mkdir(parents=True)
        (key / "x.o").write_bytes(b"0" * 1000)
        os.utime(key / "x.o", (now - age, now - age))
    prune(str(tmp_path), max_bytes=1500)
    assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == ["key1"]  # the newest, within the limit


# ---- a lookup that came out differently (Judge IX, item 4) --------------------------------------------------
HAS_INCLUDE = ('#if __has_include("relu_config.h")\n#include "relu_config.h"\n#else\n#define SCALE 1\n#endif\n'
               'int a_fn() { return SCALE; }\n')
# the same probe spelled so that no text search finds it: only the workspace's names keep it apart
PASTED = ('#define PASTE(a, b) a##b\n#if PASTE(__has_, include)("relu_config.h")\n#include "relu_config.h"\n'
          '#else\n#define SCALE 1\n#endif\nint a_fn() { return SCALE; }\n')
# a torch header's include that a workspace file shadows (the include path puts the workspace first)
SHADOWED = "#include <c10/macros/cmake_macros.h>\n#ifndef STAND_IN\n#define STAND_IN 1\n#endif\nint a_fn() { return STAND_IN; }\n"
VARIANTS = {"has_include": (HAS_INCLUDE, "kernels/relu_config.h", "#define SCALE 7\n"),
            "pasted": (PASTED, "kernels/relu_config.h", "#define SCALE 7\n"),
            "shadowed": (SHADOWED, "kernels/torch/headeronly/macros/cmake_macros.h", "#define STAND_IN 7\n")}


def _variant(root: Path, small_task_path: Path, case: str, with_header: bool) -> Workspace:
    source, header, text = VARIANTS[case]
    ws = _ws(root, small_task_path, source=source)
    if with_header:
        ws.write_text(header, text)
    return ws


@TRUSTED
@pytest.mark.parametrize("case", sorted(VARIANTS))
# the default tier: each case header-first; header-second in the full suite (tests/README.md)
@pytest.mark.parametrize("header_first", [True, pytest.param(False, marks=pytest.mark.full)], ids=["header-first", "header-second"])
def test_an_object_another_preprocessing_would_not_make_is_never_served(case, header_first, tmp_path,
                                                                         small_task_path):
    """A byte-identical .cpp in two workspaces of one cache, one with the header its preprocessing looks for and
    one without: each gets the object of its own preprocessing, in either order; a third workspace like the first
    still reuses the first's object (the cache is not simply off)."""
    cfg = CompileConfig(object_cache_dir=str(tmp_path / "objects"))
    order = [header_first, not header_first]
    built = []
    for i, with_header in enumerate(order):
        ws = _variant(tmp_path / f"ws{i}", small_task_path, case, with_header)
        r = compile_workspace(ws, cfg)
        assert r.ok and r.reused == [], (case, with_header, r.reused, r.log_tail)
        built.append((ws.build_dir / "a.cpp.o").read_bytes())
    assert built[0] != built[1]
    plain = _variant(tmp_path / "plain", small_task_path, case, order[0])
    expected = compile_workspace(plain, CompileConfig(object_cache=False))
    assert expected.ok and (plain.build_dir / "a.cpp.o").read_bytes() == built[0]
    again = _variant(tmp_path / "again", small_task_path, case, order[0])
    r = compile_workspace(again, cfg)
    assert r.ok and (again.build_dir / "a.cpp.o").read_bytes() == built[0], r.log_tail
    if case == "has_include":  # spelled out: never kept, and the log says why
        assert r.reused == [] and "not kept (../kernels/a.cpp asks whether a header exists" in r.log_tail, r.log_tail
    else:
        assert r.reused == ["kernels/a.cpp"], r.log_tail


# ---- bounded on every store, and each store listed for the workspace's owner -----------------------------
def _cache_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".lock")


@TRUSTED
def test_the_cache_is_bounded_on_every_store_and_lists_what_each_build_kept(tmp_path, small_task_path):
    objects = tmp_path / "objects"
    sizes = []
    for i in range(3):  # objects of about the same size, each a key of its own
        ws = _ws(tmp_path / f"ws{i}", small_task_path, source=f"int a_fn() {{ return {i}; }}\n")
        r = compile_workspace(ws, CompileConfig(object_cache_dir=str(objects)))
        assert r.ok, r.log_tail
        kept = (ws.build_dir / ".objcache-kept").read_text().split()
        assert len(kept) == 2 and kept[0].endswith(".json") and kept[1].endswith(".o"), kept
        assert all(Path(p).is_file() and objects in Path(p).parents for p in kept), kept
        sizes.append(_cache_bytes(objects))
    one = sizes[0]
    # a limit that holds one entry and a half: every store leaves at most that, the newest kept
    limit = one + one // 2
    bounded = tmp_path / "bounded"
    for i in range(3):
        ws = _ws(tmp_path / f"b{i}", small_task_path, source=f"int a_fn() {{ return {i}; }}\n")
        r = compile_workspace(ws, CompileConfig(object_cache_dir=str(bounded), object_cache_max_bytes=limit))
        assert r.ok and "not kept" not in r.log_tail, r.log_tail
        assert _cache_bytes(bounded) <= limit
        newest = (ws.build_dir / ".objcache-kept").read_text().split()
        assert all(Path(p).is_file() for p in newest), "the entry just stored was pruned"
    # an object over the whole limit is not kept, and the log says so
    ws = _ws(tmp_path / "big", small_task_path, source="char blob[1 << 16] = {1};\nint a_fn() { return blob[0]; }\n")
    r = compile_workspace(ws, CompileConfig(object_cache_dir=str(bounded), object_cache_max_bytes=limit))
    assert r.ok and "cuda-agent object cache: not kept (the object's" in r.log_tail, r.log_tail
    assert not (ws.build_dir / ".objcache-kept").exists()
    assert _cache_bytes(bounded) <= limit
