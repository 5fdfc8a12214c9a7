"""The speed proof's task family: short elementwise chains that eager runs as one kernel per op, and two correct
fused kernels for each that differ in one line, the element a thread handles (straight: consecutive; strided:
32 interleaved columns, about 8x the memory traffic). bench.proofs.speed trains on it; bench.small_kernels
profiles it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.proofs import family as pl  # noqa: E402

# name: (the PyTorch chain, one eager kernel per op; the C++ expression of the fused kernel)
TASKS = {"relu_affine": ("torch.relu(x) * 2.0 + 1.0", "fmaxf(v, 0.0f) * 2.0f + 1.0f"),
         "abs_affine": ("torch.abs(x) * 0.5 - 1.0", "fabsf(v) * 0.5f - 1.0f"),
         "square_shift": ("x * x + 1.0", "v * v + 1.0f"),
         "silu": ("torch.sigmoid(x) * x", "v / (1.0f + expf(-v))"),
         "tanh_residual": ("torch.tanh(x) + x", "tanhf(v) + v"),
         "clamp_scale": ("torch.clamp(x, -1.0, 1.0) * 3.0", "3.0f * fminf(fmaxf(v, -1.0f), 1.0f)")}

# the element a thread (iteration) handles: a permutation of [0, n) either way (n is a multiple of 32 here)
VARIANTS = {"straight": "i", "strided": "(i % (n / 32)) * 32 + i / (n / 32)"}
FAST, SLOW = "straight", "strided"
FASTER = ("faster_than_eager", "faster_than_compile")

CU = '''#include <cuda_runtime.h>
#include <cstdint>

__global__ void op_kernel(const float* x, float* y, int64_t n) {{
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) {{
    const int64_t k = {index};
    float v = x[k];
    y[k] = {expr};
  }}
}}

void launch_op(const float* x, float* y, int64_t n, cudaStream_t stream) {{
  op_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, y, n);
}}
'''

CPP = pl.BINDING_CPU.replace("    float v = xp[i];\n    yp[i] = {expr};",
                             "    const int64_t k = {index};\n    float v = xp[k];\n    yp[k] = {expr};")
assert "{index}" in CPP, "bench.proofs.family's CPU binding changed: the index line is not where it was"

# cheap but complete: three paired rounds, the timing bound, the kernel audit, a spot check; no kernel table
PROFILE = {"target_ms": 100.0, "max_trials": 30, "min_trials": 6, "timing_batches": 3, "warmup_ms": 20.0,
           "spot_checks": 1, "top_kernels": 0}


def files(name: str, variant: str, backend: str) -> dict[str, str]:
    expr, index = TASKS[name][1], VARIANTS[variant]
    if backend == "cuda":
        return {"model_new.py": pl.MODEL_NEW, "kernels/op.cu": CU.format(expr=expr, index=index),
                "kernels/op_binding.cpp": pl.BINDING_CUDA}
    return {"model_new.py": pl.MODEL_NEW, "kernels/op.cpp": CPP.format(expr=expr, index=index)}


def response(name: str, variant: str, backend: str) -> str:
    from training.ppo.warmup import render_solution

    return render_solution(files(name, variant, backend))


def write_tasks(folder: Path, rows: int, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.py").write_text(pl.TASK.format(name=name, torch_expr=TASKS[name][0], rows=rows))


def demonstrations(tasks: dict, backend: str, per_task: int, slow_share: float) -> list[tuple]:
    """(task, response, is it the fast walk): round(per_task * slow_share) of each task's are strided."""
    slow = round(per_task * slow_share)
    return [(task, response(name, SLOW if k < slow else FAST, backend), k >= slow)
            for name, task in tasks.items() for k in range(per_task)]


def classify(text: str, name: str, backend: str) -> str:
    """straight / strided: exactly that variant's text for the task; malformed: anything else (no judge)."""
    for variant in VARIANTS:
        if text == response(name, variant, backend):
            return variant
    return "malformed"
