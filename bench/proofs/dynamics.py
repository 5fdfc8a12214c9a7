"""The learner's dynamics on bench.proofs.family's task family, without the judge: for choosing learner settings.

bench.proofs.learns judges every response in the sandbox; a compile and a verify take seconds, so comparing
several learner settings there costs the whole GPU budget. This script fine-tunes the same tiny model on
the same demonstrations once, then runs `train warmup`'s loop (run_warmup) once per setting with the
judge replaced by an exact-match check: +1 for the task's own expert response, -1 for anything else
(another task's expression, or a response that drifted off the expert text). On this family that is
what the judge says up to drift that happens to still compile and pass; it is a tuning tool, not a
reward anyone trains a policy on, and the proof stays bench.proofs.learns with the real judge.

Each setting starts from the same fine-tuned policy and seed, and prints, per step, the fraction of
responses that are right and that are well-formed (any of the eight expert texts).

    python -m bench.proofs.dynamics --out /tmp/pd --steps 16 \\
        --setting base: --setting critic:critic_warmup=4,lam=0.95,critic_lam=1.0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.proofs import family as pl  # noqa: E402


def parse_setting(text: str) -> tuple[str, dict]:
    """name:key=value,key=value (values parsed as JSON where they parse, else kept as text)."""
    name, _, rest = text.partition(":")
    given = {}
    for pair in filter(None, rest.split(",")):
        key, _, value = pair.partition("=")
        try:
            given[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            given[key.strip()] = value.strip()
    return name.strip(), given


def plot(summary: dict, path: Path) -> None:
    """Right and well-formed fractions per step, one line pair per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (name, s) in enumerate(summary.items()):
        steps = [r["step"] for r in s["rows"]]
        color = f"C{k}"
        ax.plot(steps, [r["right"] for r in s["rows"]], marker="o", color=color, label=f"{name}: right")
        ax.plot(steps, [r["well_formed"] for r in s["rows"]], linestyle=":", color=color, label=f"{name}: well-formed")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("fraction of the step's 64 responses")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    ax.set_title("learner dynamics on the elementwise family (exact-match reward, no judge)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--setting", action="append", required=True,
                    help="name:key=value,... PPOConfig fields over bench.proofs.family's defaults (repeat)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="cuda", help="whose response text (nothing is compiled)")
    ap.add_argument("--tasks", type=int, default=len(pl.OPS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--demo-noise", type=float, default=0.6)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.5)
    args = ap.parse_args()

    import torch

    import training.ppo.warmup as warmup
    from harness.specs import select_tasks
    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.config import PPOConfig
    from training.ppo.stage import read_metrics

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(pl.OPS)[: args.tasks]
    args.out.mkdir(parents=True, exist_ok=True)
    pl.write_tasks(args.out / "tasks", 4096, names)
    tasks = {t.name: t for t in select_tasks([str(args.out / "tasks")])}
    tasks = {n: tasks[n] for n in names}
    variants = {n: pl.expert_response(n, args.backend) for n in pl.OPS}
    name_of = {t.id: n for n, t in tasks.items()}
    base = args.out / "tiny"
    if not (base / "config.json").is_file():
        make_tiny_model(base, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, vocab=4096)
    tok = load_tokenizer(str(base))
    max_new = max(len(tok.encode(v, add_special_tokens=False)) for v in variants.values()) + 32
    sft = args.out / "sft"
    if not (sft / "config.json").is_file():
        demos = pl.demonstrations(tasks, args.backend, 10, args.demo_noise, pl.pick_confusers(names, 2))
        pl.supervised(base, sft, demos, args.backend, pl.SHORT_SYSTEM, args.sft_steps, args.sft_lr, device,
                      args.sft_batch)

    def exact_match(task, files, root, backend, profile=None, keep=False):  # the judge's stand-in (docstring)
        right = files == warmup.parse_solution(variants[task.name])
        return {"reward": 1.0 if right else -1.0, "milestone": "correct" if right else "failed", "reason": None,
                "compile_ok": right, "verify_ok": right, "refused": [], "judge_s": 0.0}

    warmup.judge_files = exact_match
    base_ppo = PPOConfig(model=str(sft), device=device, actor_lr=1e-4, critic_lr=3e-4, gamma=1.0, lam=1.0,
                         ppo_epochs=2, minibatches=2, micro_batch_size=16, bf16=False, entropy_coef=0.0)
    summary = {}
    for text in args.setting:
        name, given = parse_setting(text)
        cfg = warmup.WarmupConfig(
            ppo=replace(base_ppo, **given), tasks=[str(args.out / "tasks")], out=args.out / f"run-{name}",
            steps=args.steps, prompts_per_step=len(tasks), samples=args.samples, max_new_tokens=max_new,
            temperature=args.temperature, system_prompt=pl.SHORT_SYSTEM, backend=args.backend, judge_workers=1,
            save_every=10 ** 6, resume=False, tensorboard=False)
        t0 = time.perf_counter()
        rows = []

        def progress(step: int, m: dict, rows=rows, cfg=cfg, name=name, t0=t0) -> None:
            f = pl.step_fractions(cfg.out / "responses.jsonl", step, name_of, variants)
            row = {"setting": name, "step": step, "right": f["right_expr"], "well_formed": f["well_formed"],
                   "frozen": m.get("actor/frozen", 0.0), "ev": round(m["value/explained_variance"], 3),
                   "clip": round(m.get("actor/clip_frac", 0.0), 4), "kl_ref": round(m.get("kl/ref", 0.0), 4),
                   "s": round(time.perf_counter() - t0)}
            rows.append(row)
            print(json.dumps(row), flush=True)

        warmup.run_warmup(cfg, progress)
        summary[name] = {"given": given, "rows": rows, "metrics": read_metrics(cfg.out)}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / "ppo_dynamics.png")
    for name, s in summary.items():
        print(name, " ".join(f"{r['right']:.2f}/{r['well_formed']:.2f}" for r in s["rows"]), flush=True)


if __name__ == "__main__":
    main()
