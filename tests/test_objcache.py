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
