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


# ---- the file-name rule ------------------------------------------------------------------------------

GOOD_NAMES = ["model_new.py", "kernels/relu.cu", "kernels/relu_binding.cpp", "kernels/sub/x.cuh", "kernels/x.h",
              "kernels/util.hpp", "kernels/v2-fast+x.cc", "kernels/_private.cpp", "notes/README.md"]
BAD_NAMES = ["kernels/x.cu\nrule pwn\n  command = touch PWNED\nbuild y.o: pwn", "kernels/$x.cu", "kernels/a b.cu",
             "kernels/x;touch PWNED.cpp", "kernels/x$(touch PWNED).cpp", "kernels/x`touch PWNED`.cpp",
             "kernels/it's.cpp", 'kernels/"q".cpp', "kernels/a:b.cpp", "kernels/a@b.cpp", "kernels/.hidden.cpp",
             "kernels/-o.cpp", "kernels/+x.cpp", "kernels/relu\u2010x.cu", "kernels/ｒelu.cu", "kernels/é.cpp",
             "kernels/tab\there.cpp", "kernels/x.cu\r", "kernels/sub dir/x.cu", "kernels/" + "x" * 129 + ".cu"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_legitimate_names_are_written(ws, name):
    ws.write_text(name, "// ok\n")
    assert ws.read_text(name) == "// ok\n"


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_outside_the_rule_are_refused_up_front(ws, name):
    before = set(ws.list_files())
    with pytest.raises(WorkspaceError, match="may use only A-Z a-z 0-9 _ . \\+ -") as info:
        ws.write_text(name, "int x;\n")
    assert repr(name) in str(info.value), "the message names the file, escaped where it holds a line break"
    assert set(ws.list_files()) == before and not list(ws.root.rglob("*PWNED*"))


def test_a_link_to_a_badly_named_folder_is_refused(ws):
    (ws.root / "kernels" / "a b").mkdir()
    os.symlink(ws.root / "kernels" / "a b", ws.root / "kernels" / "ok")
    with pytest.raises(WorkspaceError, match="'a b' is not allowed"):
        ws.write_text("kernels/ok/x.cpp", "int x;\n")
    assert not (ws.root / "kernels" / "a b" / "x.cpp").exists()


def test_existing_badly_named_files_can_be_read_but_not_built(ws):
    """A file made outside the tools (a CLI user's editor) under a name the rule refuses: it can be read, and
    sources() names it instead of handing it to the build."""
    (ws.root / "kernels" / "ok.cpp").write_text("int ok;\n")
    (ws.root / "kernels" / "my kernel.cpp").write_text("int x;\n")
    (ws.root / "kernels" / "sub$x").mkdir()
    (ws.root / "kernels" / "sub$x" / "y.cpp").write_text("int y;\n")
    assert ws.read_text("kernels/my kernel.cpp") == "int x;\n"
    with pytest.raises(WorkspaceError, match="may use only") as info:
        ws.sources()
    assert "'kernels/my kernel.cpp'" in str(info.value) and "'kernels/sub$x/y.cpp'" in str(info.value)
    assert "ok.cpp" not in str(info.value)
    with pytest.raises(WorkspaceError, match="may use only"):
        ws.write_text("kernels/my kernel.cpp", "int changed;\n")
