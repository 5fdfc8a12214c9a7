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

    python -m bench.proofs.learns --out /tmp/ppo-learns --minutes 6        # H100: about 7 minutes in all
    python -m bench.proofs.learns --out /tmp/ppo-grpo --minutes 6 --advantage-estimator grpo   # no critic
    python -m bench.proofs.learns --out /tmp/pl --device cpu --backend cpu --tasks 4 --rows 1024 \
        --layers 2 --hidden 128 --sft-steps 150 --sft-lr 2e-3 --sft-batch 8 --diagnose 4 \
        --judge-workers 2 --minutes 24                                  # CPU: about 45 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.proofs.family import (  # noqa: E402
    OPS,
    SHORT_SYSTEM,
    demonstrations,
    diagnose,
    expert_response,
    pick_confusers,
    step_fractions,
    supervised,
    write_tasks,
)


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
                    help="at 1e-4 the decision is learned in one step and then the boilerplate drifts (docs/ppo.md)")
    ap.add_argument("--critic-lr", type=float, default=3e-4)
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="k3 KL to the SFT policy (off: k3 explodes on rare wrong tokens that PPO pushes down, "
                         "see docs/history.md, 'Proof that it learns')")
    ap.add_argument("--whiten-advantages", action="store_true",
                    help="whiten advantages over the batch (off: once most responses pass, whitening scales the "
                         "critic's per-token noise up to unit advantages and the boilerplate drifts; see "
                         "docs/ppo.md and bench.proofs.dynamics)")
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
