"""The CUDA kernel audit's logic and its canary, on the CPU: synthetic profiler tables, and the whole
canary (calibration, launches, audit, settling) through torch's real CPU profiler, with the foreign
list pointed at ATen's CPU op names. The CUDA run is in tests/exploits/test_gpu_forgery.py."""

from __future__ import annotations

import collections
import random
import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sandbox.results import INTEGRITY_REASONS, Reason
from sandbox.worker import guards, kernel_audit
from sandbox.worker.kernel_audit import AuditTampered, audit, per_call, rows, settle
from sandbox.worker.protocol import Reply

RELU = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar"
        "(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)>")
NEG = "void at::native::vectorized_elementwise_kernel<4, at::native::neg_kernel_cuda(at::TensorIteratorBase&)>"
RAND = "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4>"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>"
MINE = "relu_k(float const*, float*, long)"
TRITON = "triton_poi_fused_relu_0"


def table(*events):
    return [(name, count, float(us)) for name, count, us in events]


def test_audit_refuses_aten_and_triton_but_not_input_drawing_fills_or_the_candidate():
    kept, foreign = audit(table((MINE, 100, 900), (RELU, 3, 30), (TRITON, 2, 10), (RAND, 50, 400),
                                (FILL, 100, 200), ("Memcpy DtoD (Device -> Device)", 5, 5)), allowed={RAND})
    assert foreign == {RELU: 3, TRITON: 2}
    assert [k[0] for k in kept] == [MINE, RELU, TRITON, "Memcpy DtoD (Device -> Device)"]


def test_settle_takes_out_the_canary_and_leaves_the_candidates_launches():
    foreign = collections.Counter({NEG: 4, RELU: 7})
    assert settle(foreign, collections.Counter({NEG: 4, RELU: 2})) == {RELU: 5}
    assert settle(foreign, collections.Counter({NEG: 4, RELU: 7})) == {}
    assert settle(collections.Counter(), collections.Counter()) == {}


@pytest.mark.parametrize("found", [{}, {NEG: 3, RELU: 9}, {RELU: 9}])
def test_settle_refuses_when_the_audit_misses_canary_launches(found):
    with pytest.raises(AuditTampered, match="missed"):
        settle(collections.Counter(found), collections.Counter({NEG: 4, RELU: 2}))


def test_per_call_needs_counts_that_divide_evenly_and_uses_the_audits_classification():
    assert per_call(table((NEG, 4, 8), (FILL, 2, 1), (MINE, 3, 1)), 2, excluded=()) == {NEG: 2}
    assert per_call(table((NEG, 3, 8)), 2, excluded=()) is None
    assert per_call(table((NEG, 4, 8)), 2, excluded={NEG}) == {}


def test_rows_leave_out_the_canary_and_are_per_call():
    kept = [(MINE, 200, 2000.0), (NEG, 3, 30.0), ("cudaLaunchKernel", 200, 0.0)]
    out = rows(kept, trials=100, skip={NEG})
    assert [r["name"] for r in out] == [MINE]
    assert out[0]["total_ms"] == pytest.approx(0.02) and out[0]["calls"] == 2 and out[0]["percent"] == 100.0


