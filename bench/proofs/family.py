"""The proofs' task family: eight elementwise operators as KernelBench-style tasks, their expert responses, the
demonstrations a tiny model is fine-tuned on, and the offline diagnostic of what a policy writes.

Each expert response is one text for every task (generic names: op_kernel, launch_op, op_forward, register_op)
except one line, the operator's expression; so a policy has exactly one thing to learn per task. The proofs
(learns, speed, repair, stages) and several benchmarks (judge_throughput, small_kernels, ...) build on it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# (the PyTorch expression of the task, the C++ expression of its kernel). Each C++ expression starts
# with a different token, so the choice of expression is one token and what follows it is fixed:
# with shared first tokens (relu as `v > 0.0f ? v : 0.0f`, square as `v * v`), a step that pushes
# down two wrong expressions at once also pushes their common prefix's continuations into garbage
# (seen on CPU: `yp[i] = v = v;`). sigmoid is written through tanhf (sigmoid(v) = 0.5 + 0.5 tanh(v/2)).
OPS = {"relu": ("torch.relu(x)", "(v > 0.0f) * v"), "abs": ("torch.abs(x)", "fabsf(v)"),
       "neg": ("torch.neg(x)", "-v"), "square": ("x * x", "v * v"),
       "sigmoid": ("torch.sigmoid(x)", "0.5f + 0.5f * tanhf(0.5f * v)"), "tanh": ("torch.tanh(x)", "tanhf(v)"),
       "double": ("x * 2.0", "2.0f * v"), "add_one": ("x + 1.0", "1.0f + v")}

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Elementwise {name}."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return {torch_expr}


def get_inputs():
    return [torch.randn({rows}, 1024)]


def get_init_inputs():
    return []
'''

# The expert solution is the same text for every task except one line, the expression: generic names
# (op_kernel, launch_op, op_forward, register_op) keep the task's name out of the response, so the
# only thing the policy has to get right per task is which of the eight expressions it writes.
MODEL_NEW = '''import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def forward(self, x):
        return cuda_extension.op_forward(x)
'''

CU = '''#include <cuda_runtime.h>
#include <cstdint>

__global__ void op_kernel(const float* x, float* y, int64_t n) {{
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) {{
    float v = x[i];
    y[i] = {expr};
  }}
}}

void launch_op(const float* x, float* y, int64_t n, cudaStream_t stream) {{
  op_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, y, n);
}}
'''

BINDING_CUDA = '''#include "binding_registry.h"

#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

void launch_op(const float* x, float* y, int64_t n, cudaStream_t stream);

static at::Tensor op_forward(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "x must be a contiguous CUDA tensor");
  at::Tensor y = at::empty_like(x);
  launch_op(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), c10::cuda::getCurrentCUDAStream());
  return y;
}

static void register_op(pybind11::module& m) { m.def("op_forward", &op_forward); }

REGISTER_BINDING(op, register_op);
'''

BINDING_CPU = '''#include "binding_registry.h"

#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>

static at::Tensor op_forward(const at::Tensor& x) {{
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t n = x.numel();
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {{
    float v = xp[i];
    yp[i] = {expr};
  }}
  return y;
}}

static void register_op(pybind11::module& m) {{ m.def("op_forward", &op_forward); }}

REGISTER_BINDING(op, register_op);
'''

SHORT_SYSTEM = "You write fast, correct CUDA kernels for PyTorch models, called from ModelNew through cuda_extension."


def write_tasks(folder: Path, rows: int, names: list[str]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        paths[name] = folder / f"{name}.py"
        paths[name].write_text(TASK.format(name=name, torch_expr=OPS[name][0], rows=rows))
    return paths


def expert_files(expr: str, backend: str) -> dict[str, str]:
    if backend == "cuda":
        return {"model_new.py": MODEL_NEW, "kernels/op.cu": CU.format(expr=expr),
                "kernels/op_binding.cpp": BINDING_CUDA}
    return {"model_new.py": MODEL_NEW, "kernels/op.cpp": BINDING_CPU.format(expr=expr)}


def expert_response(op: str, backend: str) -> str:
    """The response that writes `op`'s expression (right for task `op`, wrong for every other task)."""
    from training.ppo.warmup import render_solution

    return render_solution(expert_files(OPS[op][1], backend))


