import os
import time

from sandbox.api import compile_workspace
from sandbox.config import CompileConfig
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
    assert r.ok and r.up_to_date and r.rebuilt == []
    cpu_ws.write_text("kernels/extra.cpp", "int extra_fn() { return 1; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"], r.log_tail
    time.sleep(0.01)
    cpu_ws.write_text("kernels/extra.cpp", "int extra_fn() { return 2; }\n")
    r = compile_workspace(cpu_ws)
    assert r.ok and r.rebuilt == ["kernels/extra.cpp"]
    assert compile_workspace(cpu_ws).up_to_date


def test_timeout_kills_the_whole_build(tmp_path, small_task_path):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")
    # the full torch header set takes far longer than the limit
    ws.write_text("kernels/heavy_bomb.cpp", "#include <torch/extension.h>\nint f() { return 0; }\n")
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
