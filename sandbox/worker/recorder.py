"""The candidate's PyTorch op accounting: which ATen ops a forward may dispatch besides its own kernels.

Imports torch only inside functions: the judge's symbol scan reads ALLOWED_OPS in a process that never
imports torch (tests/test_judge_imports.py)."""

from __future__ import annotations

import collections

ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like new_zeros zero_ resize_
view _unsafe_view _reshape_alias as_strided t transpose permute expand expand_as squeeze unsqueeze slice select
narrow split split_with_sizes unbind chunk alias detach detach_ view_as_real view_as_complex unfold diagonal
lift_fresh _local_scalar_dense is_same_size sym_size sym_stride sym_numel sym_storage_offset is_contiguous
_has_compatible_shallow_copy_type record_stream
""".split())


# reading one element into Python (.item(), float(t), int(t)): allowed for a few scalars (a size, a flag),
# but a forward that reads a tensor element by element computes in Python, outside the extension
SCALAR_READ = "aten::_local_scalar_dense"
MAX_SCALAR_READS = 64


def make_recorder():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpRecorder(TorchDispatchMode):
        """Counts every ATen op dispatched in the forward, including those called from C++."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # False keeps TorchDispatchMode from wrapping __torch_dispatch__ in dynamo.disable, whose
            # first call imports torch._dynamo (4-5 s on the H200 host) inside the candidate's first
            # forward. Nothing in a candidate's process is compiled: the static scan refuses torch.compile.
            return False

        def __init__(self):
            super().__init__()
            self.forbidden: collections.Counter = collections.Counter()
            self.scalar_reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.split("::", 1)[-1] not in ALLOWED_OPS:
                self.forbidden[name] += 1
            elif name == SCALAR_READ:
                self.scalar_reads += 1
            return func(*args, **(kwargs or {}))

    return OpRecorder


class RecorderTampered(Exception):
    """The op recorder no longer sees ops the judge itself dispatched under it."""


def reference_ops(model, inputs: list) -> dict:
    """The compute ops the task's reference forward dispatches, recorded before candidate code runs."""
    import torch

    recorder = make_recorder()()
    with torch.no_grad(), recorder:
        model(*inputs)
    return dict(recorder.forbidden)


def canary(recorder, reference=None, inputs=None, expected: dict | None = None) -> None:
    """Dispatch known compute ops under the recorder, check they are counted, then forget them.

    Code in the candidate's process can replace ALLOWED_OPS, the recorder class or its dispatch hook. A
    recorder patched to see nothing, or to allow everything, misses the fixed mul; one patched to allow
    just the ops the task needs (so the candidate can delegate to PyTorch) misses the reference
    forward's own ops, recorded before any candidate code ran. A patch that recognises the judge's
    calls (by their call stack) is not caught (docs/judge.md).
    """
    import collections

    import torch

    probes: collections.Counter = collections.Counter({"aten::mul": 1})
    before = collections.Counter(recorder.forbidden)
    with torch.no_grad(), recorder:
        x = torch.ones(2)
        torch.mul(x, x)
        if reference is not None:
            reference(*inputs)
            probes.update(expected or {})
    seen = collections.Counter(recorder.forbidden)
    seen.subtract(before)
    missing = {k: v - seen.get(k, 0) for k, v in probes.items() if seen.get(k, 0) < v}
    if missing:
        raise RecorderTampered("the op recorder missed ops the judge dispatched under it: "
                               + ", ".join(f"{k} ({v}x)" for k, v in sorted(missing.items())[:5]))
    recorder.forbidden.clear()
    recorder.forbidden.update(before)