def pick_confusers(names: list[str], k: int) -> dict[str, list[str]]:
    """Per task, the k other operators whose expressions its noisy demonstrations carry: cyclic shifts
    of the task list, so every expression is a confuser equally often and the demonstrations' overall
    mix of expressions says nothing about which one is right: only the task does."""
    n = len(names)
    k = min(k, n - 1)
    offsets = list(range(1, n))[:: max(1, (n - 1) // max(1, k))][:k]
    return {name: [names[(i + o) % n] for o in offsets] for i, name in enumerate(names)}


def demonstrations(tasks: dict, backend: str, per_task: int, noise: float,
                   confusers: dict[str, list[str]]) -> list[tuple]:
    """(task, response text, is the expression right) per demonstration: round(per_task * noise) of
    each task's demonstrations carry its confusers' expressions in turn, the rest its own."""
    demos = []
    for name, task in tasks.items():
        wrong = round(per_task * noise)
        for k in range(per_task):
            op = confusers[name][k % len(confusers[name])] if k < wrong else name
            demos.append((task, expert_response(op, backend), op == name))
    return demos


def supervised(model_dir: Path, out: Path, demos: list[tuple], backend: str, system: str | None, steps: int,
               lr: float, device: str, batch: int) -> Path:
    """Fine-tunes on the demonstrations' responses (loss on the response tokens only), AdamW with a
    linear decay to zero so that the last steps settle the boilerplate."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.models import load_tokenizer
    from training.ppo.warmup import prompt_ids

    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(1, steps))
    seqs = []
    for task, text, _ in demos:
        p = prompt_ids(tok, task, backend, system)
        r = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append((p, r))
    rng = random.Random(0)
    losses = []
    for step in range(steps):
        chosen = rng.sample(seqs, min(batch, len(seqs)))
        width = max(len(p) + len(r) for p, r in chosen)
        ids = torch.full((len(chosen), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        attn = torch.zeros((len(chosen), width), dtype=torch.long)
        for j, (p, r) in enumerate(chosen):  # right padding, loss on the response tokens only
            ids[j, : len(p) + len(r)] = torch.tensor(p + r)
            labels[j, len(p): len(p) + len(r)] = torch.tensor(r)
            attn[j, : len(p) + len(r)] = 1
        opt.zero_grad()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == steps - 1:
            print(f"sft step {step}: loss {losses[-1]:.4f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "sft_losses.json").write_text(json.dumps(losses))
    return out


def classify(text: str, name: str, variants: dict[str, str]) -> str:
    """right: exactly the expert response of the task; wrong_expr: exactly another task's (well-formed,
    compiles, fails verify); malformed: anything else. No judge involved: this is only a diagnostic."""
    if text == variants[name]:
        return "right"
    return "wrong_expr" if text in variants.values() else "malformed"


def step_fractions(responses: Path, step: int, name_of: dict[str, str], variants: dict[str, str]) -> dict[str, float]:
    """The well-formed and right fractions of one PPO step's responses (OUT/ppo/responses.jsonl)."""
    kinds = [classify(r["response"], name_of[r["task_id"]], variants)
             for r in map(json.loads, responses.read_text().splitlines()) if r["step"] == step]
    return {"well_formed": sum(k != "malformed" for k in kinds) / max(1, len(kinds)),
            "right_expr": kinds.count("right") / max(1, len(kinds))}


def sample_texts(model_dir: Path, tasks: dict, backend: str, system: str | None, per_task: int, temperature: float,
                 max_new_tokens: int, device: str) -> dict[str, list[str]]:
    """per_task responses per task, sampled at `temperature` from the model in model_dir (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.models import load_tokenizer
    from training.ppo.generate import sample
    from training.ppo.warmup import prompt_ids

    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    torch.manual_seed(1234)
    names = list(tasks)
    prompts = [prompt_ids(tok, tasks[n], backend, system) for n in names for _ in range(per_task)]
    outs = sample(model, tok, prompts, max_new_tokens, temperature, batch_size=64 if device != "cpu" else 16)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _, _ in outs]
    del model
    return {n: texts[i * per_task:(i + 1) * per_task] for i, n in enumerate(names)}


def diagnose(model_dir: Path, tasks: dict, backend: str, system: str | None, per_task: int, temperature: float,
             max_new_tokens: int, device: str, variants: dict[str, str]) -> dict:
    """Samples per_task responses per task at the run's temperature and counts what they are."""
    texts = sample_texts(model_dir, tasks, backend, system, per_task, temperature, max_new_tokens, device)
    kinds = {n: [classify(t, n, variants) for t in ts] for n, ts in texts.items()}
    flat = [k for ks in kinds.values() for k in ks]
    per = {n: {k: ks.count(k) / per_task for k in ("right", "wrong_expr")} for n, ks in kinds.items()}
    return {"samples": len(flat), "temperature": temperature,
            "well_formed": sum(k != "malformed" for k in flat) / len(flat),
            "right_expr": flat.count("right") / len(flat), "per_task": per}
