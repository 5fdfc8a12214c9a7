import os

import pytest

from sandbox.build.compile import compile_workspace
from sandbox.correctness.verify import verify_workspace
from sandbox.workspace import PROTECTED, Workspace, WorkspaceError
from tasks import load_task


@pytest.fixture
def ws(tmp_path, small_task_path):
    return Workspace.create(load_task(str(small_task_path)), tmp_path / "ws", backend="cpu")


def test_layout(ws):
    files = set(ws.list_files())
    assert {"model.py", "model_new.py", "binding.cpp", "binding_registry.h", "SKILL.md"} <= files
    assert not any(f.startswith((".cuda_agent", "build/")) for f in files)
    assert (ws.root / "model.py").read_text() == ws.reference_source()
    assert "REGISTER_BINDING" in (ws.root / "binding_registry.h").read_text()
    assert "torch/extension.h>" not in (ws.root / "binding_registry.h").read_text()


@pytest.mark.parametrize("bad", ["../x.py", "/etc/passwd", "kernels/../../x", "a\x00b", ""])
def test_paths_cannot_escape(ws, bad):
    with pytest.raises(WorkspaceError):
        ws.write_text(bad, "x")


def test_symlink_out_is_refused(ws, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, ws.root / "kernels" / "link")
    with pytest.raises(WorkspaceError, match="outside"):
        ws.write_text("kernels/link/evil.cpp", "x")
    with pytest.raises(WorkspaceError, match="outside"):
        ws.read_text("kernels/link")
    assert not (outside / "evil.cpp").exists()


@pytest.mark.parametrize("name", PROTECTED)
def test_protected_files_cannot_be_written(ws, name):
    with pytest.raises(WorkspaceError, match="protected"):
        ws.write_text(name, "hacked")


@pytest.mark.parametrize("name", [".cuda_agent/reference.py", "build/cuda_extension.so"])
def test_sandbox_dirs_cannot_be_written(ws, name):
    with pytest.raises(WorkspaceError, match="belongs to the sandbox"):
        ws.write_text(name, "hacked")


def test_write_limits_and_reads(ws):
    ws.write_text("kernels/a.cpp", "int x;")
    assert ws.read_text("kernels/a.cpp") == "int x;"
    with pytest.raises(WorkspaceError, match="limit"):
        ws.write_text("kernels/big.cpp", "x" * 100, max_bytes=10)


def test_tampered_protected_files_are_restored(ws):
    original = (ws.root / "model.py").read_text()
    (ws.root / "model.py").write_text("class Model: pass  # the agent rewrote the reference\n")
    (ws.root / "binding.cpp").unlink()
    restored = ws.ensure_protected()
    assert sorted(restored) == ["binding.cpp", "model.py"]
    assert (ws.root / "model.py").read_text() == original
    assert ws.ensure_protected() == []


def test_tampered_judge_copy_is_refused(ws):
    (ws.root / ".cuda_agent" / "reference.py").write_text("class Model: pass\n")
    with pytest.raises(WorkspaceError, match="modified"):
        ws.reference_source()
    result = compile_workspace(ws)
    assert not result.ok and result.reason == "protected_file_tampered"


def test_tampering_is_reported_by_verify(cpu_ws):
    (cpu_ws.root / "model.py").write_text("# reference replaced by something easier\n")
    result = verify_workspace(cpu_ws)
    assert result.ok, result.message
    assert result.restored_files == ["model.py"]
    assert "silu" in (cpu_ws.root / "model.py").read_text()


def test_not_a_workspace(tmp_path):
    with pytest.raises(WorkspaceError, match="not a cuda-agent workspace"):
        Workspace(tmp_path)


def test_init_refuses_non_empty_dir(tmp_path, small_task_path):
    (tmp_path / "keep.txt").write_text("data")
    with pytest.raises(WorkspaceError, match="not empty"):
        Workspace.create(load_task(str(small_task_path)), tmp_path, backend="cpu")
    assert (tmp_path / "keep.txt").read_text() == "data"
