"""The CUDA kernel audit of the timed calls, and the canary that makes patching it detectable.

On CUDA the timed calls run without the op recorder (it would cost more than many kernels take); a
torch.profiler session spans them instead, and the audit refuses any PyTorch or Triton kernel in its
table that the harness's own input drawing does not explain. All of this is Python in the candidate's
process, so a candidate's C++ can empty the name lists, replace the table function or widen the
allowed set. The canary catches those patches: before any candidate code runs, the timer calibrates a
few known ATen ops (random ops, dtypes and sizes) and the task's own reference forward, recording the
foreign kernels one call of each launches; during the timed run it launches them at random moments
between batches, outside the timed calls; at the end the audit, through the same code path and lists
that judge the candidate, must report at least those launches. What it reports beyond them is the
candidate's. A patch that recognises the canary's launches (reading the judge's state in the process)
is not caught: see docs/judge.md.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import torch

from sandbox.worker.kernel_names import kernel_identifier
from sandbox.worker.protocol import Reply

# ATen and Triton kernels that may run inside a candidate's timed call without being its compute
HARMLESS = ("FillFunctor", "fill_kernel", "zero_", "Memset", "memset")
FOREIGN = ("at::native::", "at_cuda_detail", "triton", "void at::", "cutlass::Kernel<at::")

# the profiler's name for a device-to-host copy: inside a forward, the answer computed on the host
HOST_COPY = "Memcpy DtoH"

# captured at import, before any candidate code runs: patching torch.neg later cannot reach the canary
_OPS = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "sin": torch.sin, "cos": torch.cos,
        "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_GRAD = torch.no_grad
_RANDN = torch.randn
_EMPTY_LIKE = torch.empty_like
_DEMANGLE = torch._C._demangle
_DEVICE_CPU = torch.autograd.DeviceType.CPU
_CUDA_ACTIVITY = torch.profiler.ProfilerActivity.CUDA
PROBE_OPS = 3  # ops calibrated per timer, each with its own dtype and size

# one row of the profiler's table: (kernel name, launches, self device time in microseconds)
Event = tuple[str, int, float]


class AuditTampered(Exception):
    """The audit no longer reports kernels the judge itself launched inside the profiled region."""


def table(prof) -> list[Event]:
    """The profiled region's rows. A session with CUDA activity: its device's own events (kernels, copies, sets)
    counted straight from the profiler's raw results. key_averages() first builds a Python event per record
    (the host-side launch records too) and a tree of them: over a timing's thousands of calls that cost seconds
    of the exclusive section on a loaded H100 host. On the CPU (ATen ops are the rows) key_averages() stays."""
    if _CUDA_ACTIVITY not in getattr(prof, "activities", ()):
        return _averaged(prof)
    counts: collections.Counter = collections.Counter()
    totals: dict[str, float] = collections.defaultdict(float)
    for evt in prof.profiler.kineto_results.events():
        if evt.device_type() == _DEVICE_CPU:
            continue
        name = evt.name()
        counts[name] += 1
        totals[name] += evt.duration_ns() / 1000.0
    # the names as key_averages() spells them (demangled), once per distinct name
    return [(_DEMANGLE(n), c, totals[n]) for n, c in counts.items()]


def _averaged(prof) -> list[Event]:
    out = []
    for evt in prof.key_averages():
        total = getattr(evt, "self_device_time_total", None)
        if total is None:
            total = getattr(evt, "self_cuda_time_total", 0)
        out.append((evt.key, int(evt.count), float(total or 0.0)))
    return out


def audit(events: Iterable[Event], allowed: Collection[str],
          own: Collection[str] | None = None) -> tuple[list[Event], collections.Counter]:
    """The rows worth showing (neither input drawing nor harmless) and the foreign kernels' launches. `own`: the
    identifiers the extension defines (symbol_scan.own_kernels); given, every kernel that is not among them is
    foreign too, as in verify's op audit: cuBLAS's, cuDNN's and other libraries' (Judge IX: the extension may
    import none of them, so none of their kernels is its work).

    Reads HARMLESS and FOREIGN at call time: the canary depends on the lists this call really uses."""
    kept: list[Event] = []
    foreign: collections.Counter = collections.Counter()
    for name, count, total in events:
        if name in allowed or any(h in name for h in HARMLESS):
            continue
        if any(f in name for f in FOREIGN) or (own is not None and not name.startswith(("Memcpy", "Memset"))
                                               and kernel_identifier(name) not in own):
            foreign[name] += count
        kept.append((name, count, total))
    return kept, foreign


def host_copies(events: Iterable[Event]) -> collections.Counter:
    return collections.Counter({name: count for name, count, _ in events if name.startswith(HOST_COPY)})


def refuse_host_copies(events: Iterable[Event], where: str, own: int = 0) -> None:
    """`own`: device-to-host copies the judge itself made inside the profiled region (the timer's spot copies of
    large outputs, moved to host memory between batches: sandbox/worker/batches.py), taken out of the count."""
    trips = host_copies(events)
    if sum(trips.values()) > own:
        raise Reply("host_round_trip", f"{where} copied device memory to the host: "
                    + ", ".join(f"{k[:80]} ({v}x)" for k, v in sorted(trips.items())[:3])
                    + ". Computing on the host is a fallback; keep the work on the device")


def rows(kept: list[Event], trials: int, skip: Collection[str] = ()) -> list[dict]:
    """Top kernels per timed call, largest first; `skip` leaves out the canary's own kernels."""
    out = [(n, t / 1000.0 / trials, max(1, c // trials)) for n, c, t in kept if t > 0 and n not in skip]
    out.sort(key=lambda r: -r[1])
    grand = sum(r[1] for r in out) or 1.0
    return [{"name": n[:200], "total_ms": t, "calls": c, "percent": 100.0 * t / grand} for n, t, c in out]


def settle(foreign: collections.Counter, expected: collections.Counter) -> collections.Counter:
    """The canary's launches taken out of what the audit found: the rest is the candidate's.

    Raises AuditTampered when the audit reports fewer launches of a canary kernel than the judge made."""
    missing = {k: v - foreign.get(k, 0) for k, v in expected.items() if foreign.get(k, 0) < v}
    if missing:
        what = ", ".join(f"{k[:100]} ({v}x)" for k, v in sorted(missing.items())[:3])
        raise AuditTampered(f"the kernel audit missed {sum(missing.values())} kernel launches the judge made "
                            f"inside the profiled region: {what}")
    rest = collections.Counter(foreign)
    rest.subtract(expected)
    return +rest


def verdict(kernel_table: Callable, prof, allowed: Collection[str], run: CanaryRun | None, trials: int,
            checks: dict, own_host_copies: int = 0) -> list[dict]:
    """The audit's verdict on a timed run, its canary first; the top-kernel rows if it passes.

    `kernel_table` is the timer's own TimerRole._kernel_table, the path that judges the candidate."""
    expected = run.expected if run is not None else collections.Counter()
    try:
        kept, foreign = kernel_table(prof, allowed)
        foreign = settle(foreign, expected)
    except AuditTampered as e:
        raise Reply("audit_tampered", f"{e}: the kernel audit was patched") from None
    except Exception as e:  # the judge's own code over its own profile: broken only by a patch
        raise Reply("audit_tampered", f"the kernel audit failed ({type(e).__name__}: {str(e)[:300]}): it was "
                    "patched") from None
    checks["audit_canary_launches"] = sum(expected.values())
    if foreign:
        raise Reply("torch_op_used", "the timed calls launched PyTorch/Triton kernels that are not yours: "
                    + ", ".join(f"{k[:120]} ({v}x)" for k, v in sorted(foreign.items())[:5]))
    refuse_host_copies(kept, "the timed calls", own_host_copies)
    return rows(kept, trials, skip=expected)


def per_call(events: Iterable[Event], calls: int, excluded: Collection[str],
             own: Collection[str] | None = None) -> dict[str, int] | None:
    """The foreign kernels one of `calls` identical calls launches, as the audit classifies them; None
    when their counts do not divide evenly (the call is not repeatable enough to be a canary)."""
    _, foreign = audit(events, excluded, own)
    if any(c % calls for c in foreign.values()):
        return None
    return {k: c // calls for k, c in foreign.items()}


@dataclass
class Probe:
    """One canary call and the foreign kernels it launches each time (calibrated)."""

    name: str
    fn: Callable[[], object]
    kernels: dict[str, int]


def profiled(fn: Callable[[], object], calls: int, activities: list, sync: Callable[[], None]) -> list[Event]:
    from torch.profiler import profile

    with _NO_GRAD(), profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    return table(prof)


def plan(device, reference: Callable | None, inputs: list | None, excluded: Collection[str],
         sync: Callable[[], None], activities: list | None = None, rng: random.Random | None = None,
         own: Collection[str] | None = None) -> Canary:
    """Calibrate the canary; run this before any candidate code does. `excluded` are the kernels the
    audit allows (input drawing), which a canary must not rely on; `own` as the audit will be given it."""
    if activities is None:
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CUDA]
    rng = rng or random.SystemRandom()
    probes = []
    for name in rng.sample(sorted(_OPS), PROBE_OPS):
        dtype, n = rng.choice(_DTYPES), rng.randrange(1 << 12, 1 << 18)
        try:
            x = _RANDN(n, device=device).to(dtype)
            out = _EMPTY_LIKE(x)
            op = _OPS[name]

            def fn(op=op, x=x, out=out):
                return op(x, out=out)

            fn()  # first call: lazy initialisation stays out of the calibration
            sync()
            kernels = per_call(profiled(fn, 2, activities, sync), 2, excluded, own)
        except RuntimeError:  # an op this build lacks for the dtype: draw fewer probes
            continue
        if kernels:
            probes.append(Probe(f"{name} {str(dtype).removeprefix('torch.')} x{n}", fn, kernels))
    ref = None
    if reference is not None:
        def forward():
            return reference(*inputs)

        # only a forward that launches the same foreign kernels twice in a row is a usable canary
        a, b = (per_call(profiled(forward, 1, activities, sync), 1, excluded, own) for _ in range(2))
        if a and a == b:
            ref = Probe("the reference forward", forward, a)
    return Canary(probes, ref, sync, rng)


@dataclass
class Canary:
    """The calibrated probes; start() gives one timed run its own launches and expected counts."""

    probes: list[Probe]
    reference: Probe | None
    sync: Callable[[], None]
    rng: random.Random

    def start(self) -> CanaryRun:
        return CanaryRun(self)

    @property
    def empty(self) -> bool:
        return not self.probes and self.reference is None


@dataclass
class CanaryRun:
    canary: Canary
    expected: collections.Counter = field(default_factory=collections.Counter)
    launches: int = 0
    reference_ran: bool = False

    def launch(self, final: bool = False) -> None:
        """Called at the start, between batches and at the end of the profiled region (never inside a
        timed call): sometimes a probe a random number of times, the reference forward once per run."""
        c, rng = self.canary, self.canary.rng
        with _NO_GRAD():
            if c.probes and (rng.random() < 0.5 or (final and self.launches == 0)):
                p, times = rng.choice(c.probes), rng.randint(1, 3)
                for _ in range(times):
                    p.fn()
                self._expect(p, times)
            if c.reference is not None and not self.reference_ran and (final or rng.random() < 1 / 3):
                c.reference.fn()
                self._expect(c.reference, 1)
                self.reference_ran = True
        c.sync()

    def _expect(self, p: Probe, times: int) -> None:
        for k, v in p.kernels.items():
            self.expected[k] += v * times
        self.launches += times
