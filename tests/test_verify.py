import os
import time

import pytest

from conftest import FIXTURES, set_variant
from sandbox.api import compile_workspace, verify_workspace
from sandbox.config import VerifyConfig
from sandbox.confinement import kept, proctree, template
from sandbox.workspace import Workspace
from tasks import load_task

FAST = VerifyConfig(trials=2)


def live_descendants() -> list[int]:
    """Our process's descendants that are still running (zombies do not count), but for the template that
    workers are forked from (CUDA_AGENT_FORK=on), which lives as long as this process. Counted once the
    operations' workers, killed when each returned, have been collected (confinement/reaper.py)."""
    from sandbox.confinement.reaper import REAPER

    assert REAPER.drain(60)
    own = template.owned()
    spared = {own.proc.pid} if own is not None else set()
    # and the task processes kept for later judgments (on CUDA by default: a GPU test earlier in the session)
    spared |= {w.proc.pid for ws in kept.KEEPER.idle.values() for _, w in ws}
    return [p for p in proctree.descendants(os.getpid()) if proctree.alive(p) and p not in spared]


def verify(ws, variant=None, cfg=FAST):
    if variant:
        set_variant(ws.root, variant)
    return verify_workspace(ws, cfg)


def test_correct_solution_passes_on_fresh_seeds(cpu_ws):
    r = verify(cpu_ws, "correct", VerifyConfig())
    assert r.ok, r.message
    assert [t.variant for t in r.trials] == ["original"] * 5 + ["signed"]
    assert all(t.ok and not t.skipped for t in r.trials)
    assert len({t.seed for t in r.trials}) == 6
    out = r.trials[0].outputs[0]
    assert out.shape == [64, 256] and out.dtype == "float32" and out.mismatched == 0
    assert out.max_abs_error < 1e-4
    # fresh seeds on every call
    again = verify(cpu_ws)
    assert {t.seed for t in again.trials}.isdisjoint({t.seed for t in r.trials})
    # where the time went: start-up of both processes, and the candidate's steps per trial
    p = r.phases
    assert p["worker_wait"] == max(p["candidate_wait"], p["reference_wait"]) > 0
    if template.mode() == "on":  # forked from a template: torch was imported before the workers were asked for
        assert p["import_torch"] == again.phases["import_torch"] == 0
        # (the first call may have waited for the template's own imports; the second finds it ready)
        assert again.phases["worker_wait"] < template.owned().channel.info()["import_torch_s"]
    else:
        # import_torch is the slower of the two processes' imports, so only the later ready time must follow it
        assert max(p["candidate_ready"], p["reference_ready"]) >= p["import_torch"] > 0
        assert p["worker_wait"] >= p["import_torch"]  # asked for, then imported torch, then ready
    assert p["candidate_ready"] > 0 and p["reference_ready"] > 0
    assert "candidate_preload" not in p and "reference_preload" not in p  # only timers need torch._dynamo
    assert p["setup"] >= max(p["candidate_ready"], p["reference_ready"]) - 0.5
    assert p["candidate_forward"] > 0 and p["comparisons"] > 0
    assert 0 < p["comparisons_open"] < p["comparisons"]  # opening the candidate's outputs, inside the comparisons
    assert p["ready"] > 0 and p["spawn"] + p["ready"] <= p["setup"]  # started before the lock was asked for
    # the set-up request split into its wait to be taken up and the worker's work, on one clock with the parent's
    for who in ("candidate", "reference"):
        assert p[f"{who}_setup_work"] > 0 and p[f"{who}_setup_start"] >= 0
        assert p[f"{who}_setup_start"] + p[f"{who}_setup_work"] <= p["setup"] - p["preflight"]
    assert p["candidate_setup_work"] >= p["candidate_model"]  # its steps are inside its work
    assert p["preflight"] > 0 and p["spawn"] >= 0


def test_wrong_values_fail_with_location(cpu_ws):
    r = verify(cpu_ws, "wrong_values")
    assert not r.ok and r.reason == "value_mismatch"
    check = r.trials[-1].outputs[0]
    assert check.mismatched == 64 * 256
    assert check.max_abs_error == pytest.approx(0.5, abs=1e-3)
    assert check.first_mismatch_index == [0, 0]
    assert "differ" in r.message and "atol" in r.message


def test_wrong_shape(cpu_ws):
    r = verify(cpu_ws, "wrong_shape")
    assert not r.ok and r.reason == "shape_mismatch"
    assert "[64, 256]" in r.message and "[64, 255]" in r.message


def test_input_mutation(cpu_ws):
    r = verify(cpu_ws, "mutates_input")
    assert not r.ok and r.reason == "input_mutated"


