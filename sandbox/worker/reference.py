"""The reference role: builds the task's Model, computes reference outputs, judges the candidate's.

The reference outputs never leave this process; the candidate's arrive by CUDA IPC handle or raw file.
"""

from __future__ import annotations

import torch

from sandbox.worker.compare import OPENED, compare_tree, open_tensor, queue_warm
from sandbox.worker.exchange import export_local, leaves, tensor_bytes
from sandbox.worker.inputs import build_reference, load_module, make_init_inputs, make_inputs
from sandbox.worker.protocol import Reply, describe, task_reason
from sandbox.worker.startup import confine_task, device_name, open_device, startup_times, synchronize


class ReferenceRole:
    def __init__(self):
        self.model = None
        self.device = None
        self.inputs = None
        self.output = None

    def setup(self, task: str, device: str, init_seed: int, shm_dir: str):
        self.device = open_device(device)
        self.shm_dir = shm_dir
        confine_task("reference", [task])
        try:
            self.mod = load_module(task, "cuda_agent_reference")
            init_inputs = make_init_inputs(self.mod, init_seed, self.device)
            self.model = build_reference(self.mod, init_inputs, init_seed, self.device)
        except Exception as e:
            raise Reply(task_reason(e), "the reference model failed to build: " + describe(e)) from e
        queue_warm(self.device)
        return {"device": str(self.device), "device_name": device_name(self.device), **startup_times()}

    def run(self, seed: int, check_determinism: bool = False, variant: str = "original", shapes: dict | None = None):
        self.inputs = self.output = None
        if self.device.type == "cuda":  # the peak of this set alone: the task's footprint (timing/memory_admission.py)
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.inputs = make_inputs(self.mod, seed, self.device, variant, shapes)
            with torch.no_grad():
                self.output = self.model(*self.inputs)
                if check_determinism:
                    again = self.model(*self.inputs)  # RNG state has moved on: dropout shows up
            synchronize(self.device)
        except Exception as e:
            raise Reply(task_reason(e), "the reference failed on its own inputs: " + describe(e)) from e
        if check_determinism:
            checks: list = []
            local: list = []
            spec = export_local(again, local)
            # far tighter than verify's tolerance, yet above the last-bit noise of atomics in
            # cuDNN/cuBLAS kernels: catches dropout and other randomness, not summation order
            compare_tree("out", self.output, spec, self.device, self.shm_dir, {"default": (1e-5, 1e-5)}, checks, local)
            bad = [c for c in checks if not c.get("ok")]
            if bad:
                raise Reply("nondeterministic_reference", "the reference gives different outputs for the same "
                            "inputs: " + bad[0].get("message", ""))
        finite = all(bool(torch.isfinite(t).all()) for t in leaves(self.output) if t.is_floating_point())
        return {"input_bytes": tensor_bytes(self.inputs), "finite": finite, **self._memory()}

    def _memory(self) -> dict:
        """What this input set took: its outputs' bytes and the process's peak (reserved, as the device sees it; on the
        CPU, where no allocator counts, the model's, inputs' and outputs' bytes, the tests' scripted memory)."""
        out = tensor_bytes(list(leaves(self.output)))
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_reserved(self.device)
        else:
            params = [*self.model.parameters(), *self.model.buffers()] if isinstance(self.model, torch.nn.Module) else []
            peak = tensor_bytes(self.inputs) + out + tensor_bytes(params)
        return {"output_bytes": out, "peak_bytes": int(peak)}

    def compare(self, outputs: dict, inputs: dict, tolerances: dict, repeat: dict | None = None):
        tol = {k: tuple(v) for k, v in tolerances.items()}
        OPENED["s"] = 0.0
        results: list = []
        repeat_results: list = []
        try:
            compare_tree("out", self.output, outputs, self.device, self.shm_dir, tol, results)
            if repeat is not None:
                compare_tree("out", self.output, repeat, self.device, self.shm_dir, tol, repeat_results)
        except Exception as e:
            raise Reply("output_structure", f"could not read the candidate's outputs: {describe(e)}") from e
        mutated = []
        if inputs.get("kind") == "list":
            for i, (ref_in, spec) in enumerate(zip(self.inputs, inputs["items"], strict=False)):
                if not isinstance(ref_in, torch.Tensor) or spec.get("kind") != "tensor":
                    continue
                if spec["shape"] != list(ref_in.shape) or spec["dtype"] != str(ref_in.dtype).removeprefix("torch."):
                    mutated.append(i)
                    continue
                cand = open_tensor(spec, self.device, self.shm_dir)
                same = torch.equal(cand, ref_in) or bool(((cand == ref_in) | (cand.isnan() & ref_in.isnan())).all()) \
                    if ref_in.is_floating_point() else torch.equal(cand, ref_in)
                if not same:
                    mutated.append(i)
        synchronize(self.device)
        self.output = self.inputs = None
        return {"checks": results, "mutated_inputs": mutated, "repeat_checks": repeat_results, "open_s": OPENED["s"]}
