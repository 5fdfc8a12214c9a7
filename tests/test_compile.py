import os
import subprocess
import time

import pytest

from sandbox.api import compile_workspace
from sandbox.build import pybind_interface
from sandbox.build.compile import INFRA_TIMEOUT_S, _ninja, infra_header, infra_object, thin_header
from sandbox.build.ninja_file import ninja_path, ninja_value, object_name, source_edge
from sandbox.build.toolchain import get_toolchain
from sandbox.config import CompileConfig
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.workspace import Workspace, WorkspaceError
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
    idle = r.cpu_s  # ninja finding nothing to do, and its launchers
    cpu_ws.write_text("kernels/extra.cpp", "int extra_fn() { return 1; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"], r.log_tail
    # the CPU of every process the build ran, the compile's and the link's included: more than ninja's alone
    assert idle is not None and r.cpu_s is not None and r.cpu_s > idle and r.cpu_s > 0.05, (idle, r.cpu_s)
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
    # the workspace's header with pybind11's headers marked interface-only (tests/test_pybind_interface.py)
    headers = (pch.parent / pybind_interface.HEADERS_FILE).read_text().split()
    assert pch.name == "pch-interface" and headers
    own = pch / "binding_registry.h"
    assert own.read_text() == pybind_interface.interface_header((cpu_ws.root / "binding_registry.h").read_text(),
                                                                headers, own)
    # g++ lists a header it read in the object's depfile, and neither the header nor the .gch it took instead
    assert not [d for d in _deps(cpu_ws)["variants.cpp.o"] if "binding_registry" in d]
    cpu_ws.write_text("kernels/extra.cpp", 'static const int extra_value = 7;\n#include "binding_registry.h"\n'
                      "int extra_fn() { return extra_value; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"] and r.full_bindings == [], r.log_tail
    # it compiled thin (no pybind11 in it), reading the thin header beside the thin .gch
    thin = thin_header(get_toolchain("cpu"), INFRA_TIMEOUT_S)
    assert thin is not None and (thin / "binding_registry.h.gch").is_file()
    assert str(thin / "binding_registry.h") in _deps(cpu_ws)["extra.cpp.o"]


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


# ---- file names in the build ------------------------------------------------------------------------

def test_ninja_reads_escaped_paths_back_as_they_were(tmp_path):
    """The escaping is ninja's own reading of it: each odd path comes back from `ninja -t targets` unchanged."""
    odd = ["a b.o", "x$y.o", "c:d.o", "$(touch PWNED).o", "e$ :f.o", "/cache dir/infra:1/binding.o"]
    rules = "rule r\n  command = true\n" + "".join(f"build {ninja_path(p)}: r\n" for p in odd)
    (tmp_path / "build.ninja").write_text(rules + f"v = {ninja_value('$a $(b) c')}\n")
    out = subprocess.run([_ninja(), "-C", str(tmp_path), "-t", "targets", "all"], capture_output=True, text=True,
                         check=True).stdout
    assert sorted(line.rsplit(": ", 1)[0] for line in out.splitlines()) == sorted(odd)
    for bad in ("x\nrule pwn", "x\r"):
        with pytest.raises(ValueError, match="line break"):
            ninja_value(bad)


def testobject_names_are_distinct():
    names = ["kernels/a/b.cpp", "kernels/a_b.cpp", "kernels/a__b.cpp", "kernels/a+b.cpp", "kernels/a-b.cpp",
             "kernels/a/b/c.cu", "kernels/a_b/c.cu", "kernels/a/b_c.cu", "kernels/a.b.cpp", "kernels/a/b.cu"]
    objects = [object_name(n) for n in names]
    assert len(set(objects)) == len(names), objects
    assert object_name("kernels/variants.cpp") == "variants.cpp.o"  # top-level objects keep their names