def test_python_torch_fallback_is_caught(cpu_ws):
    (cpu_ws.root / "model_new.py").write_text(
        "import torch, torch.nn as nn\nimport cuda_extension\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, features):\n        super().__init__()\n        self.bias = nn.Parameter(torch.empty(features))\n"
        "    def forward(self, x):\n        return torch.nn.functional.silu(x) + self.bias\n")
    r = verify_workspace(cpu_ws, FAST)
    assert not r.ok and r.reason == "torch_op_used"
    assert any("aten::silu" in op for op in r.torch_ops)
    assert any("aten::add" in op for op in r.torch_ops)


@pytest.fixture
def aten_inside_ws(cpu_ws, monkeypatch):
    """The multi-variant workspace with a variant that calls the tensor's Python methods from C++: the object scan
    refuses it at compile (tests/test_object_scan.py, tests/exploits/test_python_exploits.py), so it is built here
    with the scans off, to show the op recorder catching it at run time too."""
    from sandbox.scan import symbol_scan

    monkeypatch.setenv(symbol_scan.DISABLE_ENV, "0")
    (cpu_ws.root / "kernels" / "aten_inside.cpp").write_text(
        (FIXTURES / "cpu_multi" / "aten_inside.cpp").read_text())
    assert compile_workspace(cpu_ws).ok
    return cpu_ws


def test_aten_calls_from_cpp_are_caught(aten_inside_ws):
    r = verify(aten_inside_ws, "aten_inside")
    assert not r.ok and r.reason == "torch_op_used"
    assert {"aten::sigmoid", "aten::mul", "aten::add"} <= {op.split(" ")[0] for op in r.torch_ops}


def test_torch_ops_allowed_when_policy_says_so(aten_inside_ws):
    r = verify(aten_inside_ws, "aten_inside", VerifyConfig(trials=1, forbid_torch_ops=False))
    assert r.ok, r.message


def test_the_object_scan_refuses_aten_calls_through_python(cpu_ws):
    (cpu_ws.root / "kernels" / "aten_inside.cpp").write_text((FIXTURES / "cpu_multi" / "aten_inside.cpp").read_text())
    c = compile_workspace(cpu_ws)
    assert not c.ok and c.reason == "forbidden_symbol" and "kernels/aten_inside.cpp" in c.message, c.message


def test_hang_times_out_and_leaves_nothing_running(cpu_ws):
    t0 = time.monotonic()
    r = verify(cpu_ws, "spin_forever", VerifyConfig(trials=1, trial_timeout_s=3))
    assert not r.ok and r.reason == "timeout"
    assert time.monotonic() - t0 < 60
    assert live_descendants() == []


def _second_call(ws, second: str) -> None:
    """ModelNew whose first call is the correct kernel and whose later calls are `second`."""
    (ws.root / "model_new.py").write_text(
        "import cuda_extension\nimport torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, features: int):\n        super().__init__()\n"
        "        self.bias = nn.Parameter(torch.empty(features))\n        self.calls = 0\n\n"
        "    def forward(self, x):\n        self.calls += 1\n"
        "        if self.calls == 1:\n            return cuda_extension.correct(x, self.bias)\n"
        f"        return cuda_extension.{second}(x, self.bias)\n")


def test_a_hang_costs_one_trial_timeout_in_either_call_of_the_repeated_set(cpu_ws):
    # the first input set runs twice; each call is a request of its own with the trial's timeout, so a hang is
    # found after one timeout (before: one reply for both calls, waited for twice as long)
    r = verify(cpu_ws, "spin_forever", VerifyConfig(trials=1, trial_timeout_s=3))
    assert r.reason == "timeout" and "ModelNew.forward on input set 1" in r.message
    assert "within 3 s" in r.message, r.message
    _second_call(cpu_ws, "spin_forever")
    r = verify(cpu_ws, cfg=VerifyConfig(trials=1, trial_timeout_s=3))
    assert r.reason == "timeout" and "ModelNew.forward again on input set 1" in r.message, r.message
    assert "within 3 s" in r.message, r.message
    assert live_descendants() == []


def test_evaluate_takes_the_verify_settings(cpu_ws):
    from sandbox.api import evaluate

    set_variant(cpu_ws.root, "spin_forever")
    c, v, p, r = evaluate(cpu_ws, verify=VerifyConfig(trials=1, trial_timeout_s=3))
    assert c.ok and v.reason == "timeout" and "within 3 s" in v.message, v.message
    assert p is None and r.milestone == "failed"


