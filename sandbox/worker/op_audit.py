"""Accounting of the forward below Python: what the dispatcher ran, and (on CUDA) what ran on the device.

The op recorder (recorder.py) is a Python dispatch mode, so Python in the candidate's process can step
around it (`_disable_current_modes()`, a kernel registered for an allowed op, ...). This audit listens
where Python modes cannot reach: the profiler's RecordFunction callbacks, which the dispatcher calls in
C++ for every op, with or without Python modes. Every op the recorder handled shows in the profile with
a `PythonDispatchMode` child; an op with none on its chain ran past the recorder. So:

- an op the recorder never saw, that is not allocation, view or metadata, is compute hidden from it;
- an op that runs inside the implementation of an allowed op (`empty_like` whose kernel computes) is
  compute hidden behind an allowed name;
- on CUDA, a PyTorch/Triton/library kernel on the device, or a device-to-host copy (a host round trip:
  the answer computed on the CPU), during the forward is not the extension's work.

The audit's canary, a known op dispatched past the recorder inside the profiled region through
references captured before any candidate code ran, must show in the audit, so switching RecordFunction
off (from the extension's C++) is caught as tampering rather than read as a clean forward.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

import torch

from sandbox.worker import kernel_audit, thread_audit
from sandbox.worker.kernel_names import kernel_identifier
from sandbox.worker.protocol import Reply
from sandbox.worker.recorder import ALLOWED_OPS

# what allowed ops run inside themselves: zeros is empty + zero_ (fill_); views reach as_strided
INTERNAL_OPS = ALLOWED_OPS | {"fill_"}
MODE_FRAME = "PythonDispatchMode"  # the profiler's name for a call into a Python dispatch mode

# captured at import, before any candidate code runs
_MUL = torch.mul
_ONES = torch.ones
_NO_GRAD = torch.no_grad
_PROFILE = torch.autograd.profiler.profile


def _op(name: str) -> str | None:
    return name.split("::", 1)[1] if name.startswith("aten::") else None


def _chain(evt):
    p = evt.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def hidden_ops(events) -> tuple[collections.Counter, collections.Counter]:
    """(ops that ran past the recorder, ops computed inside an allowed op), by name, from CPU events.

    Only the outermost op of a hidden chain counts (relu, not the clamp_min inside it)."""
    past: collections.Counter = collections.Counter()
    inside: collections.Counter = collections.Counter()
    cpu = [e for e in events if _op(e.name) is not None or e.name == MODE_FRAME]
    children: dict[int, list] = collections.defaultdict(list)
    for e in cpu:
        if e.cpu_parent is not None:
            children[id(e.cpu_parent)].append(e)

    def has_mode_below(e) -> bool:
        return any(c.name == MODE_FRAME or has_mode_below(c) for c in children.get(id(e), ()))

    for e in cpu:
        name = _op(e.name)
        if name is None:
            continue
        chain = list(_chain(e))
        frame = next((i for i, p in enumerate(chain) if p.name == MODE_FRAME), None)
        if frame is not None:
            # part of the implementation of an op the recorder saw: chain[frame + 1] is that op
            owner = chain[frame + 1] if frame + 1 < len(chain) else None
            owner_name = _op(owner.name) if owner is not None else None
            if owner_name in ALLOWED_OPS and name not in INTERNAL_OPS:
                outer = [p for p in chain[:frame] if _op(p.name) not in INTERNAL_OPS and _op(p.name)]
                if not outer:
                    inside[f"{e.name} inside {owner.name}"] += 1
            continue
        if has_mode_below(e) or name in INTERNAL_OPS:
            continue  # a composite whose parts the recorder saw (reshape -> view), or allocation and views
        if any(_op(p.name) not in INTERNAL_OPS for p in chain if _op(p.name)):
            continue  # counted at its outermost hidden op
        past[e.name] += 1
    return past, inside


class OpAudit:
    """One profiled forward. Use: `with audit: forward ...; audit.canary()`, then `audit.verdict(recorded)`."""

    def __init__(self, device: torch.device, canary_kernels: dict[str, int] | None = None,
                 own_kernels: Collection[str] = ()):
        self.device = device
        self.cuda = device.type == "cuda"
        self.canary_kernels = canary_kernels or {}
        self.own_kernels = frozenset(own_kernels)  # identifiers the extension's .so defines (symbol_scan)
        self.probe = _ONES(4, device=device)  # made before the region: only the multiply runs inside it
        # the autograd profiler, not torch.profiler: the latter's first use imports torch._dynamo (4-5 s of
        # a verify on an H100). Kineto only where the device's activity is needed; CPU ops need no CUPTI.
        self.prof = _PROFILE(use_kineto=self.cuda, use_device="cuda" if self.cuda else None)

    def __enter__(self):
        # ops started on other threads pass the recorder and this profiler's thread-local callbacks (Judge IX)
        self.threads = thread_audit.EveryThread().start()
        self.prof.__enter__()
        self._probe()  # the first op of the session: a session restarted inside the forward lacks it
        return self

    def __exit__(self, kind, value, tb):
        try:
            self.prof.__exit__(kind, value, tb)
            self.threads.stop()
        except Exception as e:
            if kind is None:  # the judge's own session would not stop: the forward stopped or replaced it
                raise Reply("dispatch_tampered", f"the op audit's profiler session was stopped inside the forward "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
        return False

    def _probe(self) -> None:
        with _NO_GRAD():
            _MUL(self.probe, self.probe)

    def canary(self) -> None:
        """Inside the region, after the forward: one more multiply past the recorder (no mode is active)."""
        self._probe()
        self.threads.canary()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _events(self):
        return self.prof.function_events

    def verdict(self) -> None:
        """Raise a Reply naming what the forward ran that is not the extension's; the canary first."""
        self.threads.verdict("ModelNew.forward")
        try:
            past, inside = hidden_ops(self._events())
            kernels = self._device_rows() if self.cuda else []
        except Exception as e:  # the judge's own code over its own profile: broken only by a patch
            raise Reply("dispatch_tampered", f"the op audit failed ({type(e).__name__}: {str(e)[:300]}): it was "
                        "patched") from None
        if past["aten::mul"] < 2 or not _bracketed(self._events()):
            raise Reply("dispatch_tampered", "the op audit missed the multiplies the judge dispatched at the start "
                        "and the end of the profiled region: the dispatcher's op callbacks were switched off or "
                        "the profiler session replaced")
        past["aten::mul"] -= 2
        past = +past
        if past:
            raise Reply("dispatch_tampered", "ModelNew.forward ran PyTorch ops past the op recorder: "
                        + _listed(past) + ". Compute must run in your kernels; stepping around the recorder (a "
                        "dispatch mode switched off, a tensor built from Python data with torch.tensor inside the "
                        "forward, printing a tensor) is tampering")
        if inside:
            raise Reply("dispatch_tampered", "an allocation or view op computed inside its own implementation: "
                        + _listed(inside) + " (an op kernel was replaced)")
        if self.cuda:
            self._device_verdict(kernels)

    def _device_rows(self) -> list[kernel_audit.Event]:
        from torch.autograd import DeviceType

        return [(e.name, 1, 0.0) for e in self._events() if e.device_type == DeviceType.CUDA]

    def foreign(self, rows: list[kernel_audit.Event]) -> collections.Counter:
        """Device work that is not the extension's own: every kernel but fills and memsets whose name the
        extension does not define (ATen's, Triton's, a library's); copies are judged apart."""
        out: collections.Counter = collections.Counter()
        for name, count, _ in rows:
            if name.startswith("Memcpy") or any(h in name for h in kernel_audit.HARMLESS):
                continue
            if kernel_identifier(name) not in self.own_kernels:
                out[name] += count
        return out

    def _device_verdict(self, kernels: list) -> None:
        foreign = self.foreign(kernels)
        try:
            foreign = kernel_audit.settle(foreign, collections.Counter(self.canary_kernels))
        except kernel_audit.AuditTampered as e:
            raise Reply("audit_tampered", f"{e}: the kernel audit was patched") from None
        if foreign:
            raise Reply("torch_op_used", "ModelNew.forward launched device kernels that cuda_extension does not "
                        "define: " + _listed(foreign) + ". Every kernel in the forward must be yours (PyTorch's and "
                        "libraries' kernels, cuBLAS and cuDNN included, are fallbacks)")
        kernel_audit.refuse_host_copies(kernels, "ModelNew.forward")


def _bracketed(events) -> bool:
    """The session's first and last outermost ops are the judge's probes (multiplies)."""
    outer = sorted((e for e in events if _op(e.name) and e.cpu_parent is None), key=lambda e: e.time_range.start)
    return len(outer) >= 2 and outer[0].name == outer[-1].name == "aten::mul"


def _listed(counts: collections.Counter) -> str:
    return ", ".join(f"{k[:120]} ({v}x)" for k, v in sorted(counts.items())[:5])


def calibrate(device: torch.device) -> dict[str, int]:
    """Before any candidate code: start the profiler once (its first start is slow) and, on CUDA, learn
    which kernels the canary's multiply launches, so the device audit can take them out again."""
    audit = OpAudit(device)
    with audit:
        audit.canary()
    return dict(audit.foreign(audit._device_rows())) if audit.cuda else {}
