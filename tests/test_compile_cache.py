"""The judge's persistent Inductor/Triton cache: the baseline timer compiles from it where Landlock keeps
every candidate process away from it; anywhere else each compile starts from a cold scratch directory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.config import ProfileConfig
from sandbox.confinement.filesystem import abi_version
from sandbox.confinement.processes import Session, disable_warm_pool, enable_warm_pool
from sandbox.timing.baseline import measure_reference
from tasks.loader import EXAMPLES_DIR

QUICK = ProfileConfig(target_ms=30, max_trials=12, min_trials=10, warmup_ms=5, retime_max=0)
LANDLOCK = abi_version() >= 1
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.skipif(not LANDLOCK, reason="no Landlock here: the persistent cache is never used (tested below)")
def test_baseline_timer_reuses_the_persistent_compile_cache(cache, small_task_path, tmp_path):
    """A library task (the bundled example, copied out as a workspace would hold it: trust follows the bytes,
    not the path) compiles with the judge's cache; the same model with one byte changed is a task nobody
    vetted, whose baseline compiles cold in its scratch directory and leaves nothing in the shared cache."""
    inductor = cache / "compile" / "inductor"
    library = tmp_path / "model.py"
    library.write_bytes((EXAMPLES_DIR / "swish_bias.py").read_bytes())
    first = measure_reference(str(library), "cpu", QUICK)
    assert first["compiled"] is not None, first["compile_error"]
    # torch.compile's own top rows, kept for `analyze`: the compiled graph's call, not eager's ATen ops
    assert any("CompiledFxGraph" in k["name"] or "Torch-Compiled" in k["name"] for k in first["compiled_kernels"]), \
        first["compiled_kernels"]
    cc = first["compile_cache"]
    assert cc["shared"] and Path(cc["dir"]) == inductor, cc
    assert cc["fxgraph_miss"] >= 1 and cc["fxgraph_hit"] == 0, cc
    assert [p for p in (inductor / "fxgraph").rglob("*") if p.is_file()], "nothing was compiled into the cache"
    # Inductor's C++ precompiled header lives under TMPDIR, and is rebuilt wherever it is missing
    assert list((cache / "compile" / "tmp").rglob("*.gch")), "the precompiled header was built elsewhere"
    assert stat.S_IMODE((cache / "compile").stat().st_mode) == 0o700
    # a new process (a baseline timed again: another judge process, a changed timing setting) compiles
    # nothing: Inductor finds the graph in the judge's cache
    second = measure_reference(str(library), "cpu", QUICK)
    cc = second["compile_cache"]
    assert cc["shared"] and cc["fxgraph_hit"] >= 1 and cc["fxgraph_miss"] == 0, cc
    before = sorted(p for p in (cache / "compile").rglob("*") if p.is_file())
    foreign = tmp_path / "foreign.py"
    foreign.write_bytes(library.read_bytes() + b"\n")
    cc = measure_reference(str(foreign), "cpu", QUICK)["compile_cache"]
    assert not cc["shared"] and "/scratch-" in cc["dir"], cc
    # confined, it compiles in its own process: a compile worker could not initialise CUDA (startup.confine_task)
    assert cc["compile_threads"] == 1, cc
    assert sorted(p for p in (cache / "compile").rglob("*") if p.is_file()) == before


@pytest.mark.full  # two cold torch.compile baselines (~50 s); an unconfined judge handing its baseline a scratch cache, never the shared one, stays in the default tier as test_only_a_landlocked_judge_hands_the_baseline_role_its_cache[off]
def test_unconfined_baseline_compiles_cold_every_time(cache, small_task_path, tmp_path, monkeypatch):
    """CUDA_AGENT_CONFINE=off (as on a kernel without Landlock): a candidate could have written any cache the
    user can, so neither the judge's persistent cache nor the user's own (here TORCHINDUCTOR_CACHE_DIR in
    the judge's environment, which the workers inherit) is compiled from."""
    monkeypatch.setenv("CUDA_AGENT_CONFINE", "off")
    user_cache = tmp_path / "user-inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(user_cache))
    for _ in range(2):
        cc = measure_reference(str(small_task_path), "cpu", QUICK)["compile_cache"]
        assert not cc["shared"] and "/scratch-" in cc["dir"], cc
        assert cc["fxgraph_hit"] == 0 and cc["fxgraph_miss"] >= 1, cc
    assert not user_cache.exists()
    assert not (cache / "compile").exists() or not any((cache / "compile").rglob("*"))


@pytest.mark.parametrize("mode", ["on", "mountns", "off"])
def test_only_a_landlocked_judge_hands_the_baseline_role_its_cache(cache, mode, monkeypatch):
    """With the warm pool on: a pooled worker was confined at start like a candidate's, so a baseline that
    may use the persistent cache gets a process of its own; elsewhere it may take a pooled one."""
    monkeypatch.setenv("CUDA_AGENT_CONFINE", mode)
    shared = mode == "on" and LANDLOCK
    pool = enable_warm_pool(1, refill=False)
    try:
        pool.prefill("cpu")
        (pooled,) = pool.idle[pool._key("cpu")]
        with Session("cpu") as s:
            assert s.spawn("baseline") is pooled or not shared  # a task outside the library: no shared cache
            pool.prefill("cpu")
            (pooled,) = pool.idle[pool._key("cpu")]
            w = s.spawn("baseline", compile_cache=True)
            r = w.request("compile_cache", 60.0, "reading the compile cache")
            assert r["ok"], r
            assert r["shared"] is shared, r
            expected = str(cache / "compile" / "inductor") if shared else os.path.join(w.scratch, "inductor")
            assert r["dir"] == expected, r
            assert (w is pooled) is not shared
            assert w.request("setup", 60.0, "setup", task="x", device="cpu", init_seed=1, which="candidate")[
                "reason"] == "internal_error"  # a baseline process never takes candidate code
    finally:
        disable_warm_pool()


# stage 1 of a worker that may run candidate code, a thread started between the stages (as torch's intra-op
# pool or CUDA's helpers are), then stage 2 on the main thread: what each thread can do to the compile cache
_STAGES = r"""
import json, os, sys, threading
from sandbox.confinement import filesystem

inductor = sys.argv[1]
entry = os.path.join(inductor, "entry.py")

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return f"E{e.errno}"

def write():
    with open(entry, "w") as f:
        f.write("poisoned")

def add():
    open(os.path.join(inductor, "added.py"), "w").close()

def read():
    open(entry).read()

out = {"stage1": filesystem.at_worker_start("timer"), "cache_env": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
go, done = threading.Event(), threading.Event()

def early():
    go.wait()
    out["early_write"], out["early_add"] = attempt(write), attempt(add)
    done.set()

threading.Thread(target=early).start()
ws = sys.argv[2]
out["stage2"] = filesystem.for_candidate(out["stage1"], sys.argv[3], None, os.path.join(ws, "model_new.py"),
                                      os.path.join(ws, "task.py"), False)[0]
out["read"], out["list"] = attempt(read), attempt(lambda: os.listdir(inductor))
out["write"], out["add"] = attempt(write), attempt(add)
go.set()
done.wait()
print(json.dumps(out))
"""


@pytest.mark.skipif(not LANDLOCK, reason="needs Landlock")
def test_no_thread_of_a_candidate_process_can_write_the_compile_cache(tmp_path):
    cache = tmp_path / "cache"
    inductor = cache / "compile" / "inductor"
    inductor.mkdir(parents=True)
    (inductor / "entry.py").write_text("compiled")
    ws, scratch, shm = tmp_path / "eps" / "ws", tmp_path / "scratch", tmp_path / "shm"
    for d in (ws, scratch, shm):
        d.mkdir(parents=True)
    (ws / "model_new.py").write_text("")
    (ws / "task.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "CUDA_AGENT_"))}
    # even were the variable set for it, a candidate-capable role ignores it
    env.update(CUDA_AGENT_CACHE=str(cache), CUDA_AGENT_SCRATCH=str(scratch), CUDA_AGENT_EXCHANGE_BASE=str(shm),
               CUDA_AGENT_COMPILE_CACHE=str(cache / "compile"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _STAGES, str(inductor), str(ws), str(shm)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stage1"].startswith("landlock") and "reads confined" in out["stage2"], out
    assert out["cache_env"] == str(scratch / "inductor"), out
    # stage 1 never granted the cache, so the thread that kept stage 1's rights cannot write it either
    assert {k: out[k] for k in ("read", "list", "write", "add", "early_write", "early_add")} == {
        k: "E13" for k in ("read", "list", "write", "add", "early_write", "early_add")}, out
    assert (inductor / "entry.py").read_text() == "compiled" and not (inductor / "added.py").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not LANDLOCK, reason="no Landlock here: the persistent cache is never used")
def test_cuda_baseline_reuses_the_persistent_inductor_and_triton_cache(cache, tmp_path):
    # a library task: only a vetted task's baseline may compile with the shared cache (tasks.loader.library_task)
    library = tmp_path / "task.py"
    library.write_bytes((EXAMPLES_DIR / "swish_bias.py").read_bytes())
    first = measure_reference(str(library), "cuda", QUICK)
    assert first["compiled"] is not None, first["compile_error"]
    cc = first["compile_cache"]
    assert cc["shared"] and cc["fxgraph_miss"] >= 1, cc
    assert [p for p in (cache / "compile" / "triton").rglob("*") if p.is_file()], "Triton compiled elsewhere"
    second = measure_reference(str(library), "cuda", QUICK)["compile_cache"]
    assert second["fxgraph_hit"] >= 1 and second["fxgraph_miss"] == 0, second