def test_a_second_call_that_answers_differently_is_nondeterministic(cpu_ws):
    _second_call(cpu_ws, "wrong_values")
    r = verify(cpu_ws)
    assert r.reason == "nondeterministic_output", r.message
    _second_call(cpu_ws, "correct")  # the same kernel both times: the split calls pass
    assert verify(cpu_ws).ok


def test_crash_is_reported_and_the_next_verify_works(cpu_ws):
    r = verify(cpu_ws, "segfault")
    assert not r.ok and r.reason == "crash"
    assert "SIGSEGV" in r.message
    assert verify(cpu_ws, "correct").ok


def test_state_dict_must_match(cpu_ws):
    (cpu_ws.root / "model_new.py").write_text(
        "import torch, torch.nn as nn\nimport cuda_extension\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, features):\n        super().__init__()\n        self.b = nn.Parameter(torch.empty(features))\n"
        "    def forward(self, x):\n        return cuda_extension.correct(x, self.b)\n")
    r = verify_workspace(cpu_ws, FAST)
    assert not r.ok and r.reason == "state_dict_mismatch"
    assert "bias" in r.message


@pytest.mark.parametrize("body, reason", [
    ("def broken(:\n", "import_error"),
    ("import torch.nn as nn\nclass ModelNew(nn.Module):\n    def __init__(self, f):\n        raise RuntimeError('nope')\n",
     "init_error"),
    ("import torch, torch.nn as nn\nimport cuda_extension\nclass ModelNew(nn.Module):\n"
     "    def __init__(self, f):\n        super().__init__()\n        self.bias = nn.Parameter(torch.empty(f))\n"
     "    def forward(self, x):\n        return (cuda_extension.correct(x, self.bias),)\n", "output_structure"),
    ("import torch, torch.nn as nn\nimport cuda_extension\nclass Sub(torch.Tensor):\n    pass\n"
     "class ModelNew(nn.Module):\n"
     "    def __init__(self, f):\n        super().__init__()\n        self.bias = nn.Parameter(torch.empty(f))\n"
     "    def forward(self, x):\n        return cuda_extension.correct(x, self.bias).as_subclass(Sub)\n", "output_type"),
    ("import torch.nn as nn\nclass ModelNew(nn.Module):\n    def __init__(self, f):\n        super().__init__()\n"
     "    def forward(self, x):\n        raise ValueError('bad forward')\n", "state_dict_mismatch"),
])
def test_candidate_failures_have_reasons(cpu_ws, body, reason):
    (cpu_ws.root / "model_new.py").write_text(body)
    r = verify_workspace(cpu_ws, FAST)
    assert not r.ok and r.reason == reason, r.message


def test_runtime_error_in_forward(cpu_ws):
    (cpu_ws.root / "model_new.py").write_text(
        "import torch, torch.nn as nn\nimport cuda_extension\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, f):\n        super().__init__()\n        self.bias = nn.Parameter(torch.empty(f))\n"
        "    def forward(self, x):\n        return cuda_extension.correct(x.t(), self.bias)\n")
    r = verify_workspace(cpu_ws, FAST)
    assert not r.ok and r.reason == "runtime_error"
    assert "contiguous float32" in r.message


def test_missing_or_stale_build(tmp_path, small_task_path, cpu_ws):
    ws = Workspace.create(load_task(str(small_task_path)), tmp_path / "fresh", backend="cpu")
    r = verify_workspace(ws)
    assert not r.ok and r.reason == "not_compiled"
    time.sleep(0.01)
    src = cpu_ws.root / "kernels" / "variants.cpp"
    src.write_text(src.read_text() + "\n// edited\n")
    r = verify_workspace(cpu_ws)
    assert not r.ok and r.reason == "not_compiled" and "changed" in r.message


def test_undefined_symbol_is_an_import_error(cpu_ws):
    cpu_ws.write_text("kernels/missing_binding.cpp",
                      '#include "binding_registry.h"\nvoid launch_missing(float*);\n'
                      "static void call(at::Tensor x) { launch_missing(x.data_ptr<float>()); }\n"
                      'static void reg(pybind11::module& m) { m.def("call_missing", &call); }\n'
                      "REGISTER_BINDING(missing, reg);\n")
    assert compile_workspace(cpu_ws).ok
    r = verify_workspace(cpu_ws, FAST)
    assert not r.ok and r.reason == "import_error"
    assert "launch_missing" in r.message


