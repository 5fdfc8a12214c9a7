"""time_prepare: the input sets a batch's calls run on (sandbox/worker/timer.py), drawn before the batch starts."""

from __future__ import annotations

import pytest
import torch

from sandbox.worker.inputs import build_reference, load_module, make_init_inputs
from sandbox.worker.timer import TimerRole

CFG = {"min_warmup_calls": 2, "warmup_ms": 0.0}


@pytest.fixture
def begin(small_task_path):
    mod = load_module(str(small_task_path), "prepare_task")
    cpu = torch.device("cpu")
    model = build_reference(mod, make_init_inputs(mod, 1, cpu), 1, cpu)

    def start(candidate: bool) -> TimerRole:
        tr = TimerRole()
        tr.device, tr.mod, tr.cand, tr.gen_kernels, tr.audit_canary = cpu, mod, None, set(), None
        tr._fn_now, tr._variant = model, "candidate" if candidate else "eager"
        with torch.no_grad():
            tr._begin(model, 7, CFG, candidate=False)
        tr._run["candidate"] = candidate  # timed as the candidate without its extension's call counter
        return tr

    return start


def _prepared(tr: TimerRole, calls: int, index: int) -> list:
    assert tr.time_prepare(calls, index) == {"prepared": True}
    i, sets = tr._run["ready"]
    assert i == index and len(sets) == calls
    return sets


def test_the_candidates_sets_get_fresh_values_in_the_same_tensors_and_eagers_are_drawn_once(begin):
    """The candidate's batches run on the same tensors (a cache keyed by address hits stale values) holding new
    values every batch (one keyed by content never hits). Eager caches nothing: its sets are drawn once a timing,
    the same tensors with the same values in every batch, so the exclusive section does not draw them again."""
    for candidate in (True, False):
        tr = begin(candidate)
        first = [[t.clone() for t in s] for s in _prepared(tr, 6, 0)]
        ptrs = [[t.data_ptr() for t in s] for s in tr._run["ready"][1]]
        second = _prepared(tr, 6, 1)
        assert [[t.data_ptr() for t in s] for s in second] == ptrs
        same = [all(torch.equal(a, b) for a, b in zip(x, y, strict=True)) for x, y in zip(first, second, strict=True)]
        assert not any(same) if candidate else all(same), (candidate, same)
        # within a batch every call has values of its own
        flat = [s[0] for s in second]
        assert all(not torch.equal(flat[i], flat[j]) for i in range(6) for j in range(i + 1, 6))
