"""The `synth_probe` worker role: run a candidate training task and say whether it is a usable one.

Runs inside an isolated worker (`sandbox.confinement.processes.Worker("synth_probe", ...)`), like the judge's
roles; task synthesis (`synth.filter`) asks it one question per fresh process. Checks, cheapest
first, stopping at the first failure:
  runs        Model builds and forward runs in eval mode (as the judge builds references)
  finite      no NaN or Inf in the outputs
  stochastic  the same inputs under one seed twice, then under another seed: outputs must agree
              (dropout in training mode, sampling, RNG inside forward fail here)
  constant    outputs are not all one value, and differ between two different input sets
              (a kernel returning a constant would pass the judge's comparison otherwise)
  ignores     every tensor input changes the output when only it changes
  time_band   eager time within the band
  compile     torch.compile(fullgraph) runs and matches eager
Differences are judged at the judge's tolerance (atol = rtol = 1e-2 by default): what the judge
cannot tell apart counts as equal.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

import torch

from sandbox.timing.timing_bound import summarize
from sandbox.worker.exchange import leaves
from sandbox.worker.inputs import build_reference, load_module, make_init_inputs, make_inputs, seed_everything
from sandbox.worker.protocol import describe
from sandbox.worker.startup import confine_task, open_device, synchronize


def _close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float, rtol: float) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return False
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x.float(), y.float(), atol=atol, rtol=rtol):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _clone(inputs: list) -> list:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


class Verdict(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ProbeRole:
    """One task per request. A process may be asked for several in turn (`probe_source`, synth.filter's
    `per_worker`): torch.compile's first compilation in a process pays Inductor's own start (its imports, its
    compilers' checks, 5-6 s of a CPU probe's 7-8 s), which the next tasks then skip. Synthesized tasks are the
    project's own compositions, not a policy's code; what one task leaves behind is cleared before the next
    (`_reset`), and the filter retries in a fresh process any drop that a previous task could have caused."""

    served = 0
    eager_runs = 0

    def probe(self, task: str, device: str, band_ms: list[float], atol: float = 1e-2, rtol: float = 1e-2,
              compile: bool = True, fullgraph: bool = True, timing_trials: int = 5):
        metrics: dict = {"served_before": self.served}
        dev = open_device(device)
        # once per process: a later task's file is in this process's scratch, which the rules leave readable
        confine_task("synth_probe", [task], compiles=compile)
        self.served += 1
        try:
            self._probe(task, dev, band_ms, atol, rtol, compile, fullgraph, timing_trials, metrics)
        except Verdict as v:
            return {"status": "dropped", "reason": v.reason, "detail": v.detail[:2000], "metrics": metrics}
        finally:
            metrics["reusable"] = _reset(dev)
        return {"status": "kept", "metrics": metrics}

    def probe_source(self, source: str, device: str, band_ms: list[float], **kw):
        """`probe` of a task given as its source, written to this process's scratch first."""
        path = os.path.join(os.environ.get("CUDA_AGENT_SCRATCH") or tempfile.gettempdir(),
                            f"synth_task_{self.served}.py")
        with open(path, "w") as f:
            f.write(source)
        return self.probe(path, device, band_ms, **kw)

    def _run(self, model, inputs: list, seed: int, device, readings: list[float] | None = None) -> list[torch.Tensor]:
        """One forward on a copy of `inputs`; with `readings`, its milliseconds appended (the call and its device
        work, not the copies around it)."""
        seed_everything(seed)
        with torch.no_grad():
            args = _clone(inputs)
            synchronize(device)
            t0 = time.perf_counter()
            out = model(*args)
            synchronize(device)
            if readings is not None:
                readings.append((time.perf_counter() - t0) * 1e3)
        self.eager_runs += 1
        return [t.detach().clone() for t in leaves(out)]

    def _probe(self, task, device, band_ms, atol, rtol, compile, fullgraph, trials, metrics) -> None:
        # the checks' own forwards after the first (which pays lazy init and autotuning) are the eager time's
        # readings, topped up to `trials`: a task of 300 ms a call ran a dozen forwards, half of them only to be
        # timed, and such tasks took 38% of the set's probe seconds (docs/history.md, Synthesis)
        readings: list[float] = []
        self.eager_runs = 0
        try:
            mod = load_module(task, f"cuda_agent_synth_task_{self.served}")
            model = build_reference(mod, make_init_inputs(mod, 0, device), 0, device)
            inputs = make_inputs(mod, 1, device)
            other = make_inputs(mod, 2, device)
            out = self._run(model, inputs, 100, device)
        except Exception as e:
            raise Verdict("eager_failed", describe(e, 1500)) from None
        if not out:
            raise Verdict("no_tensor_output", "forward returned no tensor")
        if not all(torch.isfinite(t).all() for t in out if t.is_floating_point() or t.is_complex()):
            raise Verdict("nan_inf", "the outputs hold NaN or Inf")
        if not _close(out, self._run(model, inputs, 100, device, readings), atol, rtol):
            raise Verdict("stochastic", "two runs with the same inputs and seed differ")
        if not _close(out, self._run(model, inputs, 101, device, readings), atol, rtol):
            raise Verdict("stochastic", "the outputs depend on the random seed (an RNG inside forward)")
        if all(t.numel() <= 1 or _close([t], [t.flatten()[0].expand_as(t)], atol, rtol) for t in out):
            raise Verdict("constant_output", "every output element is the same value")
        if _close(out, self._run(model, other, 100, device, readings), atol, rtol):
            raise Verdict("constant_output", "two different input sets give the same outputs")
        tensor_idx = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        if len(tensor_idx) > 1:
            for i in tensor_idx:
                mixed = list(inputs)
                mixed[i] = other[i]
                if _close(out, self._run(model, mixed, 100, device, readings), atol, rtol):
                    raise Verdict("ignores_input", f"changing input {i} alone does not change the outputs")
        metrics["eager_ms"] = ms = self._time(model, inputs, device, trials, readings)
        metrics["eager_runs"] = self.eager_runs
        lo, hi = band_ms
        if not lo <= ms <= hi:
            raise Verdict("time_band", f"eager time {ms:.3f} ms is outside the band [{lo}, {hi}] ms")
        metrics["output_shapes"] = [list(t.shape) for t in out]
        if compile:
            t0 = time.perf_counter()
            try:
                compiled = torch.compile(model, fullgraph=fullgraph)
                got = self._run(compiled, inputs, 100, device)
            except Exception as e:
                raise Verdict("compile_failed", describe(e, 1500)) from None
            metrics["compile_s"] = time.perf_counter() - t0
            if not _close(out, got, atol, rtol):
                raise Verdict("compile_mismatch", "torch.compile's outputs differ from eager's")

    def _time(self, model, inputs: list, device, trials: int, readings: list[float]) -> float:
        """The median of the checks' readings and of as many more forwards as make `trials`."""
        times = list(readings)
        for _ in range(max(1, trials) - len(times)):
            self._run(model, inputs, 100, device, times)
        return summarize(times)["median_ms"]



def _reset(device) -> bool:
    """What a task leaves in the process, cleared for the next one: its module, compiled graphs, device memory,
    and the global settings a module could change on import. False when the process should serve no other task
    (the device is in an error state)."""
    import torch._dynamo

    for name in [n for n in sys.modules if n.startswith("cuda_agent_synth_task")]:
        del sys.modules[name]
    try:
        torch._dynamo.reset()
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    except Exception:  # a sticky CUDA error, say: this task's verdict stands, the process serves no other
        return False
    return True