def test_warm_pool_hands_out_fresh_processes(cpu_ws):
    from sandbox.confinement.processes import disable_warm_pool, enable_warm_pool

    def idle_pids() -> set[int]:
        return {w.proc.pid for ws in pool.idle.values() for w in ws}

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] != "Z"
        except OSError:
            return False

    pool = enable_warm_pool(2)
    try:
        set_variant(cpu_ws.root, "correct")
        assert verify_workspace(cpu_ws, FAST).ok  # fills the pool
        before = idle_pids()
        assert len(before) == 2 and all(alive(p) for p in before)
        # a crash must not poison the pool, and a used process is never reused
        set_variant(cpu_ws.root, "segfault")
        assert verify_workspace(cpu_ws, FAST).reason == "crash"
        from sandbox.confinement.reaper import REAPER

        assert REAPER.drain(60)  # a finished operation's workers die in the background (confinement/reaper.py)
        used = before - idle_pids()
        assert len(used) == 2 and not any(alive(p) for p in used)
        set_variant(cpu_ws.root, "correct")
        r = verify_workspace(cpu_ws, FAST)
        assert r.ok, r.message
        # a pooled worker started before it knew its role is confined and limited all the same
        from sandbox.confinement.filesystem import abi_version

        assert any("seccomp refuses new processes" in n for n in r.sandbox_notes), r.sandbox_notes
        if abi_version() >= 1:
            assert any("landlock ABI" in n and "reads confined" in n for n in r.sandbox_notes), r.sandbox_notes
    finally:
        disable_warm_pool()
    assert live_descendants() == []


def test_single_use_pool_starts_no_replacements(cpu_ws):
    """The MCP helper's pool: prefilled workers serve its one operation, and none are started behind them."""
    from sandbox.confinement.processes import disable_warm_pool, enable_warm_pool

    pool = enable_warm_pool(2, refill=False)
    try:
        pool.prefill("cpu")
        prefilled = {w.proc.pid for ws in pool.idle.values() for w in ws}
        assert len(prefilled) == 2
        set_variant(cpu_ws.root, "correct")
        r = verify_workspace(cpu_ws, FAST)
        assert r.ok, r.message
        assert all(ws == [] for ws in pool.idle.values()), "no replacement workers for a single-use pool"
        assert not (prefilled & set(live_descendants()))  # both were used, and killed afterwards
    finally:
        disable_warm_pool()
    assert live_descendants() == []


def test_worker_environment_carries_no_secrets(monkeypatch):
    from sandbox.confinement.environment import worker_env

    monkeypatch.setenv("CUDA_AGENT_MCP_TOKEN", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    monkeypatch.setenv("CUDA_AGENT_CACHE", "/tmp/c")
    env = worker_env()
    assert "CUDA_AGENT_MCP_TOKEN" not in env and "OPENAI_API_KEY" not in env
    assert env["CUDA_AGENT_CACHE"] == "/tmp/c"


def test_workers_get_the_device_connections_the_judge_is_set_to(monkeypatch):
    from sandbox.confinement import daemon
    from sandbox.confinement.environment import worker_env

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # the user's own: never the workers'
    monkeypatch.delenv("CUDA_AGENT_DEVICE_CONNECTIONS", raising=False)
    default = worker_env()
    assert default["CUDA_DEVICE_MAX_CONNECTIONS"] == "2"
    monkeypatch.setenv("CUDA_AGENT_DEVICE_CONNECTIONS", "0")  # CUDA's own default
    cuda_default = worker_env()
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in cuda_default
    monkeypatch.setenv("CUDA_AGENT_DEVICE_CONNECTIONS", "8")
    assert worker_env()["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert daemon.key(cuda_default) != daemon.key(default)  # a template started otherwise is not forked from


def test_a_pooled_worker_serves_only_operations_under_the_limits_it_started_with(monkeypatch):
    """A worker takes its resource limits at its start: one prefilled under the default limits must not run a
    candidate that an operation asked to run under others (on the H200 a memory bomb under a 4 GiB limit ran in a
    pooled worker started with the default one, and was not stopped)."""
    from sandbox.confinement.processes import Session, disable_warm_pool, enable_warm_pool

    pool = enable_warm_pool(1, refill=False)
    try:
        pool.prefill("cpu")
        prefilled = {w.proc.pid for ws in pool.idle.values() for w in ws}
        assert len(prefilled) == 1
        monkeypatch.setenv("CUDA_AGENT_LIMIT_DATA_MB", "2048")
        with Session("cpu") as s:
            w = s.spawn("candidate")
            assert w.proc.pid not in prefilled
        monkeypatch.delenv("CUDA_AGENT_LIMIT_DATA_MB")
        with Session("cpu") as s:
            assert s.spawn("candidate").proc.pid in prefilled  # under its own limits it is served
    finally:
        disable_warm_pool()
