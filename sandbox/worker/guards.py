"""Checks that run around the candidate's forward, inside its worker process (torch + stdlib only).

Each guard answers one question about a call: did the extension run at all, did the forward
leave work behind, did it change global numerics, did it disarm the op recorder. What they
record is evidence for the judge; the values themselves are compared in the reference process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import types

import torch


class CallCounter:
    """Wraps the extension module's functions so the judge knows which ones a forward called."""

    PROBE = "<judge probe>"

    def __init__(self, module: types.ModuleType):
        self.calls: dict[str, int] = {}
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("_") or not callable(fn) or isinstance(fn, type):
                continue
            setattr(module, name, self._wrap(name, fn))
        # the judge's own function, counted the same way but never on the module
        self._probe = self._wrap(self.PROBE, lambda: None)

    def _wrap(self, name: str, fn):
        calls = self.calls

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        counted.__name__ = name
        counted.__doc__ = getattr(fn, "__doc__", None)
        return counted

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def canary(self) -> bool:
        """One call through the counting path. False when the total moved without a call or did not rise
        by exactly one with it: the counter was patched to stop counting, to report a fixed number, or to
        rise on its own. The probe is then forgotten. (An offset added to every read passes, and gains
        nothing: the judge only ever uses differences of the total.)"""
        try:
            before = self.total
            idle = self.total - before
            self._probe()
            seen = self.total - before
            self.calls[self.PROBE] = self.calls.get(self.PROBE, 1) - 1
        except Exception:
            return False
        return idle == 0 and seen == 1


def global_flags() -> dict:
    """Process-wide numerics a candidate could flip to make its own (or library) math cheaper."""
    flags = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "flush_denormal": None,
    }
    matmul = torch.backends.cuda.matmul
    for name in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        flags[f"cuda_matmul_{name}"] = getattr(matmul, name, None)
    return flags


def thread_idents() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def child_pids() -> set[int]:
    """Live children of this process (zombies excluded)."""
    me = str(os.getpid())
    out = set()
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as fh:
                out.update(int(p) for p in fh.read().split())
        except OSError:
            continue
    return out


def poison_free_memory(device: torch.device, nbytes: int) -> None:
    """Fill memory the caching allocator will hand out next with NaN bits (0xFF...).

    An output from `empty` that is never fully written then reads as NaN instead of a result a
    previous call happened to leave behind.
    """
    if device.type != "cuda" or nbytes <= 0:
        return
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(nbytes, int(free * 0.5), 16 << 30)
    if nbytes < (1 << 20):
        return
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return
    block.fill_(0xFF)
    del block  # back to the allocator's cache, poisoned


_CUDART = None


def _cudart():
    """The CUDA runtime torch already loaded. Called when a CUDA worker opens its device, before any
    candidate code: `ctypes.util.find_library` runs `ldconfig -p` (and gcc) as child processes, which the
    candidate's seccomp filter kills, so it is only the last resort and never needed where torch loaded
    libcudart (it shows in /proc/self/maps)."""
    global _CUDART
    if _CUDART is None:
        _CUDART = False
        names = []
        try:
            with open("/proc/self/maps") as fh:
                names = [line.split()[-1] for line in fh if "libcudart" in line]
        except OSError:
            pass
        for name in [*dict.fromkeys(names), "libcudart.so.13", "libcudart.so.12", None]:
            if name is None:
                name = ctypes.util.find_library("cudart")
                if not name:
                    break
            try:
                lib = ctypes.CDLL(name)
                lib.cudaCtxResetPersistingL2Cache.restype = ctypes.c_int
                _CUDART = lib
                break
            except (OSError, AttributeError):
                continue
    return _CUDART or None


def resolve_cuda_runtime() -> bool:
    return _cudart() is not None


def reset_persisting_l2() -> bool:
    """Drop lines a candidate pinned with an access-policy window, which survive a plain flush."""
    lib = _cudart()
    if lib is None:
        return False
    return lib.cudaCtxResetPersistingL2Cache() == 0


def peak_bandwidth_bytes_per_s(device: torch.device) -> float:
    """Theoretical DRAM bandwidth, from the device's memory clock and bus width."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return clock_khz * 1e3 * 2 * bus_bits / 8
    return 5.0e12  # above any current HBM part: errs towards never flagging honest code



# --- names bound before candidate code loads ---------------------------------------------------------------------
# Judge IX: an extension that reached Python rebound the timer's module-level `spot` and `offload_spots` and
# `TimerRole._begin`, so that the spot-checked outputs were filled in between batches. A timer made in a worker
# (before any candidate code runs: the role object is made before its set-up loads the extension) pins its methods
# on itself, each reading its module's names from a private copy of that module's globals taken then, and the
# modules it names that decide and keep spot checks (batches.py) as private copies too. Rebinding a module's or a
# class's attribute afterwards changes what other code sees, never what this timer calls. What this does not stop
# is code that walks to the objects themselves (the instance, a function's __globals__ or __closure__): that needs
# Python, which the object scan refuses in the agent's code (sandbox/scan/object_scan.py).


def _rebound(fn: types.FunctionType, names: dict) -> types.FunctionType:
    copy = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


def private_names(module: types.ModuleType, views: dict[str, types.SimpleNamespace]) -> dict:
    """A copy of the module's globals as they are now, its own functions rebound to read that copy, and each module
    it names that is in `views` replaced by that view."""
    names = dict(vars(module))
    for key, value in vars(module).items():
        if isinstance(value, types.ModuleType) and value.__name__ in views:
            names[key] = views[value.__name__]
    for key, value in vars(module).items():
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            names[key] = _rebound(value, names)
    return names


def sealed_views(*modules: types.ModuleType) -> dict[str, types.SimpleNamespace]:
    """Each module (in import order: one may name the ones before it) as a namespace of its private names."""
    views: dict[str, types.SimpleNamespace] = {}
    for module in modules:
        names = private_names(module, views)
        views[module.__name__] = types.SimpleNamespace(**{k: v for k, v in names.items() if not k.startswith("__")})
    return views


def pin_methods(obj: object, views: dict[str, types.SimpleNamespace]) -> None:
    """The instance's methods (its class's and its bases', as they are now) bound on the instance itself, each
    reading a private copy of its own module's names (with `views` for the modules they name)."""
    import sys

    names: dict[str, dict] = {}
    for cls in reversed(type(obj).__mro__[:-1]):
        module = sys.modules[cls.__module__]
        own = names.setdefault(cls.__module__, private_names(module, views))
        for attr, member in vars(cls).items():
            if isinstance(member, types.FunctionType) and not (attr.startswith("__") and attr.endswith("__")):
                obj.__dict__[attr] = types.MethodType(_rebound(member, own), obj)
