"""The candidate role: imports the built extension and model_new.py, runs ModelNew under the guards.

It runs on the same seeded inputs as the reference, records the PyTorch ops it dispatches, and
exports its outputs for the reference process to compare.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys

import torch

from sandbox.worker import guards, op_audit
from sandbox.worker.exchange import export_tree, largest_tensor_bytes
from sandbox.worker.inputs import build_reference, load_module, make_init_inputs, make_inputs, seed_everything
from sandbox.worker.protocol import CAPTURED, Reply, classify, describe, task_reason
from sandbox.worker.recorder import MAX_SCALAR_READS, RecorderTampered, canary, make_recorder, reference_ops
from sandbox.worker.startup import confine_candidate, open_device, setup_step, startup_times, synchronize


def check_counter(counter: guards.CallCounter | None) -> None:
    if counter is not None and not counter.canary():
        raise Reply("audit_tampered", "the extension call counter missed a call the judge made through it: the "
                    "call accounting was patched")


class CandidateRole:
    def __init__(self):
        self.keep: list = []
        # the first input set's inputs, kept by `run(repeat=True)` for `again`
        self.pending: tuple | None = None
        self.counter: guards.CallCounter | None = None
        self.op_canary: dict | None = None

    def setup(self, task: str, device: str, init_seed: int, extension: str | None, model_new: str, shm_dir: str,
              record_ops: bool = True, audit_ops: bool = False, own_kernels: list | None = None,
              before_candidate=None):
        """`before_candidate(self)`, when given, runs once the reference is built and before any candidate
        code: the timer calibrates its kernel audit's canary there. `audit_ops` adds the op audit below
        Python (op_audit.py) around each recorded forward; verify asks for it, the timer has its own."""
        self.device = open_device(device)
        self.shm_dir = shm_dir
        self.record_ops = record_ops
        # before the task too: a task's reference is code a client may have written, like the candidate's
        confine_candidate(shm_dir, extension, model_new, task, self.device.type == "cuda")
        step = setup_step()
        try:  # the task's own code, before any of the candidate's: what fails here is the task's fault
            self.mod = load_module(task, "cuda_agent_task")
            init_inputs = make_init_inputs(self.mod, init_seed, self.device)
            reference = build_reference(self.mod, init_inputs, init_seed, self.device)
            state = reference.state_dict()
            flags_before = guards.global_flags()
            # the recorder's canary: the reference's own ops, recorded before any candidate code runs
            self.reference = reference.eval()
            step("task")
            self.canary_inputs = make_inputs(self.mod, init_seed, self.device)
            self.canary_ops = reference_ops(self.reference, self.canary_inputs)
        except Reply:
            raise
        except Exception as e:
            raise Reply(task_reason(e), "the task's own Model failed on its own inputs (the task is "
                        "at fault, not ModelNew): " + describe(e)) from e
        self.op_canary = op_audit.calibrate(self.device) if audit_ops and record_ops else None
        step("canaries")
        self.own_kernels = own_kernels or []
        if before_candidate is not None:
            before_candidate(self)
        if extension is not None:  # a self-check of the reference needs no extension
            try:
                loader = importlib.machinery.ExtensionFileLoader("cuda_extension", extension)
                spec = importlib.util.spec_from_file_location("cuda_extension", extension, loader=loader)
                ext = importlib.util.module_from_spec(spec)
                loader.exec_module(ext)
            except Exception as e:
                raise Reply("import_error", "the built extension failed to load (an undefined symbol usually means "
                            "a function declared but never defined, or a launcher missing from a .cu): "
                            + describe(e)) from e
            # counted before model_new.py can take references to the functions
            self.counter = guards.CallCounter(ext)
            sys.modules["cuda_extension"] = ext
        step("extension")
        try:
            mn = load_module(model_new, "model_new")
        except Exception as e:
            raise Reply("import_error", "model_new.py failed to import: " + describe(e)) from e
        if not isinstance(getattr(mn, "ModelNew", None), type):
            raise Reply("import_error", "model_new.py does not define class ModelNew")
        if extension is not None and issubclass(mn.ModelNew, self.mod.Model):
            raise Reply("delegation", "ModelNew subclasses the reference Model; write it as its own nn.Module")
        try:
            seed_everything(init_seed)
            with torch.device(self.device):
                model = mn.ModelNew(*init_inputs)
            model = model.to(self.device)
        except Exception as e:
            raise Reply(classify(e, "init_error"), "ModelNew(*get_init_inputs()) failed: " + describe(e)) from e
        if not isinstance(model, torch.nn.Module):
            raise Reply("init_error", "ModelNew must be a torch.nn.Module")
        if extension is not None and any(isinstance(m, self.mod.Model) for m in model.modules()):
            raise Reply("delegation", "ModelNew holds an instance of the reference Model; all compute must be yours")
        try:
            model.load_state_dict(state, strict=True)
        except Exception as e:
            raise Reply("state_dict_mismatch", "ModelNew must hold the same parameters and buffers as Model "
                        "(same names and shapes) so it can take Model's state_dict: " + str(e)[:2000]) from e
        self.model = model.eval()
        self.flags = flags_before
        self._check_flags("importing model_new.py and building ModelNew")
        del state
        step("model")
        return startup_times()

    def canary(self, recorder) -> None:
        canary(recorder, self.reference, self.canary_inputs, self.canary_ops)

    def _check_flags(self, when: str) -> None:
        now = guards.global_flags()
        changed = {k: (self.flags[k], v) for k, v in now.items() if self.flags.get(k) != v}
        if changed:
            what = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            raise Reply("global_state_changed", f"{when} changed process-wide numerics ({what}); leave PyTorch's "
                        "global settings alone")

    def forward(self, inputs: list, record: bool):
        """One guarded call of ModelNew.forward. Returns (output, forbidden op counts)."""
        recorder = make_recorder()() if record else None
        threads = guards.thread_idents()
        children = guards.child_pids()
        calls = self.counter.total if self.counter else 0
        try:
            with torch.no_grad():
                if recorder is not None:
                    audit = (op_audit.OpAudit(self.device, self.op_canary, self.own_kernels)
                             if self.op_canary is not None else None)
                    with audit or contextlib.nullcontext():
                        with recorder:
                            out = self.model(*inputs)
                            from torch.utils._python_dispatch import _get_current_dispatch_mode

                            if _get_current_dispatch_mode() is not recorder:
                                raise Reply("dispatch_tampered", "the forward removed the judge's op recorder "
                                            "from the dispatch stack")
                        synchronize(self.device)
                        if audit is not None:
                            audit.canary()
                    if audit is not None:
                        audit.verdict()
                    if recorder.scalar_reads > MAX_SCALAR_READS:
                        raise Reply("torch_op_used", f"ModelNew.forward read {recorder.scalar_reads} tensor values into "
                                    f"Python (.item(), float(t); at most {MAX_SCALAR_READS} a call): arithmetic on "
                                    "Python numbers is compute outside your kernels")
                    try:  # after the forward: a recorder patched by it sees nothing
                        self.canary(recorder)
                    except RecorderTampered as e:
                        raise Reply("dispatch_tampered", f"{e}: the op recorder was patched") from None
                    except Exception as e:  # the task's Model, run again as the canary: its OOM is the task's code's
                        if classify(e, "") != "oom":  # (correctness/oom.py checks it against the task alone)
                            raise
                        raise Reply("reference_oom", "the task's own Model ran out of memory as the op recorder's "
                                    "canary after ModelNew.forward: " + describe(e)) from e
                else:
                    out = self.model(*inputs)
            synchronize(self.device)
        except Reply:
            raise
        except Exception as e:
            raise Reply(classify(e, "runtime_error"), "ModelNew.forward raised: " + describe(e)) from e
        self._check_flags("ModelNew.forward")
        check_counter(self.counter)
        if guards.thread_idents() - threads or guards.child_pids() - children:
            raise Reply("background_work", "ModelNew.forward left threads or processes running after it returned; "
                        "all work must finish inside the call, on the current stream")
        if self.counter is not None and self.counter.total == calls and not (recorder and recorder.forbidden):
            raise Reply("no_kernel_launched", "ModelNew.forward never called a cuda_extension function: the "
                        "output must come from your kernels")
        return out, (dict(recorder.forbidden) if recorder is not None else {})

    def run(self, seed: int, variant: str = "original", repeat: bool = False, shapes: dict | None = None):
        perf = CAPTURED["perf_counter"]
        steps: dict[str, float] = {}
        t = perf()
        self.keep = []
        inputs = make_inputs(self.mod, seed, self.device, variant, shapes)
        synchronize(self.device)
        steps["inputs"], t = perf() - t, perf()
        poison = largest_tensor_bytes(inputs)  # about what an output allocation will ask the cache for
        guards.poison_free_memory(self.device, poison)
        synchronize(self.device)
        steps["poison"], t = perf() - t, perf()
        out, ops = self.forward(inputs, self.record_ops)
        steps["forward"], t = perf() - t, perf()
        result = {"outputs": export_tree(out, self.keep, self.shm_dir, f"out{seed}"), "torch_ops": ops,
                  "steps": steps}
        self.keep.append(out)
        self.pending = None
        if repeat:
            # The second call is a request of its own (`again`), so that each call has the trial's timeout and a
            # forward that never returns is found after one timeout, not two. The inputs go out with the second
            # call's answer: what both calls did to them is what the reference compares.
            self.pending = (inputs, poison, seed)
            synchronize(self.device)
            steps["export"] = perf() - t
            return result
        result["inputs"] = export_tree(list(inputs), self.keep, self.shm_dir, f"in{seed}")
        synchronize(self.device)
        steps["export"] = perf() - t
        return result

    def again(self):
        """The last `run(repeat=True)`'s inputs through ModelNew.forward again: stale memory, partial launches and
        races show up as a different answer."""
        if self.pending is None:
            raise Reply("internal_error", "again: no repeated input set is pending")
        inputs, poison, seed = self.pending
        self.pending = None
        perf = CAPTURED["perf_counter"]
        t = perf()
        guards.poison_free_memory(self.device, poison)
        again, ops = self.forward(inputs, self.record_ops)
        steps = {"forward": perf() - t}
        t = perf()
        result = {"repeat": export_tree(again, self.keep, self.shm_dir, f"again{seed}"), "torch_ops": ops, "steps": steps}
        self.keep.append(again)
        result["inputs"] = export_tree(list(inputs), self.keep, self.shm_dir, f"in{seed}")
        synchronize(self.device)
        steps["export"] = perf() - t
        return result

    def release(self):
        self.keep = []
        self.pending = None
        return {}
