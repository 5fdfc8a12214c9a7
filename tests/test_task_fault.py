"""A task whose own forward raises is the task's fault: `init`'s check runs the forward (on the meta device, or
on the CPU where the meta device cannot tell) and refuses the task; at verify the failure is reference_error,
never the candidate's runtime_error."""

import shutil

import pytest
from test_cli import cli, one_line_error

from conftest import set_variant
from sandbox.correctness.taskcheck import check_task
from tasks import TaskError, load_task

TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x):
{forward}


def get_inputs():
    return [torch.randn({rows}, {features})]


def get_init_inputs():
    return [{features}]
"""
# x is rows x 256, the weight 3 x 256: the task's own matmul cannot run
SHAPES_WRONG = "        return x @ torch.ones(3, 256, device=x.device) + self.bias"
# reads data back: the meta device cannot run it, the CPU can
READS_DATA = "        return torch.nn.functional.silu(x) + self.bias * float(x.abs().sum() > 0)"


def task_file(tmp_path, forward: str, rows: int = 64, features: int = 256, name: str = "task"):
    path = tmp_path / f"{name}.py"
    path.write_text(TASK.format(forward=forward, rows=rows, features=features))
    return path


def test_init_refuses_a_task_whose_forward_raises(tmp_path):
    line = one_line_error(cli("init", task_file(tmp_path, SHAPES_WRONG), tmp_path / "ws", "--backend", "cpu"))
    assert "the task's own Model.forward raises on its get_inputs()" in line
    assert "mat1 and mat2 shapes cannot be multiplied" in line and "the task's line 11: return x @ torch.ones" in line
    assert not (tmp_path / "ws").exists()


def test_forward_the_meta_device_cannot_run_is_run_on_the_cpu(tmp_path):
    assert check_task(load_task(str(task_file(tmp_path, READS_DATA))))["forward"] == "cpu"
    assert check_task(load_task("example/swish_bias_large"))["forward"] == "meta"
    # built from data read back (KernelBench's Swin models): not buildable on the meta device, not refused for it
    reads_in_init = task_file(tmp_path, READS_DATA, name="reads_in_init")
    reads_in_init.write_text(reads_in_init.read_text().replace(
        "super().__init__()", "super().__init__()\n        self.k = int(torch.ones(1).sum().item())"))
    assert check_task(load_task(str(reads_in_init)))["forward"] == "not run: Model cannot be built on the meta device " \
        "(RuntimeError)"
    # too large for the CPU and the meta device cannot run it: not refused for what the check cannot tell
    big = task_file(tmp_path, READS_DATA, rows=65536, name="big")
    assert check_task(load_task(str(big)))["forward"].startswith("not run: the meta device cannot run it")
    # too large for the CPU, and its error is its own (shapes): refused from the meta device's run alone
    with pytest.raises(TaskError, match="Model.forward raises on its get_inputs\\(\\) on the meta device"):
        check_task(load_task(str(task_file(tmp_path, SHAPES_WRONG, rows=65536, name="big_wrong"))))


def test_a_reference_that_raises_at_verify_is_reference_error(tmp_path, built_cpu_workspace):
    """Where the check was skipped (init --no-check), the reference's failure is still not the candidate's."""
    from sandbox.api import init_workspace
    from sandbox.config import VerifyConfig
    from sandbox.correctness.verify import verify_workspace
    from sandbox.workspace import Workspace

    ws, _ = init_workspace(str(task_file(tmp_path, SHAPES_WRONG)), tmp_path / "ws", "cpu", check=False)
    for part in ("kernels", "build"):  # the small task's built extension: its ModelNew is never reached
        shutil.copytree(built_cpu_workspace / part, ws.root / part, symlinks=True, dirs_exist_ok=True)
    set_variant(ws.root, "correct")
    v = verify_workspace(Workspace(ws.root), VerifyConfig(trials=1))
    assert v.reason == "reference_error", v.message
    assert v.message.startswith("the task's own Model failed on its own inputs (the task is at fault, not ModelNew)")
    assert "mat1 and mat2 shapes cannot be multiplied" in v.message
