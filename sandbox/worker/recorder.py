"""The candidate's PyTorch op accounting: which ATen ops a forward may dispatch besides its own kernels."""

from __future__ import annotations

import collections

ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like new_zeros zero_ resize_
view _unsafe_view _reshape_alias as_strided t transpose permute expand expand_as squeeze unsqueeze slice select
narrow split split_with_sizes unbind chunk alias detach detach_ view_as_real view_as_complex unfold diagonal
lift_fresh _local_scalar_dense is_same_size sym_size sym_stride sym_numel sym_storage_offset is_contiguous
_has_compatible_shallow_copy_type record_stream
""".split())


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

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.split("::", 1)[-1] not in ALLOWED_OPS:
                self.forbidden[name] += 1
            return func(*args, **(kwargs or {}))

    return OpRecorder


class RecorderTampered(Exception):
    """The op recorder no longer sees an op the judge itself dispatched under it."""


def canary(recorder) -> None:
    """Dispatch one known compute op under the recorder and check it is counted (then forget it).

    Code in the candidate's process can replace ALLOWED_OPS, the recorder class or its dispatch hook;
    a recorder patched to see nothing, or to allow everything, misses this op too. A patch that hides
    only the candidate's own ops and recognises this call as the judge's is not caught (docs/judge.md).
    """
    import torch

    name = "aten::mul"
    before = recorder.forbidden.get(name, 0)
    x = torch.ones(2)
    with recorder:
        torch.mul(x, x)
    seen = recorder.forbidden.get(name, 0) - before
    if seen != 1:
        raise RecorderTampered(f"the op recorder counted {seen} of 1 {name} the judge dispatched under it")
    recorder.forbidden[name] -= 1
    if not recorder.forbidden[name]:
        del recorder.forbidden[name]
