"""The check role: executes a task file on the meta device to validate it cheaply."""

from __future__ import annotations

import torch

from sandbox.worker.exchange import tensor_bytes
from sandbox.worker.inputs import load_module, make_init_inputs, make_inputs
from sandbox.worker.protocol import Reply, describe
from sandbox.worker.startup import confine_task


class CheckRole:
    """Execute a task on the meta device: catches import errors, a missing Model, a raising get_inputs."""

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
                mod.Model(*init_inputs)
        except Exception as e:
            raise Reply("reference_error", f"Model(*get_init_inputs()) raised: {describe(e, 1500)}") from e
        return {"input_bytes": tensor_bytes(inputs), "num_inputs": len(inputs)}