def _plant_bad_sources(ws: Workspace) -> None:
    """Sources made outside the tools beside a good one: a name that, in build.ninja, ends the build statement
    (the path before the line break is the good source, so ninja finds every input) and adds a rule that runs a
    command (before names were checked, this build ran `touch PWNED`); and shell text, which ninja quotes in $in."""
    (ws.root / "kernels" / "x.cpp").write_text("int ok() { return 1; }\n")
    (ws.root / "kernels" / "x.cpp\nrule pwn\n  command = touch PWNED\nbuild PWNED: pwn\ndefault PWNED\n#.cpp"
     ).write_text("int a;\n")
    (ws.root / "kernels" / "y`>PWNED`.cpp").write_text("int b;\n")


def test_a_source_named_against_the_rule_fails_the_compile_before_ninja(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    _plant_bad_sources(ws)
    r = compile_workspace(ws)
    assert not r.ok and r.reason == "compile_error", r
    assert "'kernels/y`>PWNED`.cpp'" in r.message and "rule pwn" in r.message and "may use only" in r.message
    assert "0 error(s)" not in r.message and "'kernels/x.cpp'" not in r.message
    assert not (ws.build_dir / "build.ninja").exists() and not list(ws.root.rglob("PWNED"))


def test_the_build_file_refuses_such_a_source_on_its_own(tmp_path, small_task_path):
    """Defence in depth: a name that got past Workspace.sources() is still refused where the build statement is
    made, naming the file."""
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    _plant_bad_sources(ws)
    for src in sorted((ws.root / "kernels").iterdir()):
        if src.name == "x.cpp":
            assert source_edge(ws, src, "cxx") == ("x.cpp.o", "build x.cpp.o: cxx ../kernels/x.cpp")
        else:
            with pytest.raises(WorkspaceError, match="cannot build .*may use only"):
                source_edge(ws, src, "cxx")


def test_sources_that_shared_an_object_build_side_by_side(tmp_path, small_task_path):
    """kernels/a/b.cpp and kernels/a_b.cpp were both a_b.cpp.o (ninja: "multiple rules generate"); with a `+`
    and a `-` beside them, all three are compiled, timed, linked and, built again elsewhere, reused by name."""
    files = {"kernels/a/b.cpp": 'extern "C" int from_a_slash_b() { return 1; }\n',
             "kernels/a_b.cpp": 'extern "C" int from_a_underscore_b() { return 2; }\n',
             "kernels/v2-fast+x.cpp": 'extern "C" int from_plus_minus() { return 3; }\n'}
    results = []
    for name in ("one", "two"):
        ws = Workspace.create(load_task(str(small_task_path)), tmp_path / name, backend="cpu")
        for rel, body in files.items():
            ws.write_text(rel, body)
        results.append(r := compile_workspace(ws))
        assert r.ok, r.message + r.log_tail
        assert sorted(r.rebuilt) == sorted(files) and set(r.steps) == {*files, "link"}, (r.rebuilt, r.steps)
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(ws.build_dir / "cuda_extension.so")],
                                 capture_output=True, text=True, check=True).stdout
        assert {"from_a_slash_b", "from_a_underscore_b", "from_plus_minus"} <= set(symbols.split())
    if shared_caches_trusted():  # the object cache names each reused source by its own path
        assert sorted(results[1].reused) == sorted(files), results[1].log_tail


def test_a_build_failure_without_diagnostics_says_why(tmp_path, small_task_path):
    """No compiler diagnostic to count (here the assembler cannot write the object): the message quotes the
    line that says why, not "compilation failed with 0 error(s)"."""
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    ws.write_text("kernels/a.cpp", "int a_fn() { return 1; }\n")
    (ws.build_dir / "a.cpp.o").mkdir()
    r = compile_workspace(ws, CompileConfig(object_cache=False))
    assert not r.ok and r.reason == "compile_error" and r.diagnostics == []
    assert "0 error(s)" not in r.message and "a.cpp.o: Is a directory" in r.message, r.message
