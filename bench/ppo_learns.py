"""Proof that the PPO learner learns: a small task family, a tiny model, the real judge.

1. Tasks: eight elementwise operators (relu, abs, neg, square, sigmoid, tanh, double, add_one), each a
   KernelBench-style task file. The expert response is the same text for every task (generic names:
   op_kernel, launch_op, op_forward, register_op) except one line, the operator's expression; so
   the policy has exactly one thing to learn per task, and one wrong token elsewhere is rare.
2. A tiny Qwen3 model (tokenizer trained here) is fine-tuned on expert demonstrations in the warm-up's
   single-turn format (a one-sentence system prompt; `--system skill` puts SKILL.md there). A fraction
   `--demo-noise` of each task's demonstrations carries the expression of one of its `--confusers`
   (cyclic shifts of the task list, so each expression is as frequent as any other overall). The
   fine-tuned policy then writes well-formed responses whose expression is right for its task about
   (1 - noise) of the time, and only the judge says which one is right.
3. An offline diagnostic (no judge) samples `--diagnose` responses per task at the run's temperature
   and counts those equal to an expert response (well-formed) and to the task's own (right).
4. `train warmup`'s loop (training.ppo.warmup.run_warmup) runs PPO on all tasks for at most
   `--minutes`, sampling at `--temperature` (the learner scores the same tempered distribution),
   judging every response in a fresh workspace; identical files of the same task are judged once
   (judge cache: a build and a verify take seconds to a minute, and a converging policy repeats itself).
   Each step prints reward, pass rate and the well-formed and right-expression fractions.
5. The diagnostic again on the final policy. OUT/ppo/metrics.jsonl has every step's metrics,
   OUT/ppo_learns.png plots reward and pass rate, OUT/summary.json has the diagnostics and every step.

    python bench/ppo_learns.py --out /tmp/ppo-learns --minutes 6        # H100: about 7 minutes in all
    python bench/ppo_learns.py --out /tmp/ppo-grpo --minutes 6 --advantage-estimator grpo   # no critic
    python bench/ppo_learns.py --out /tmp/pl --device cpu --backend cpu --tasks 4 --rows 1024 \
        --layers 2 --hidden 128 --sft-steps 150 --sft-lr 2e-3 --sft-batch 8 --diagnose 4 \
        --judge-workers 2 --minutes 24                                  # CPU: about 45 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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


def plot(rows: list[dict], path: Path, title: str, fractions: dict[int, dict] | None = None) -> None:
    """Mean reward and pass rate per step; with `fractions` (step_fractions per step) also the share of
    responses with the task's own expression and the share with exactly an expert's text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward/mean"] for r in rows], marker="o", label="mean reward")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("mean reward (-1 failed ... 3 beats compile)")
    ax.set_ylim(-1.1, 3.1)
    ax2 = ax.twinx()
    ax2.plot(steps, [r["pass_rate"] for r in rows], marker="s", color="tab:green", label="pass rate")
    if fractions:
        got = [s for s in steps if s in fractions]
        ax2.plot(got, [fractions[s]["right_expr"] for s in got], ls="--", color="tab:olive",
                 label="right expression, exact text")
        ax2.plot(got, [fractions[s]["well_formed"] for s in got], ls=":", color="tab:gray",
                 label="exact expert text (any expression)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("pass rate")
    fig.legend(loc="lower center", ncol=2, fontsize="small", bbox_to_anchor=(0.5, 0.12))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default=None, help="default: cuda if visible")
    ap.add_argument("--backend", default=None, help="workspace backend (default: cuda if visible)")
    ap.add_argument("--tasks", type=int, default=len(OPS), help=f"how many of the {len(OPS)} operators")
    ap.add_argument("--rows", type=int, default=4096, help="rows of the tasks' [rows, 1024] input")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--system", choices=("short", "skill"), default="short",
                    help="system prompt: one sentence, or SKILL.md (~11k tokens of the tiny tokenizer)")
    ap.add_argument("--minutes", type=float, default=6.0, help="PPO time budget (the step that passes it is the last)")
    ap.add_argument("--steps", type=int, default=1000, help="PPO steps at most")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--demo-noise", type=float, default=0.6, help="fraction of demonstrations with a wrong expression")
    ap.add_argument("--demos-per-task", type=int, default=10)
    ap.add_argument("--confusers", type=int, default=2, help="wrong expressions per task in the demonstrations")
    ap.add_argument("--diagnose", type=int, default=16, help="samples per task for the offline diagnostic (0: skip)")
    ap.add_argument("--samples", type=int, default=8, help="responses per task per PPO step")
    ap.add_argument("--temperature", type=float, default=0.5,
                    help="sampling temperature of the PPO responses (and of the learner's logprobs)")
    ap.add_argument("--actor-lr", type=float, default=3e-5,
                    help="at 1e-4 the decision is learned in one step and then the boilerplate drifts (docs/training.md)")
    ap.add_argument("--critic-lr", type=float, default=3e-4)
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="k3 KL to the SFT policy (off: k3 explodes on rare wrong tokens that PPO pushes down, "
                         "see docs/training.md)")
    ap.add_argument("--whiten-advantages", action="store_true",
                    help="whiten advantages over the batch (off: once most responses pass, whitening scales the "
                         "critic's per-token noise up to unit advantages and the boilerplate drifts; see "
                         "docs/training.md and bench/ppo_dynamics.py)")
    ap.add_argument("--advantage-estimator", default="gae",
                    help="gae (a critic, the paper's) or grpo (each task's samples normalized within their group, "
                         "no critic; --critic-lr and --whiten-advantages then do not apply)")
    ap.add_argument("--judge-workers", type=int, default=12)
    args = ap.parse_args()

    import torch

    from harness.specs import select_tasks
    from sandbox.backend import resolve_backend
    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.config import PPOConfig
    from training.ppo.stage import read_metrics
    from training.ppo.warmup import WarmupConfig, run_warmup

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(args.backend)
    names = list(OPS)[: args.tasks]
    system = SHORT_SYSTEM if args.system == "short" else None
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_tasks(args.out / "tasks", args.rows, names)
    tasks = {t.name: t for t in select_tasks([str(args.out / "tasks")])}
    tasks = {n: tasks[n] for n in names}
    variants = {n: expert_response(n, backend) for n in OPS}  # any of the eight expressions is well-formed
    confusers = pick_confusers(names, args.confusers)
    base = args.out / "tiny"
    if not (base / "config.json").is_file():
        make_tiny_model(base, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, vocab=4096)
    tok = load_tokenizer(str(base))
    longest = max(len(tok.encode(v, add_special_tokens=False)) for v in variants.values())
    max_new = longest + 32  # room for a little drift; a response that runs past it is cut and fails
    demos = demonstrations(tasks, backend, args.demos_per_task, args.demo_noise, confusers)
    print(json.dumps({"tasks": names, "backend": backend, "device": device, "response_tokens": longest,
                      "demos": len(demos), "right_demos": sum(d[2] for d in demos), "confusers": confusers}),
          flush=True)
    sft_dir = args.out / "sft"
    if not (sft_dir / "config.json").is_file():
        supervised(base, sft_dir, demos, backend, system, args.sft_steps, args.sft_lr, device, args.sft_batch)
    sft_s = time.perf_counter() - t0
    before = None
    if args.diagnose:
        before = diagnose(sft_dir, tasks, backend, system, args.diagnose, args.temperature, max_new, device,
                          variants)
        print(json.dumps({"sft_s": round(sft_s), "diagnostic_sft": before}), flush=True)
    if args.steps == 0:  # SFT and its diagnostic only
        (args.out / "summary.json").write_text(json.dumps({"sft_s": sft_s, "diagnostic_sft": before}, indent=2))
        return

    cfg = WarmupConfig(
        ppo=PPOConfig(model=str(sft_dir), device=device, actor_lr=args.actor_lr, critic_lr=args.critic_lr,
                      gamma=1.0, lam=1.0, ppo_epochs=2, minibatches=2, micro_batch_size=16, kl_coef=args.kl_coef,
                      whiten_advantages=args.whiten_advantages, advantage_estimator=args.advantage_estimator,
                      bf16=False, entropy_coef=0.0),  # fp32 like the sampler: learner and sampler agree
        tasks=[str(args.out / "tasks")], out=args.out / "ppo", steps=args.steps, prompts_per_step=len(tasks),
        samples=args.samples, max_new_tokens=max_new, temperature=args.temperature, system_prompt=system,
        backend=backend, judge_workers=args.judge_workers, judge_cache=True, save_every=1000,
        time_limit_s=args.minutes * 60, tensorboard=False)
    kinds_per_step: dict[int, dict] = {}
    name_of = {t.id: n for n, t in tasks.items()}

    def progress(step: int, m: dict) -> None:
        kinds_per_step[step] = step_fractions(cfg.out / "responses.jsonl", step, name_of, variants)
        print(json.dumps({"step": step, "reward": round(m["reward/mean"], 3), "pass_rate": round(m["pass_rate"], 3),
                          **{k: round(v, 3) for k, v in kinds_per_step[step].items()},
                          "compile_ok": round(m["compile_ok"], 3), "cache_hits": m["judge_cache_hits"],
                          "generate_s": round(m["generate_s"], 1), "judge_wall_s": round(m["judge_wall_s"], 1),
                          "learn_s": round(m["learn_s"], 1),
                          # the fast judge's target: judging under half of a step
                          "judge_share": round(m["judge_wall_s"] / max(1e-9, m["generate_s"] + m["judge_wall_s"]
                                                                      + m["learn_s"]), 3),
                          "entropy": round(m.get("actor/entropy", 0), 4),
                          "kl_ref": round(m.get("kl/ref", 0.0), 5), "mismatch": round(m["mismatch/abs_logp_diff"], 5),
                          "elapsed_s": round(time.perf_counter() - t0)}), flush=True)

    run_warmup(cfg, progress)
    rows = read_metrics(cfg.out)
    after = None
    if args.diagnose and (cfg.out / "final" / "config.json").is_file():
        after = diagnose(cfg.out / "final", tasks, backend, system, args.diagnose, args.temperature, max_new,
                         device, variants)
        print(json.dumps({"diagnostic_final": after}), flush=True)
    plot(rows, args.out / "ppo_learns.png",
         f"PPO on {len(tasks)} elementwise tasks ({device}, T={args.temperature}, demo noise {args.demo_noise})",
         kinds_per_step)
    summary = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "steps": len(rows), "sft_s": sft_s, "total_s": time.perf_counter() - t0,
               "diagnostic_sft": before, "diagnostic_final": after,
               "first": {k: rows[0][k] for k in ("reward/mean", "pass_rate")} if rows else None,
               "last": {k: rows[-1][k] for k in ("reward/mean", "pass_rate")} if rows else None,
               "per_step": [{"step": r["step"], "reward": r["reward/mean"], "pass_rate": r["pass_rate"],
                             **kinds_per_step.get(r["step"], {})} for r in rows]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("device", "steps", "first", "last", "total_s")}), flush=True)


if __name__ == "__main__":
    main()