class Relu(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


@pytest.fixture
def cpu_ops(monkeypatch):
    """On the CPU the profiler's rows are ATen ops; call those foreign so the canary has something to see."""
    monkeypatch.setattr(kernel_audit, "FOREIGN", ("aten::",))


def _plan(excluded=(), reference=True, seed=5):
    x = torch.randn(64, 32)
    return kernel_audit.plan("cpu", Relu() if reference else None, [x], excluded, lambda: None,
                             activities=[ProfilerActivity.CPU], rng=random.Random(seed))


def _timed_run(canary, delegate: bool):
    """A profiled region like the timer's: canary launches between 'batches', the candidate's calls inside."""
    x = torch.randn(128, 16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run = canary.start()
        run.launch()
        for _ in range(3):
            for _ in range(5):
                torch.relu(x) if delegate else x.numel()  # the honest stand-in dispatches no ATen op
            run.launch()
        run.launch(final=True)
    return run, kernel_audit.table(prof)


def test_calibration_records_what_each_probe_and_the_reference_forward_launch(cpu_ops):
    canary = _plan()
    assert len(canary.probes) == kernel_audit.PROBE_OPS
    for p in canary.probes:
        assert p.kernels == {f"aten::{p.name.split()[0]}": 1}, p
    assert canary.reference.kernels == {"aten::relu": 1, "aten::clamp_min": 1}


def test_calibration_drops_kernels_that_input_drawing_launches(cpu_ops):
    everything = {f"aten::{op}" for op in kernel_audit._OPS} | {"aten::relu"}
    canary = _plan(excluded=everything)
    assert canary.probes == []
    assert canary.reference.kernels == {"aten::clamp_min": 1}


@pytest.mark.parametrize("seed", range(4))
def test_an_honest_run_settles_to_nothing_and_delegation_is_left_over(cpu_ops, seed):
    canary = _plan(seed=seed)
    run, events = _timed_run(canary, delegate=False)
    assert run.launches >= 1 and run.reference_ran
    _, foreign = audit(events, ())
    assert settle(foreign, run.expected) == {}
    run, events = _timed_run(canary, delegate=True)
    _, foreign = audit(events, ())
    assert settle(foreign, run.expected) == {"aten::relu": 15, "aten::clamp_min": 15}


def test_an_emptied_foreign_list_misses_the_canary(cpu_ops, monkeypatch):
    canary = _plan()
    run, events = _timed_run(canary, delegate=True)
    monkeypatch.setattr(kernel_audit, "FOREIGN", ())
    _, foreign = audit(events, ())
    with pytest.raises(AuditTampered):
        settle(foreign, run.expected)


def test_an_allow_everything_set_misses_the_canary(cpu_ops):
    class Everything(set):
        def __contains__(self, name):
            return True

    run, events = _timed_run(_plan(), delegate=True)
    _, foreign = audit(events, Everything())
    with pytest.raises(AuditTampered):
        settle(foreign, run.expected)


def test_filtering_just_the_tasks_own_op_misses_the_reference_forward(cpu_ops):
    """A patch that hides only the kernels the candidate delegates (the task's op) passes the fixed
    probes; the reference forward, calibrated before the patch, launches those very kernels."""
    run, events = _timed_run(_plan(), delegate=True)
    _, foreign = audit(events, ())
    for name in ("aten::relu", "aten::clamp_min"):
        del foreign[name]
    with pytest.raises(AuditTampered, match="relu|clamp_min"):
        settle(foreign, run.expected)


def _kernel_table(prof, allowed):  # what TimerRole._kernel_table does (the timer module cannot be imported here)
    return audit(kernel_audit.table(prof), allowed)


def _verdict(canary, delegate: bool, kernel_table=_kernel_table):
    """The timer's verdict code (kernel_audit.verdict, as TimerRole._end calls it) on a CPU profile."""
    x = torch.randn(128, 16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run = canary.start()
        run.launch()
        for _ in range(10):
            x.view(-1) if not delegate else torch.relu(x)
        run.launch(final=True)
    checks: dict = {}
    return kernel_audit.verdict(kernel_table, prof, {"aten::view"}, run, 10, checks), checks, run


def test_the_verdict_passes_an_honest_run_and_hides_the_canary(cpu_ops):
    rows, checks, run = _verdict(_plan(), delegate=False)
    assert checks == {"audit_canary_launches": sum(run.expected.values())}
    assert checks["audit_canary_launches"] >= 3  # the reference forward's two ops and at least one probe
    assert not any(r["name"] in run.expected for r in rows)


def test_the_verdict_refuses_delegation_as_torch_ops(cpu_ops):
    with pytest.raises(Reply) as e:
        _verdict(_plan(), delegate=True)
    assert e.value.reason == "torch_op_used" and "aten::relu (10x)" in e.value.message


@pytest.mark.parametrize("patch", ["names", "table", "broken"])
def test_the_verdict_refuses_a_patched_audit(cpu_ops, patch, monkeypatch):
    """Emptied names, a table without foreign kernels, and a table that breaks the judge's code (an
    innocent-looking runtime error would keep the 'correct' milestone) are all audit_tampered."""
    canary = _plan()  # calibrated before the candidate's code (and its patch) runs
    table = _kernel_table
    if patch == "names":
        monkeypatch.setattr(kernel_audit, "FOREIGN", ())
    elif patch == "table":
        def table(prof, allowed):
            return _kernel_table(prof, allowed)[0], collections.Counter()
    else:
        def table(prof, allowed):
            return None
    with pytest.raises(Reply) as e:
        _verdict(canary, delegate=True, kernel_table=table)
    assert e.value.reason == "audit_tampered", e.value.message
    assert Reason.audit_tampered in INTEGRITY_REASONS


def test_call_counter_canary_passes_untouched_and_forgets_its_probe():
    mod = types.ModuleType("ext")
    mod.relu = lambda x: x
    counter = guards.CallCounter(mod)
    mod.relu(1)
    assert counter.canary() and counter.canary()
    assert counter.total == 1 and counter.calls == {"relu": 1, guards.CallCounter.PROBE: 0}


@pytest.mark.parametrize("patch", ["fixed_total", "ticking_total", "deaf_dict"])
def test_call_counter_canary_catches_a_counter_that_stopped_counting(patch, monkeypatch):
    mod = types.ModuleType("ext")
    mod.relu = lambda x: x
    counter = guards.CallCounter(mod)
    if patch == "fixed_total":
        monkeypatch.setattr(guards.CallCounter, "total", property(lambda self: 1 << 40))
    elif patch == "ticking_total":  # rises on every read, so every forward looks like it called the extension
        ticks = iter(range(1 << 30))
        monkeypatch.setattr(guards.CallCounter, "total", property(lambda self: next(ticks)))
    else:
        class Deaf(dict):
            def __setitem__(self, key, value):
                pass

        counter.calls = Deaf()
    assert not counter.canary()


def test_the_judges_own_host_copies_are_taken_out_and_one_more_is_refused():
    """The timer moves large spot copies to host memory between batches, inside the audited region: those copies
    (counted by the timer) are not the candidate's, and a single device-to-host copy past them still is."""
    from sandbox.worker.protocol import Reply

    events = [("Memcpy DtoH (Device -> Pageable)", 3, 9000.0), ("relu_kernel", 40, 120.0)]
    kernel_audit.refuse_host_copies(events, "the timed calls", own=3)
    with pytest.raises(Reply, match="copied device memory to the host"):
        kernel_audit.refuse_host_copies(events, "the timed calls", own=2)
    with pytest.raises(Reply, match="host_round_trip|copied device memory"):
        kernel_audit.refuse_host_copies(events, "the timed calls")


def test_with_the_extensions_own_kernels_library_kernels_are_foreign():
    """Judge IX: the profile's audit knows cuBLAS's, cuDNN's and other libraries' kernels as foreign, as verify's
    op audit does, once it is given the identifiers the extension defines (symbol_scan.own_kernels); copies,
    fills and input drawing stay out of it."""
    rows = [("void my_ns::relu_kernel<float>(float const*, float*, long)", 10, 5.0),
            ("ampere_sgemm_128x64_nn", 10, 50.0), ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", 2, 9.0),
            ("void cudnn::cnn::conv2d_grouped_direct_kernel<float>(...)", 1, 3.0), ("Memcpy DtoD (Device -> Device)", 3, 1.0),
            ("Memset (Device)", 1, 0.1), ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 5, 1.0),
            ("void at::native::normal_kernel<float>(...)", 4, 2.0)]
    own = {"my_ns::relu_kernel"}
    _, before = kernel_audit.audit(rows, allowed={"void at::native::normal_kernel<float>(...)"})
    assert set(before) == set()  # the name lists alone: library kernels were not foreign
    kept, foreign = kernel_audit.audit(rows, allowed={"void at::native::normal_kernel<float>(...)"}, own=own)
    assert set(foreign) == {"ampere_sgemm_128x64_nn", "cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4",
                            "void cudnn::cnn::conv2d_grouped_direct_kernel<float>(...)"}
    assert foreign["ampere_sgemm_128x64_nn"] == 10
    assert kernel_audit.per_call(rows, 1, {"void at::native::normal_kernel<float>(...)"}, own)["ampere_sgemm_128x64_nn"] == 10
