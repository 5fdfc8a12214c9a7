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
