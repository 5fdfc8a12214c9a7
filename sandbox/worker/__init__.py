"""The code that runs inside isolated worker processes.

Started by `sandbox.confinement.processes.Worker` as `python -P -m sandbox.worker ROLE READ_FD WRITE_FD`, it
serves JSON-line requests on private pipes (the candidate's prints go to a log, not the protocol).

Roles:
  reference  builds the task's Model, computes reference outputs, and compares the candidate's
             outputs (shared by CUDA IPC handle or raw file, never by pickle) against them. The
             reference outputs never leave this process.
  candidate  imports the built extension and model_new.py, runs ModelNew on the same seeded
             inputs while recording the PyTorch ops it dispatches, and exports its outputs.
  timer      times the reference (eager and torch.compile) or the candidate, and lists top kernels.
  baseline   a timer of the reference alone (baseline_timer.py): never runs candidate code, so it may
             compile with the judge's persistent Inductor/Triton cache (see sandbox.confinement.filesystem).
  eager      the reference in a profile (eager.py): timed as eager in rounds paired with the candidate's,
             and the reference its spot-checked timed calls are compared against.
  check      executes a task file on the meta device to validate it cheaply.
  synth_probe  runs a candidate training task for task synthesis (synth_probe.py): determinism, input
             sensitivity, finiteness, eager time, torch.compile agreement.

Modules: `startup` (network isolation, torch import, device), `protocol` (the serve loop, Reply),
`inputs`, `exchange` (exporting and rebuilding tensors), `compare`, `recorder` (the op allow-list),
`kernel_audit` (the CUDA kernel audit of the timed calls and its canary), `kernel_names` (kernel
identifiers), one module per role, and `__main__`. This package imports only the standard library and torch;
`__init__` imports nothing, so that `startup` runs first. The judge's side imports `recorder` and
`kernel_names`, which import torch only inside functions or not at all: the judge's process never imports
torch (tests/test_judge_imports.py).
"""
