"""GPU tests (marker gpu): run on the device machine, skipped where no GPU is visible."""

import os
import shutil
import time

import pytest

from conftest import FIXTURES, model_new_calling, set_variant
from sandbox.api import compile_workspace, init_workspace, profile_workspace, verify_workspace
from sandbox.build import link_stubs
from sandbox.build.infra_cache import link_stub_folder
from sandbox.build.toolchain import get_toolchain
from sandbox.config import ProfileConfig, VerifyConfig
from sandbox.correctness.selfcheck import self_verify
from sandbox.scan.elf_exports import needed_libraries
from sandbox.timing import memory_admission
from tasks import load_task
from tasks.loader import EXAMPLES_DIR

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_multi(tmp_path_factory, small_task_path):
    ws, _ = init_workspace(str(small_task_path), tmp_path_factory.mktemp("cuda") / "ws", backend="cuda")
    shutil.copytree(FIXTURES / "cuda_multi" / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    set_variant(ws.root, "correct")
    r = compile_workspace(ws)
    assert r.ok, r.log_tail
    return ws


def test_example_solution_compiles_verifies_profiles(tmp_path):
    ws, _ = init_workspace("example/swish_bias", tmp_path / "ws", backend="cuda")
    shutil.copytree(EXAMPLES_DIR / "solutions" / "swish_bias" / "cuda", ws.root, dirs_exist_ok=True)
    c = compile_workspace(ws)
    assert c.ok, c.log_tail
    stubs = link_stub_folder(get_toolchain("cuda"))
    if stubs is not None:  # linked against the stand-ins of torch's CUDA libraries, loaded from the real ones
        assert {"torch_cuda", "c10_cuda", "cudart"} <= set((stubs / link_stubs.DONE).read_text().split())
        assert f"-L{stubs}" in (ws.build_dir / "build.ninja").read_text()
        found = needed_libraries(ws.build_dir / "cuda_extension.so")
        assert any(p.name.startswith("libtorch_cuda") for p in found) and not [p for p in found if stubs in p.parents]
    v = verify_workspace(ws)
    assert v.ok, v.message
    assert v.device and "H" in v.device
    # a new reference process loads the comparison's kernels after its set-up's reply (a kept one did in its first)
    assert ("reference_compare_warm" in v.phases) == (v.phases["reference_kept"] == 0), v.phases
    p = profile_workspace(ws)
    assert p.ok, p.message
    assert p.candidate.median_ms > 0 and p.eager.median_ms > 0 and p.compiled is not None
    assert any("swish_bias" in k.name for k in p.top_kernels), p.top_kernels
    # where the timing's end went (the profiler's exit, the clock checks, the kernel audit, the spot copies)
    assert {"end_profiler_s", "end_clocks_s", "end_audit_s", "end_spots_s", "eager_end_profiler_s"} <= p.checks.keys(), \
        p.checks
    # the kernel audits ran once the device was let go (the top kernels came from the candidate's)
    assert p.phases.get("audit", 0) > 0 and p.checks["audit_canary_launches"] > 0, p.phases
    # the batches' wall times were read by the judge's clock process, held to the timing's core with both sides
    assert p.checks["judge_clock"] == "process" and p.timing_core is not None, (p.checks, p.timing_core)
    print(f"\nexample: candidate {p.candidate.median_ms:.4f} ms, eager {p.eager.median_ms:.4f} ms "
          f"({p.speedup_vs_eager:.2f}x), compile {p.compiled.median_ms:.4f} ms ({p.speedup_vs_compile:.2f}x)")


def test_spot_copies_past_the_device_budget_wait_in_host_memory(cuda_multi):
    """Large outputs (KernelBench's 19_ReLU: 6 GiB a call) keep their spot copies in host memory between batches
    and come back to the device one at a time to be checked; a budget of 0 sends every copy that way."""
    set_variant(cuda_multi.root, "correct")
    assert verify_workspace(cuda_multi, VerifyConfig(trials=1)).ok
    p = profile_workspace(cuda_multi, ProfileConfig(spot_device_bytes=0, spot_device_room=False, top_kernels=0))
    assert p.ok, (p.reason, p.message)
    assert p.checks["spots_on_host"] == p.checks["spot_checks"] >= 1, p.checks
    assert p.checks["spot_device_bytes"] == 0 and p.checks["spots_checked_exclusive"] is False, p.checks


def test_under_memory_admission_spot_copies_stay_within_the_footprints_allowance(cuda_multi):
    """Admitted for its footprint (the default on CUDA), a profile keeps its copies on the device up to the allowance
    the footprint counted for them (at least one copy of the outputs), past spot_device_bytes, and checks them beside
    other judgments: the memory was admitted, no one else's spare room."""
    set_variant(cuda_multi.root, "correct")
    assert verify_workspace(cuda_multi, VerifyConfig(trials=1)).ok  # the footprint measured
    p = profile_workspace(cuda_multi, ProfileConfig(spot_device_bytes=0, top_kernels=0))
    assert p.ok, (p.reason, p.message)
    assert p.checks["spots_on_host"] == 0 and p.checks["spot_checks"] >= 1, p.checks
    assert p.checks["spot_device_bytes"] > 0 and p.checks["spots_checked_exclusive"] is False, p.checks


def test_spot_copies_stay_on_a_device_with_room_and_are_checked_before_the_lock_steps_down(cuda_multi, monkeypatch):
    """Past the fixed budget, copies stay on a device with room to spare instead of a trip through host memory
    (5.2 s out for 19_ReLU's 6 GiB), and are then checked while the timing still holds the device alone (without a
    memory admission, where the room is the device's)."""
    monkeypatch.setenv(memory_admission.SWITCH_ENV, "0")
    set_variant(cuda_multi.root, "correct")
    p = profile_workspace(cuda_multi, ProfileConfig(spot_device_bytes=0, top_kernels=0))
    assert p.ok, (p.reason, p.message)
    assert p.checks["spots_on_host"] == 0 and p.checks["spot_checks"] >= 1, p.checks
    assert p.checks["spot_device_bytes"] > 0 and p.checks["spots_checked_exclusive"] is True, p.checks
    assert p.checks["spot_device_room"] > 0, p.checks  # the least room a batch was offered, reported
    # a kernel right in verify's few calls and wrong from its 13th call in a process is still caught from a copy
    # kept this way (the timer's own process counts from its first warm-up call)
    (cuda_multi.root / "model_new.py").write_text(_WRONG_AFTER_12)
    try:
        p = profile_workspace(cuda_multi, ProfileConfig(spot_device_bytes=0, top_kernels=0))
    finally:
        set_variant(cuda_multi.root, "correct")
    assert not p.ok and p.reason == "spot_check_failed", (p.reason, p.message)


_WRONG_AFTER_12 = model_new_calling("""\
    self.calls += 1
    if self.calls <= 12:
        return cuda_extension.correct(x, self.bias)
    return cuda_extension.wrong_values(x, self.bias)
    """)


def test_wrong_kernel_fails_with_reason(cuda_multi):
    set_variant(cuda_multi.root, "wrong_values")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert not r.ok and r.reason == "value_mismatch"
    assert r.trials[-1].outputs[0].max_abs_error == pytest.approx(0.25, abs=1e-3)


def test_illegal_address_is_reported_and_the_next_call_works(cuda_multi):
    set_variant(cuda_multi.root, "illegal_address")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert not r.ok and r.reason in ("cuda_error", "crash"), r.message
    assert "illegal" in r.message.lower() or "CUDA" in r.message
    set_variant(cuda_multi.root, "correct")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert r.ok, r.message


def test_hanging_kernel_times_out(cuda_multi):
    set_variant(cuda_multi.root, "spin_forever")
    t0 = time.monotonic()
    r = verify_workspace(cuda_multi, VerifyConfig(trials=1, trial_timeout_s=5))
    assert not r.ok and r.reason == "timeout"
    assert time.monotonic() - t0 < 90
    set_variant(cuda_multi.root, "correct")
    assert verify_workspace(cuda_multi, VerifyConfig(trials=1)).ok


def test_incremental_rebuild_after_editing_one_cu(cuda_multi):
    assert compile_workspace(cuda_multi).up_to_date
    cu = cuda_multi.root / "kernels" / "variants.cu"
    cu.write_text(cu.read_text() + "\n// touched\n")
    r = compile_workspace(cuda_multi)
    assert r.ok and r.rebuilt == ["kernels/variants.cu"], r.log_tail
    print(f"\nrebuild after editing one .cu: {r.duration_s:.2f} s")


def test_profile_cached_baseline(cuda_multi):
    set_variant(cuda_multi.root, "correct")
    cfg = ProfileConfig(target_ms=200)
    first = profile_workspace(cuda_multi, cfg)
    second = profile_workspace(cuda_multi, cfg)
    # each verdict's own message: one run of the GPU suite failed here once, and the bare assertion kept no reason
    assert first.ok, (first.reason, first.message)
    assert second.ok, (second.reason, second.message)
    assert second.baseline_cached
    print(f"\nprofile: first {first.duration_s:.1f} s, cached baseline {second.duration_s:.1f} s")


@pytest.mark.parametrize("task", ["kernelbench/level1/19_ReLU", "kernelbench/level1/95_CrossEntropyLoss",
                                  "kernelbench/level2/66_Matmul_Dropout_Softmax",
                                  "kernelbench/level3/1_MLP"])
def test_kernelbench_references_pass_against_themselves(task, real_kernelbench):
    t = load_task(task)
    r = self_verify(t, "cuda", trials=1)
    assert r.ok or r.reason == "nondeterministic_reference", r.message


def test_profile_reduce_overhead_baseline(tmp_path):
    """CUDA graphs (torch.compile mode reduce-overhead) as the baseline: its own cached baseline, reported. On the
    demo's large task (eager about 1.6 ms on the H100): the small test task is launch-bound, and there launch
    latency alone moved eager's paired rounds 2x apart in three profiles out of three on the H100, which the judge
    rightly refuses to score (timing_noisy); that is not what this test is about."""
    from sandbox import present

    ws, _ = init_workspace("example/swish_bias_large", tmp_path / "ws", backend="cuda")
    shutil.copytree(EXAMPLES_DIR / "solutions" / "swish_bias" / "cuda", ws.root, dirs_exist_ok=True)
    assert compile_workspace(ws).ok
    graphs = profile_workspace(ws, ProfileConfig(target_ms=100, compile_mode="reduce-overhead"))
    assert graphs.ok, graphs.message
    assert graphs.compiled is not None, graphs.compile_error
    assert graphs.compile_mode == "reduce-overhead" and "reduce-overhead" in present.profile_text(graphs)
    assert graphs.speedup_vs_compile_range is not None and graphs.launch_bound is False
    default = profile_workspace(ws, ProfileConfig(target_ms=100))
    assert default.ok and default.compiled is not None, default.message
    print(f"\ntorch.compile baseline: default {default.compiled.median_ms:.4g} ms (IQR {default.compiled.iqr_ms:.2g}), "
          f"reduce-overhead {graphs.compiled.median_ms:.4g} ms (IQR {graphs.compiled.iqr_ms:.2g}); "
          f"eager {default.eager.median_ms:.4g} ms; launch-bound {default.launch_bound}")


def test_a_ready_cuda_worker_keeps_off_the_timing_cores(tmp_path):
    # a pooled worker opens the device before any role is asked of it; from then on none of its threads (CUDA's
    # own included) may run on a GPU's timing core, where a timing's host path is measured
    from sandbox.confinement.processes import Worker
    from sandbox.timing import cores

    w = Worker("idle:cuda", tmp_path)
    try:
        assert w.request("become", 120.0, "starting a worker", role="check").get("ok")
        seen = {open(f"/proc/{w.proc.pid}/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0]
                for t in os.listdir(f"/proc/{w.proc.pid}/task")}
    finally:
        w.kill()
    expected = cores.build_cores()
    if expected is None:
        pytest.skip("this host leaves builds fewer than two cores: nothing is reserved for timings")
    allowed = sorted(os.sched_getaffinity(0))
    parsed = set()
    for text in seen:
        cpus = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        parsed.add(frozenset(cpus))
    assert parsed == {frozenset(expected)}, (seen, expected)
    assert cores.core_for("0", allowed) not in expected


def test_a_gated_pool_opens_cuda_only_where_no_timing_runs(tmp_path, monkeypatch):
    # a pooled worker's CUDA context created beside a timing stalled the timing's batches for seconds: the pool's
    # opener creates them under the device's shared lock. During a timing its workers wait unopened; after it
    # they open, keep off the timing cores like any CUDA worker, and serve a role
    from sandbox.confinement.processes import Worker
    from sandbox.confinement.warm_pool import WarmPool
    from sandbox.timing import cores
    from sandbox.timing.device_lock import timing_hold

    monkeypatch.setenv("CUDA_AGENT_LOCK_DIR", str(tmp_path / "locks"))

    pool = WarmPool(2, refill=False, worker=Worker)
    key = pool._key("cuda")
    try:
        with timing_hold("cuda"):
            pool.prefill("cuda")
            time.sleep(3.0)
            assert [pool.state[id(w)] for w in pool.idle[key]] == ["pending", "pending"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(pool.state.get(id(w)) != "open" for w in pool.idle[key]):
            time.sleep(0.05)
        assert [pool.state[id(w)] for w in pool.idle[key]] == ["open", "open"]
        w = pool.take("check", "cuda")
        assert w is not None and w.role == "check"
        allowed = {frozenset(int(c) for c in _cpu_list(open(f"/proc/{w.proc.pid}/task/{t}/status").read()
                                                          .split("Cpus_allowed_list:")[1].split()[0]))
                   for t in os.listdir(f"/proc/{w.proc.pid}/task")}
        w.kill()
    finally:
        pool.close()
    expected = cores.build_cores()
    if expected is not None:
        assert allowed == {frozenset(expected)}, (allowed, expected)


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_a_cuda_build_runs_beside_a_timing_only_off_the_timing_cores(cuda_multi):
    # a small kernel's time on the GPU is mostly the host's launch latency, so builds (nvcc on every core)
    # must not share a core with a timing; a timing beside eleven unplaced builds failed timing_unverified
    # (docs/judge.md). Where the host has cores to spare, builds run on the others; elsewhere they wait.
    from test_device_lock import _hold_in_thread

    from sandbox.build.compile import build_placement

    t0 = time.perf_counter()
    assert compile_workspace(cuda_multi).ok  # up to date: ninja has nothing to do
    quick = time.perf_counter() - t0
    cpus, _ = build_placement("cuda")
    th, _ = _hold_in_thread("cuda", exclusive=True, hold_s=quick + 3.0)  # a profile times on the GPU
    c = compile_workspace(cuda_multi)
    th.join()
    if cpus is None:
        assert c.ok and c.duration_s > quick + 2.0, (quick, c.duration_s)
    else:
        from sandbox.timing import cores

        allowed = sorted(os.sched_getaffinity(0))
        assert cores.core_for("0", allowed) not in cpus
        assert c.ok and c.duration_s < quick + 2.0, (quick, c.duration_s)


def test_the_audits_raw_device_table_is_key_averages_device_rows():
    """kernel_audit.table counts a CUDA session's device events from the raw results instead of key_averages():
    the same names (demangled), launches and device time, or the canary's calibrated names would not match."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sandbox.worker import kernel_audit

    x = torch.randn(512, 512, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(40):
            y = torch.tanh(torch.relu(x) * 2.0).sum(dim=-1)
        y.cpu()  # a device-to-host copy: the audit's host_round_trip row
        torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
    raw, averaged = kernel_audit.table(prof), kernel_audit._averaged(prof)
    avg = {n: (c, t) for n, c, t in averaged}
    assert any(n.startswith(kernel_audit.HOST_COPY) for n, _, _ in raw), raw
    assert sum(1 for n, _, _ in raw if any(f in n for f in kernel_audit.FOREIGN)) >= 3, raw
    for name, count, total in raw:
        assert name in avg and avg[name][0] == count, (name, count, avg.get(name))
        assert total == pytest.approx(avg[name][1], rel=0.01, abs=1.0), name
    assert {n for n, _, t in averaged if t > 0} <= {n for n, _, _ in raw}


def test_a_task_process_is_kept_across_judgments_and_past_a_candidates_fault(cuda_multi):
    """On CUDA a process that judges repeatedly keeps the task's side of a judgment (sandbox/confinement/kept.py):
    the profile takes the process its verify gave back, and after a candidate's illegal memory access in its own
    process, the kept one still judges a wrong kernel wrong and a right one right."""
    from sandbox.confinement import kept
    from sandbox.confinement.reaper import REAPER

    def idle() -> set[int]:
        assert REAPER.drain(60)
        return {w.proc.pid for ws in kept.KEEPER.idle.values() for _, w in ws}

    def warmed_once(r) -> None:
        # a new task process loads the comparison's kernels after its set-up's reply (compare.warm), a kept one
        # did so in its first judgment
        assert ("reference_compare_warm" in r.phases) == (r.phases["reference_kept"] == 0), r.phases

    set_variant(cuda_multi.root, "correct")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=1))
    assert r.ok, r.message
    warmed_once(r)
    assert idle()
    p = profile_workspace(cuda_multi, ProfileConfig(top_kernels=0))
    assert p.ok and p.phases["eager_kept"] == 1, (p.message, p.phases)
    assert idle(), f"{kept.KEEPER.retired} {kept.KEEPER.last_park}"  # given back after its profile too
    set_variant(cuda_multi.root, "illegal_address")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert not r.ok and r.reason in ("cuda_error", "crash"), r.message
    assert r.phases["reference_kept"] == 1, f"{kept.KEEPER.retired} {kept.KEEPER.last_park}"
    set_variant(cuda_multi.root, "wrong_values")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert r.reason == "value_mismatch" and r.phases["reference_kept"] == 1, r.message
    warmed_once(r)
    set_variant(cuda_multi.root, "correct")
    r = verify_workspace(cuda_multi, VerifyConfig(trials=2))
    assert r.ok and r.phases["reference_kept"] == 1, r.message
    warmed_once(r)
    p = profile_workspace(cuda_multi, ProfileConfig(top_kernels=0))
    assert p.ok and p.phases["eager_kept"] == 1, (p.message, p.phases)
    print(f"\nkept task processes: {kept.KEEPER.counts}, idle now {len(idle())}")


def test_one_judgment_verifies_and_times_a_cuda_candidate_in_one_process(cuda_multi, monkeypatch):
    """sandbox.api.judge_workspace on CUDA: the verify's candidate process (the judged role) is the one timed, with
    both audits (the op audit in the verify, the kernel audit in the timing) calibrated in its set-up; the spot
    checks still catch a candidate that turns wrong after its verify's calls; a fault ends the judgment at verify and
    the next judgment is right."""
    from sandbox.api import judge_workspace
    from sandbox.confinement.processes import Session

    roles: list[str] = []
    real = Session.spawn

    def spawn(self, role, *args, **kwargs):
        if role != "baseline":
            roles.append(role)
        return real(self, role, *args, **kwargs)

    monkeypatch.setattr(Session, "spawn", spawn)
    set_variant(cuda_multi.root, "correct")
    v, p = judge_workspace(cuda_multi, VerifyConfig(trials=2), ProfileConfig(top_kernels=3))
    assert v.ok and p is not None and p.ok, (v.message, p and p.message)
    assert roles == ["eager", "judged"] and p.phases["candidate_carried"] == 1, (roles, p.phases)
    assert p.checks["audit_canary_launches"] > 0 and p.top_kernels, p.checks
    first = (p.speedup_vs_eager, p.candidate.median_ms, p.eager.median_ms)
    (cuda_multi.root / "model_new.py").write_text(_WRONG_AFTER_12)  # right for the verify's calls only
    v, p = judge_workspace(cuda_multi, VerifyConfig(trials=2), ProfileConfig(top_kernels=0))
    assert v.ok and p is not None and p.reason == "spot_check_failed", (v.message, p and p.message)
    set_variant(cuda_multi.root, "illegal_address")
    v, p = judge_workspace(cuda_multi, VerifyConfig(trials=2), ProfileConfig(top_kernels=0))
    assert not v.ok and v.reason in ("cuda_error", "crash") and p is None, v.message
    set_variant(cuda_multi.root, "correct")
    v, p = judge_workspace(cuda_multi, VerifyConfig(trials=2), ProfileConfig(top_kernels=0))
    assert v.ok and p is not None and p.ok and p.phases["candidate_carried"] == 1, (v.message, p and p.message)
    print(f"\none judgment: {first[0]:.2f}x ({first[1]:.4f} ms vs eager {first[2]:.4f} ms); again "
          f"{p.speedup_vs_eager:.2f}x; verify {v.duration_s:.2f} s, profile {p.duration_s:.2f} s, phases {p.phases}")
