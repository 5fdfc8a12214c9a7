"""The check role: executes a task file on the meta device to validate it cheaply."""

from __future__ import annotations

import traceback

import torch

from sandbox.worker.exchange import tensor_bytes
from sandbox.worker.inputs import load_module, make_init_inputs, make_inputs
from sandbox.worker.protocol import Reply, describe
from sandbox.worker.startup import confine_task


class CheckRole:
    """Execute a task on the meta device: catches import errors, a missing Model, a raising get_inputs, and a
    forward that raises on the task's own inputs (run again on the CPU where the meta device cannot tell)."""

    def check(self, task: str):
        confine_task("check", [task])
        try:
            mod = load_module(task, "cuda_agent_task")
        except Exception as e:
            raise Reply("reference_error", f"the task does not import: {describe(e, 1500)}") from e
        for name in ("Model", "get_inputs", "get_init_inputs"):
            if not hasattr(mod, name):
                raise Reply("reference_error", f"the task does not define {name}")
        if not (isinstance(mod.Model, type) and issubclass(mod.Model, torch.nn.Module)):
            raise Reply("reference_error", "Model must be a subclass of torch.nn.Module")
        meta = torch.device("meta")
        try:
            init_inputs = make_init_inputs(mod, 0, meta)
        except Exception as e:
            raise Reply("reference_error", f"get_init_inputs() raised: {describe(e, 1500)}") from e
        try:
            inputs = make_inputs(mod, 0, meta)
        except Exception as e:
            raise Reply("reference_error", f"get_inputs() raised: {describe(e, 1500)}") from e
        try:
            with meta:
                model = mod.Model(*init_inputs)
        except Exception as e:
            if _meta_limit(e):  # built from data it reads back (Swin's masks: .item()): the device's limit
                return {"input_bytes": tensor_bytes(inputs), "num_inputs": len(inputs),
                        "forward": f"not run: Model cannot be built on the meta device ({type(e).__name__})"}
            raise Reply("reference_error", f"Model(*get_init_inputs()) raised: {describe(e, 1500)}") from e
        size = tensor_bytes(inputs) + sum(tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
        return {"input_bytes": tensor_bytes(inputs), "num_inputs": len(inputs),
                "forward": _forward(mod, model, inputs, size, task)}


# a forward the meta device could not run is run for real on the CPU up to this size (inputs and weights): seconds
CPU_CHECK_BYTES = 64 << 20


def _forward(mod, model, inputs: list, size: int, task: str) -> str:
    """Where the task's forward ran without raising: "meta" or "cpu"; or why it was not run. A forward that raises
    on the task's own inputs is the task's fault, refused here rather than blamed on a kernel at verify."""
    try:
        with torch.no_grad():
            model(*inputs)
        return "meta"
    except Exception as e:  # noqa: BLE001  (the meta device's limits, or the task's own error: told apart below)
        on_meta = e
    if size > CPU_CHECK_BYTES:
        if _meta_limit(on_meta):
            return f"not run: the meta device cannot run it ({type(on_meta).__name__}) and it is too large for the CPU"
        raise Reply("reference_error", _forward_raised(on_meta, task, "on the meta device"))
    cpu = torch.device("cpu")
    try:
        model = mod.Model(*make_init_inputs(mod, 0, cpu))
        with torch.no_grad():
            model(*make_inputs(mod, 0, cpu))
        return "cpu"
    except Exception as e:  # noqa: BLE001
        if _meta_limit(e):  # a task written for the GPU: its forward cannot run on the CPU either
            return f"not run: the meta device and the CPU cannot run it ({type(e).__name__})"
        raise Reply("reference_error", _forward_raised(e, task, "on the CPU")) from e


def _meta_limit(e: Exception) -> bool:
    """An error the device raised, not the task's code: an op with no kernel there, data read back from a meta
    tensor, CUDA asked for."""
    text = str(e).lower()
    return isinstance(e, NotImplementedError) or any(w in text for w in ("meta", "cuda", "nvidia"))


def _forward_raised(e: Exception, task: str, where: str) -> str:
    line = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == task), None)
    at = f" (the task's line {line.lineno}: {(line.line or '').strip()})" if line is not None else ""
    return (f"the task's own Model.forward raises on its get_inputs() {where}: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}{at}; the task is at fault, not a kernel")
