import os
import subprocess
import time

import pytest

from sandbox.api import compile_workspace
from sandbox.build.compile import INFRA_TIMEOUT_S, _ninja, infra_header, infra_object
from sandbox.build.toolchain import get_toolchain
from sandbox.config import CompileConfig
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.workspace import Workspace
from tasks import load_task
from test_verify import live_descendants


def test_compile_error_has_file_and_line(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/bad.cpp", "int ok() { return 1; }\n\nint broken() {\n  return undefined_name;\n}\n")
    r = compile_workspace(ws)
    assert not r.ok and r.reason == "compile_error"
    first = r.diagnostics[0]
    assert (first.file, first.line, first.severity) == ("kernels/bad.cpp", 4, "error")
    assert "undefined_name" in first.message
    assert "kernels/bad.cpp:4" in r.message
    assert os.path.isfile(r.log_path) and "undefined_name" in open(r.log_path).read()


def test_no_sources(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    r = compile_workspace(ws)
    assert not r.ok and "no sources" in r.message


def test_incremental_rebuild_touches_only_the_edited_source(cpu_ws):
    r = compile_workspace(cpu_ws)
    assert r.ok and r.up_to_date and r.rebuilt == [] and r.steps == {}
    cpu_ws.write_text("kernels/extra.cpp", "int extra_fn() { return 1; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"], r.log_tail
    # this build's two steps, timed by ninja: the edited source and the link, nothing from earlier builds
    assert list(r.steps) == ["kernels/extra.cpp", "link"] and 0 <= sum(r.steps.values()) <= r.duration_s, r.steps
    time.sleep(0.01)
    cpu_ws.write_text("kernels/extra.cpp", "int extra_fn() { return 2; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"]
    assert compile_workspace(cpu_ws).up_to_date


def test_timeout_kills_the_whole_build(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    # the full torch header set takes far longer than the limit
    ws.write_text("kernels/heavy_bomb.cpp", "#include <torch/extension.h>\nint f() { return 0; }\n")
    tc = get_toolchain("cpu")
    infra_object(tc, INFRA_TIMEOUT_S), infra_header(tc, INFRA_TIMEOUT_S)  # once per toolchain: not the limit's
    t0 = time.monotonic()
    r = compile_workspace(ws, CompileConfig(timeout_s=1.5))
    assert not r.ok and r.reason == "compile_timeout"
    assert time.monotonic() - t0 < 30
    assert live_descendants() == [], "compiler processes left behind"


def test_a_source_linking_outside_is_refused(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    outside = tmp_path / "secret.cpp"
    outside.write_text("int stolen() { return 1; }\n")
    os.symlink(outside, ws.root / "kernels" / "leak.cpp")
    r = compile_workspace(ws)
    assert not r.ok and r.reason == "compile_error" and "links outside the workspace" in r.message


def _deps(ws: Workspace) -> dict[str, list[str]]:
    """What ninja recorded each object of the last build to depend on (from the compiler's depfiles)."""
    out = subprocess.run([_ninja(), "-C", str(ws.build_dir), "-t", "deps"], capture_output=True, text=True,
                         check=True).stdout
    deps: dict[str, list[str]] = {}
    for block in out.strip().split("\n\n"):
        head, *rest = block.strip().splitlines()
        deps[head.split(":")[0]] = [x.strip() for x in rest]
    return deps


@pytest.mark.skipif(not shared_caches_trusted(), reason="no Landlock: the judge's cache is not trusted (tested below)")
def test_bindings_compile_against_the_precompiled_header(cpu_ws):
    """The fixture's source starts with binding_registry.h: g++ took the toolchain's precompiled header. A
    source with code before the include cannot use it (g++ takes one only before the first token): it reads
    the header itself, and builds all the same."""
    pch = infra_header(get_toolchain("cpu"), INFRA_TIMEOUT_S)
    assert pch is not None and (pch / "binding_registry.h.gch").is_file()
    assert (pch / "binding_registry.h").read_bytes() == (cpu_ws.root / "binding_registry.h").read_bytes()
    # g++ lists a header it read in the object's depfile, and neither the header nor the .gch it took instead
    assert not [d for d in _deps(cpu_ws)["variants.cpp.o"] if "binding_registry" in d]
    cpu_ws.write_text("kernels/extra.cpp", 'static const int extra_value = 7;\n#include "binding_registry.h"\n'
                      "int extra_fn() { return extra_value; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"], r.log_tail
    assert str(pch / "binding_registry.h") in _deps(cpu_ws)["extra.cpp.o"]  # the plain header, beside the .gch


def test_an_untrusted_cache_gets_no_precompiled_header(tmp_path, small_task_path, monkeypatch):
    """Where candidates are not kept out of the judge's cache (here CUDA_AGENT_CONFINE=off, as on a kernel
    without Landlock), a header compiled into every later binding is not taken from it."""
    monkeypatch.setenv("CUDA_AGENT_CONFINE", "off")
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    assert infra_header(get_toolchain("cpu"), INFRA_TIMEOUT_S) is None
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/b.cpp", '#include "binding_registry.h"\nint b_fn() { return 2; }\n')
    r = compile_workspace(ws)
    assert r.ok, r.log_tail
    assert "pch" not in (ws.build_dir / "build.ninja").read_text()
    assert "../binding_registry.h" in _deps(ws)["b.cpp.o"] and not list((tmp_path / "cache").rglob("*.gch"))
