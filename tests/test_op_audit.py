"""The op audit below Python (sandbox/worker/op_audit.py), in this process on the CPU: what it sees that the
Python op recorder cannot, what it lets through, and its probes. End to end: tests/exploits (catalogue
entries modes_disabled*, allowed_op_kernel_replaced)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from sandbox.worker import op_audit
from sandbox.worker.protocol import Reply
from sandbox.worker.recorder import make_recorder

CPU = torch.device("cpu")


def audited(forward, x):
    """forward(x) under the recorder and the audit, as the candidate role runs it; the audit's verdict."""
    recorder = make_recorder()()
    audit = op_audit.OpAudit(CPU)
    with torch.no_grad(), audit:
        with recorder:
            forward(x)
        audit.canary()
    audit.verdict()
    return dict(recorder.forbidden)


def honest(x):
    y = torch.empty_like(x)  # allocation, views and metadata: what an extension's binding does
    z = torch.zeros_like(x).reshape(-1).view(x.shape).t().chunk(2)
    return y, z


def test_allocation_views_and_composites_of_them_pass():
    assert audited(honest, torch.randn(8, 16)) == {}


def test_ops_run_past_the_recorder_are_tampering():
    def hidden(x):
        torch.empty_like(x)
        with _disable_current_modes():
            return torch.relu(x)

    with pytest.raises(Reply) as e:
        audited(hidden, torch.randn(8, 16))
    assert e.value.reason == "dispatch_tampered" and "aten::relu (1x)" in e.value.message
    assert "clamp_min" not in e.value.message  # counted at its outermost op


def test_ops_the_recorder_saw_are_left_to_it():
    # a visible relu is the recorder's verdict (torch_op_used), not tampering
    assert audited(lambda x: torch.relu(x), torch.randn(4)) == {"aten::relu": 1}


def test_compute_inside_an_allowed_op_is_tampering():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty_like", lambda x, **kw: torch.clamp(x, min=0), "CPU")
    try:
        with pytest.raises(Reply) as e:
            audited(lambda x: torch.empty_like(x), torch.randn(8, 16))
    finally:
        lib._destroy()
    assert e.value.reason == "dispatch_tampered" and "aten::clamp inside aten::empty_like" in e.value.message
    assert audited(lambda x: torch.empty_like(x), torch.randn(2)) == {}  # the real kernel is back


def test_missing_probes_mean_the_callbacks_were_switched_off(monkeypatch):
    # the probes are what proves the session saw the whole forward: without them the audit must refuse,
    # never read an empty profile as a clean forward
    monkeypatch.setattr(op_audit, "_MUL", lambda a, b: None)
    with pytest.raises(Reply) as e:
        audited(honest, torch.randn(4, 4))
    assert e.value.reason == "dispatch_tampered" and "switched off" in e.value.message


def test_a_session_stopped_inside_the_forward_is_tampering():
    audit = op_audit.OpAudit(CPU)
    with pytest.raises(Reply) as e:
        with audit:
            audit.prof.__exit__(None, None, None)  # what a forward that stops the judge's session leaves
            torch.relu(torch.ones(3))
            audit.canary()
        audit.verdict()
    assert e.value.reason == "dispatch_tampered" and "switched off" in e.value.message


def test_the_recorder_counts_scalars_read_into_python():
    # float(t) over a tensor's elements computes in Python; the candidate role refuses past MAX_SCALAR_READS
    from sandbox.worker.recorder import MAX_SCALAR_READS

    recorder = make_recorder()()
    x = torch.randn(MAX_SCALAR_READS + 1)
    with torch.no_grad(), recorder:
        values = [max(float(v), 0.0) for v in x]
        x.shape[0] + int(x.numel())  # metadata is not a read
    assert recorder.scalar_reads == len(values) == MAX_SCALAR_READS + 1 and recorder.forbidden == {}


# --- every thread (Judge IX, item 2: sandbox/worker/thread_audit.py) ---------------------------------------------

def _on_a_thread(fn):
    import threading

    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_an_op_started_on_another_thread_is_seen():
    """The Judge IX route: the forward allocates, then a thread it starts (a std::thread in the extension; a
    Python thread here, which inherits the judge's thread-local callbacks no more) runs the matmul. The recorder
    and the legacy profiler see nothing of it; the global observer does."""
    a = torch.randn(16, 16)

    def threaded(x):
        out = torch.empty(16, 16)
        _on_a_thread(lambda: torch.mm(a, a, out=out))
        return out

    with pytest.raises(Reply) as e:
        audited(threaded, a)
    assert e.value.reason == "torch_op_used" and "aten::mm" in e.value.message, e.value.message
    assert "thread other than the caller's" in e.value.message


def test_at_parallel_for_workers_and_allocation_on_other_threads_pass():
    """An honest CPU kernel's intra-op workers run no ATen op; allocation and views on another thread are no
    compute either. A large fill runs at::parallel_for inside ATen's own kernel: its workers report nothing."""
    def honest_threads(x):
        y = torch.empty_like(x)
        _on_a_thread(lambda: torch.empty(8).view(2, 4))
        return y

    assert audited(honest_threads, torch.randn(8, 16)) == {}
    assert torch.get_num_threads() >= 1


def test_an_observer_that_misses_the_judges_thread_canary_is_tampering(monkeypatch):
    from sandbox.worker import thread_audit

    monkeypatch.setattr(thread_audit, "_THREAD", lambda target, name: type("T", (), {"start": lambda s: None,
                                                                                   "join": lambda s: None})())
    with pytest.raises(Reply) as e:
        audited(honest, torch.randn(4, 4))
    assert e.value.reason == "dispatch_tampered" and "thread of its own" in e.value.message


def test_other_thread_ops_counts_outermost_compute_only():
    from sandbox.worker.thread_audit import other_thread_ops

    def node(i, name, tid, parent):
        return {"id": i, "name": name, "ctrl_deps": parent, "attrs": [{"name": "tid", "value": tid}]}

    nodes = [node(1, "[pytorch|profiler|execution_trace|thread]", 1, 0), node(2, "aten::mul", 1, 1),
             node(3, "[pytorch|profiler|execution_trace|thread]", 2, 0), node(4, "aten::relu", 2, 3),
             node(5, "aten::clamp_min", 2, 4), node(6, "aten::empty", 2, 3), node(7, "aten::add", 1, 1),
             node(8, "[pytorch|profiler|execution_trace|thread]", 3, 0), node(9, "aten::mul", 3, 8)]
    found, canaries = other_thread_ops(nodes)
    assert found == {"aten::relu": 1} and canaries == 1  # clamp_min inside relu, empty, the caller's add: not counted
