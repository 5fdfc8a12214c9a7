"""The judge's own process never imports torch nor opens a device; only its workers do.

The CLI and the MCP server's helper (`python -m mcp_server.runner`, one per tool call) run compile, verify
and profile's orchestration. Importing torch there cost 4-5 s per MCP call on the H100 host, and opening
a GPU there would hold a CUDA context beside the workers'. Each check runs the real operations in a fresh
process and looks at what that process loaded, and the toolchain probe that replaced the in-process
torch queries is checked to follow its cache key.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.backend import on_gpu
from sandbox.build.toolchain import get_toolchain, toolchain_cache_path

REPO = Path(__file__).resolve().parent.parent

# what a helper does: import the operations, get ready as one started ahead of its call would (runner.prepare),
# then compile (nothing to do), verify and profile the workspace in argv[1]; print the results and what
# this process loaded
JUDGE = r"""
import json, re, sys
import sandbox.api
from mcp_server import runner
from sandbox.build.toolchain import toolchain_cache_path

toolchain_cache_path("cpu").unlink(missing_ok=True)  # the toolchain is probed again, in its own process
runner.prepare("cpu")
out = {op: runner.run({"op": op, "workdir": sys.argv[1]}) for op in ("compile", "verify", "profile")}
out["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
out["libraries"] = sorted({line.split()[-1] for line in open("/proc/self/maps")
                           if re.search(r"lib(torch|c10|cuda|cudart|nvidia)", line)})
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.slow
def test_helper_runs_compile_verify_profile_without_torch(built_example_workspace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(built_example_workspace, ws, symlinks=True)
    out = subprocess.run([sys.executable, "-c", JUDGE, str(ws)], capture_output=True, text=True, env=_env(),
                         cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    c, v, p = (found[op] for op in ("compile", "verify", "profile"))
    assert c["ok"] and c["result"]["ok"] and c["result"]["up_to_date"], c
    assert v["ok"] and v["result"]["ok"], v
    # a loaded CPU may be too noisy to score a speedup: the profile still ran its whole path
    assert p["ok"] and (p["result"]["ok"] or p["result"]["reason"] == "timing_noisy"), p
    assert p["result"]["device"].startswith("cpu:") and p["result"]["torch_version"], p["result"]
    assert found["modules"] == [], "the judge's process imported " + ", ".join(found["modules"][:10])
    assert found["libraries"] == [], "the judge's process loaded " + ", ".join(found["libraries"])


@pytest.mark.slow
def test_cli_verify_imports_no_torch(built_example_workspace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(built_example_workspace, ws, symlinks=True)
    # -X importtime lists every module this process imports (on stderr); the workers are other processes
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "cuda_agent", "verify", str(ws), "--json"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads(out.stdout)["ok"]
    imported = re.findall(r"^import time:.*\|\s*(\S+)$", out.stderr, re.MULTILINE)
    assert "sandbox.correctness.verify" in imported  # the listing is real
    assert not [m for m in imported if m.split(".")[0] == "torch"]


def _fake_toolkit(root: Path) -> Path:
    """A folder laid out like a CUDA toolkit, with an `nvcc` that is only a file: the probe records paths."""
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    return nvcc


def test_toolchain_cache_follows_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    for name in ("CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "CXX"):
        monkeypatch.delenv(name, raising=False)
    a, b = (_fake_toolkit(tmp_path / n) for n in "ab")
    cxx = a.parent / "c++"  # only a path: the probe records it
    entries = lambda: sorted((tmp_path / "cache" / "toolchain").glob("*.json"))  # noqa: E731

    monkeypatch.setenv("CUDA_HOME", str(a.parent.parent))
    first = get_toolchain("cuda")
    assert first.nvcc == str(a) and len(entries()) == 1
    stamp = toolchain_cache_path("cuda").stat().st_mtime_ns
    assert get_toolchain("cuda") == first and toolchain_cache_path("cuda").stat().st_mtime_ns == stamp  # read back

    # another toolkit: probed again, not served the first one's nvcc
    monkeypatch.setenv("CUDA_HOME", str(b.parent.parent))
    assert get_toolchain("cuda").nvcc == str(b) and len(entries()) == 2
    # another host compiler
    monkeypatch.setenv("CXX", str(cxx))
    assert get_toolchain("cuda").cxx == str(cxx) and len(entries()) == 3
    # the visible GPUs decide the device's name, which keys cached baselines
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    path = toolchain_cache_path("cuda")
    assert not path.exists()
    get_toolchain("cuda")
    assert path.exists() and len(entries()) == 4
    # so does the GPU a judgment is pinned to (a judge spreading judgments over a host's GPUs)
    with on_gpu("2"):
        pinned = toolchain_cache_path("cuda")
        assert not pinned.exists()
        get_toolchain("cuda")
        assert pinned.exists() and len(entries()) == 5
    # back to the first setting: its entry is still there and is what comes back
    monkeypatch.setenv("CUDA_HOME", str(a.parent.parent))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CXX")
    assert get_toolchain("cuda") == first and len(entries()) == 5
    # an unreadable entry is probed again and replaced
    toolchain_cache_path("cuda").write_text("{not json")
    assert get_toolchain("cuda") == first
    assert json.loads(toolchain_cache_path("cuda").read_text())["nvcc"] == str(a)
