"""The `trace` worker role: what a task computes, as the ATen ops its forward dispatches.

Decontamination (`synth.signature`) compares tasks by computation, not by text, so it needs each
task's forward as a dataflow graph. This role builds the task and its inputs on the meta device
(shapes and dtypes without data: KernelBench's gigabyte inputs cost nothing) and runs forward under a
TorchDispatchMode, which sees every op below autograd, after composite ops have decomposed (nn.Linear,
F.linear and `x @ w.t()` all arrive as t/addmm/mm). Each op is recorded with its schema's argument
names, every tensor argument as a reference to the op that produced it or to a leaf (a forward input,
a parameter or buffer, or a constant), and its outputs' shapes and dtypes. Canonicalizing and comparing
happen in the caller, on this plain JSON, so a change of rules needs no new trace.

A task that cannot run on meta (`.item()`, data-dependent shapes) is retried on the CPU with real
data when its inputs and parameters are small. One process traces many tasks (the 250 KernelBench
problems are traced in a few processes, not 250): each task gets its own module name and a wall-clock
alarm, and torch's namespaces are restored after each task so one task's monkeypatching cannot
change the next one's trace. Still untrusted code: the process runs with the worker's resource limits.
"""

from __future__ import annotations

import math
import signal
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sandbox.worker.inputs import load_module, make_init_inputs, make_inputs, seed_everything
from sandbox.worker.protocol import describe

MAX_NODES = 3000  # KernelBench's largest non-recurrent problem (DenseNet201) dispatches about 500
CPU_FALLBACK_BYTES = 64 << 20  # inputs plus parameters small enough to run for real on a shared CPU


# BaseException: a task's `except Exception` must not swallow the end of its own time or trace
class _Timeout(BaseException):
    pass


class _Full(BaseException):
    pass


def _dtype(t: torch.Tensor) -> str:
    if t.is_complex():
        return "c"
    if t.is_floating_point():
        return "f"
    return "b" if t.dtype == torch.bool else "i"


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


class Recorder(TorchDispatchMode):
    """Every op forward dispatches, as nodes of a dataflow graph over tensor identities."""

    def __init__(self, roles: dict[int, str]):
        super().__init__()
        self.roles = roles
        self.refs: dict[int, dict] = {}  # id(tensor) -> {"node": i, "out": j} or {"leaf": i}
        self.keep: list = []  # every tensor seen stays alive, so no id() is reused mid-trace
        self.leaves: list[dict] = []
        self.nodes: list[dict] = []

    def ref(self, t: torch.Tensor) -> dict:
        r = self.refs.get(id(t))
        if r is None:
            # no recorded op produced it: a forward input, a parameter or buffer, or a constant
            r = self.refs[id(t)] = {"leaf": len(self.leaves)}
            self.leaves.append({"role": self.roles.get(id(t), "const"), "shape": list(t.shape), "dtype": _dtype(t)})
            self.keep.append(t)
        return r

    def value(self, v):
        if isinstance(v, torch.Tensor):
            return {**self.ref(v), "shape": list(v.shape), "dtype": _dtype(v)}
        if isinstance(v, list | tuple):
            return {"list": [self.value(x) for x in v]}
        if v is None or isinstance(v, bool | int | str):
            return {"v": v}
        if isinstance(v, float):
            return {"v": v if math.isfinite(v) else repr(v)}
        return {"v": str(v)}  # dtypes, devices, layouts, memory formats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if len(self.nodes) >= MAX_NODES:
            raise _Full()  # a recurrent net unrolled over a long sequence: the rest repeats what is recorded
        schema = func._schema
        named: dict = {}
        for a, v in zip(schema.arguments, args, strict=False):
            named[a.name] = self.value(v)
        for k, v in kwargs.items():
            named[k] = self.value(v)
        idx = len(self.nodes)
        outs = out if isinstance(out, list | tuple) else [out]
        node = {"op": func._overloadpacket.__name__, "overload": func._overloadname, "args": named,
                "view": bool(func.is_view), "out": []}
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                node["out"].append({"shape": list(o.shape), "dtype": _dtype(o)})
                self.refs[id(o)] = {"node": idx, "out": j}
                self.keep.append(o)
            else:
                node["out"].append(None)
        # in-place and out= ops: the written argument now holds this op's result
        for a, v in zip(schema.arguments, args, strict=False):
            if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
                self.refs[id(v)] = {"node": idx, "out": 0}
        self.nodes.append(node)
        return out


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []


def _build(mod, device: torch.device) -> torch.nn.Module:
    init = make_init_inputs(mod, 0, device)
    seed_everything(0)
    with torch.device(device):
        model = mod.Model(*init)
    return model.eval()


