"""The reference process's output comparison, as a pure function."""

from __future__ import annotations

import json
import math

import torch

from sandbox.results import TensorCheck
from sandbox.worker.compare import compare_tensor


def test_a_mismatch_against_zeros_reports_finite_errors_that_serialize_as_numbers():
    # relu's reference is 0 wherever abs's output is |x|: the relative error there is x / 0
    x = torch.linspace(-5.0, 5.0, 101)
    out = compare_tensor("out", torch.relu(x), x.abs(), atol=1e-5, rtol=1e-5)
    assert not out["ok"] and out["reason"] == "value_mismatch" and out["mismatched"] == 50
    assert math.isfinite(out["max_rel_error"]) and out["max_rel_error"] > 1e30
    assert out["max_abs_error"] == 5.0
    # what the verify tool returns: every error field a JSON number (null failed the tool's output schema)
    dumped = json.loads(TensorCheck(**{k: v for k, v in out.items() if k != "reason"}).model_dump_json())
    assert isinstance(dumped["max_rel_error"], float) and isinstance(dumped["max_abs_error"], float)


def _cases():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5000, generator=g)
    close = ref + 1e-6 * torch.randn(5000, generator=g)
    far = close.clone()
    far[[7, 1234, 4999]] += 3.0  # mismatches in the first, a middle and the last chunk
    nan_ref, nan_cand = ref.clone(), close.clone()
    nan_ref[2500], nan_cand[2500] = float("nan"), float("nan")  # NaN in both: not a mismatch
    nan_cand[4100] = float("inf")  # Inf in one chunk only: the others take the fast path
    tiny = torch.zeros(5000)
    tiny[:10] = 1e-3  # every element within atol, yet not the reference: the error norm decides
    return [("close", ref, close), ("far", ref, far), ("nan", nan_ref, nan_cand), ("near_zero", ref * 0 + 1.0, tiny + 1.0),
            ("zeros", tiny, torch.zeros(5000)), ("half", ref.half(), far.half()), ("bf16", ref.bfloat16(), close.bfloat16()),
            ("complex", torch.complex(ref, close), torch.complex(far, ref))]


def test_the_one_sync_path_reports_exactly_what_the_general_path_does(monkeypatch):
    """Chunks with only finite differences take a path that reads its reductions back at once; chunks with NaN or
    Inf take the general one. Both must agree on every field, whatever the chunking."""
    import sandbox.worker.compare as cmp

    monkeypatch.setattr(cmp, "_CHUNK", 1000)  # five chunks: mismatches and NaNs in some of them
    for name, ref, cand in _cases():
        fast = cmp.compare_tensor(name, ref, cand, atol=1e-2, rtol=1e-2)
        with monkeypatch.context() as m:
            m.setattr(cmp, "_finite_chunk", lambda *a: None)
            general = cmp.compare_tensor(name, ref, cand, atol=1e-2, rtol=1e-2)
        assert fast.keys() == general.keys(), name
        for k, v in general.items():
            if isinstance(v, float):
                assert math.isclose(fast[k], v, rel_tol=1e-6, abs_tol=1e-12), (name, k, fast[k], v)
            else:
                assert fast[k] == v, (name, k, fast[k], v)
    far = cmp.compare_tensor("far", *_cases()[1][1:], atol=1e-2, rtol=1e-2)
    assert far["mismatched"] == 3 and far["first_mismatch_index"] == [7]
    assert cmp.compare_tensor("zeros", *_cases()[4][1:], atol=1e-2, rtol=1e-2)["reason"] == "value_mismatch"