def _trace_on(mod, model: torch.nn.Module, device: torch.device) -> dict:
    inputs = make_inputs(mod, 1, device)
    roles = {id(p): "param" for p in model.parameters()}
    roles.update({id(b): "buffer" for b in model.buffers()})
    roles.update({id(t): "input" for t in _flat_tensors(inputs)})
    rec = Recorder(roles)
    # every input gets a leaf first, in input order: an input forward ignores is part of the signature too
    inputs_refs = [rec.ref(t) for t in _flat_tensors(inputs)]
    try:
        with torch.no_grad(), rec:
            out = model(*inputs)
        outputs = [rec.refs.get(id(t)) or rec.ref(t) for t in _flat_tensors(out)]
    except _Full:
        outputs = None  # cut short: the caller keeps every recorded op
    return {"nodes": rec.nodes, "leaves": rec.leaves, "outputs": outputs, "inputs": inputs_refs,
            "truncated": outputs is None, "device": device.type}


_NAMESPACES = (torch, torch.nn.functional, torch.Tensor, torch.nn.Module)


def _snapshot() -> list[dict]:
    return [dict(vars(ns)) for ns in _NAMESPACES]


def _restore(saved: list[dict]) -> bool:
    """Put back what a task replaced in torch's namespaces, and remove what it added to torch.Tensor and
    nn.Module (an `__add__` of its own); True when it had changed anything. Names added to the modules
    stay: torch itself adds submodules there as they are imported."""
    changed = False
    for ns, before in zip(_NAMESPACES, saved, strict=True):
        now = vars(ns)
        for k, v in before.items():
            if now.get(k, _MISSING) is not v:
                changed = True
                try:
                    setattr(ns, k, v)
                except (AttributeError, TypeError):
                    pass
        if isinstance(ns, type):
            for k in [k for k in now if k not in before]:
                changed = True
                try:
                    delattr(ns, k)
                except (AttributeError, TypeError):
                    pass
    return changed


_MISSING = object()


def _alarm(signum, frame):
    raise _Timeout()


class TraceRole:
    def trace(self, tasks: list[str], timeout_s: float = 60.0):
        """Trace each task file in turn: {"results": [{"ok": True, "trace": ...} or {"ok": False, "error": ...}]}."""
        from sandbox.worker.startup import CONFINEMENT, confine_task

        confine_task("trace", list(tasks))  # before any task's code is loaded: reads, no new processes, memory
        notes = CONFINEMENT["limits"]
        # torch rebinds a few of its own names on first use of the meta kernels (torch.manual_seed, once
        # torch._refs is imported): done before the snapshot, so no task is blamed for it
        seed_everything(0)
        _ = 1 - torch.zeros(2, device="meta").float().sum()
        saved = _snapshot()
        old = signal.signal(signal.SIGALRM, _alarm)
        results = []
        try:
            for i, path in enumerate(tasks):
                results.append(self._one(path, f"cuda_agent_trace_{i}", timeout_s))
                if _restore(saved):
                    results[-1]["note"] = "the task changed torch's namespaces (restored for the next task)"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        return {"results": results, "limits": notes}

    def _one(self, path: str, name: str, timeout_s: float) -> dict:
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, timeout_s, 1.0)  # and again each second, for a task that caught it
        try:
            tr = self._trace(load_module(path, name))
            return {"ok": True, "trace": tr, "seconds": round(time.perf_counter() - t0, 4)}
        except _Timeout:
            return {"ok": False, "error": f"tracing did not finish within {timeout_s:.0f} s"}
        except BaseException as e:  # one task's failure is its own; the batch goes on
            return {"ok": False, "error": describe(e, 1200)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _trace(self, mod) -> dict:
        meta, cpu = torch.device("meta"), torch.device("cpu")
        try:
            model = _build(mod, meta)
        except Exception:
            # data-dependent set-up (`.item()` in __init__): built for real, then its weights dropped
            model = _build(mod, cpu).to(meta)
        try:
            return _trace_on(mod, model, meta)
        except Exception as meta_error:
            # meta cannot run data-dependent forward code; real data can, where it is small enough to be cheap
            size = _tensor_bytes(_flat_tensors(make_inputs(mod, 1, meta))) + _tensor_bytes(list(model.parameters()))
            if size > CPU_FALLBACK_BYTES:
                raise RuntimeError(f"not traceable on the meta device ({type(meta_error).__name__}: {meta_error}), "
                                   f"and too large ({size >> 20} MiB) to run on the CPU") from None
            return _trace_on(mod, _build(mod, cpu), cpu)
