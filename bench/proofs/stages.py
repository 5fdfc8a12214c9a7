"""The paper's four stages, chained on bench.proofs.repair's family; each stage reads the previous stage's
output folder, nothing is edited by hand in between:

    OUT/sft/                 a tiny Qwen3 fine-tuned on the family's demonstrations: the single-turn answer
                             format of `train warmup` and the multi-turn repair episodes of bench.proofs.repair
    OUT/1-warmup/final/      single-turn PPO (training.ppo.warmup.run_warmup) from OUT/sft, judged
    OUT/2-rollouts/          multi-turn harness episodes of OUT/1-warmup/final through the engine (token ids,
                             logprobs), judged: the trajectories the next two stages learn from
    OUT/3-rft/final/         rejection fine-tuning (training.rft: select, then trl's SFTTrainer) of
                             OUT/1-warmup/final on the episodes of OUT/2-rollouts the judge found correct
    OUT/4-critic/final-critic/  value pretraining (training.ppo.critic.run_critic) on OUT/2-rollouts, backbone
                             from OUT/3-rft/final, a share of the episodes held out: critic_eval.json
    OUT/5-ppo/               multi-turn PPO (training.ppo.agentic.run_ppo) from OUT/3-rft/final and
                             OUT/4-critic/final-critic
    OUT/5-ppo-fresh-critic/  the same from OUT/3-rft/final with a fresh value head: the comparison

OUT/stages.json says which stage consumed which folder; OUT/summary.json puts the held-out explained
variance of the pretrained critic beside a fresh head's, and the two PPO runs' steps side by side
(OUT/paper_stages.png). A stage whose output is complete is skipped, so the script can be run again (on the
GPU: in several device calls) and continues where it stopped; `--minutes` bounds one call.

    python -m bench.proofs.stages --out /tmp/stages --minutes 6.5               # H100: run it 3-4 times
    python -m bench.proofs.stages --out /tmp/ps --device cpu --backend cpu --tasks 2 --layers 1 --hidden 64 \\
        --sft-steps 30 --samples 1 --warmup-steps 1 --rollout-samples 2 --critic-steps 4 --steps 1 \\
        --min-milestone failed --concurrency 2                                # CPU: every hand-off once
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.proofs.pipeline import (  # noqa: E402
    add_common,
    plot,
    ppo_config,
    sft_model,
    step_line,
    summarize,
)
from bench.proofs.repair_family import Family, make_family  # noqa: E402

STAGES = ("warmup", "rollouts", "rft", "critic", "ppo", "ppo-fresh-critic")
# what a stage imports beyond the core install: found missing before any stage runs, not minutes into a device call
# (a GPU run lost its RFT stage to a missing trl after the SFT, the warm-up and the rollouts had run)
STAGE_MODULES = {"rft": ("trl", "datasets")}


def missing_modules(stages: list[str]) -> list[str]:
    """The modules that `stages` need and this Python cannot import."""
    import importlib.util

    return sorted({m for s in stages for m in STAGE_MODULES.get(s, ()) if importlib.util.find_spec(m) is None})


def single_turn_sequences(fam: Family, tok: Any, per_task: int, noise: float) -> list[tuple]:
    """bench.proofs.family's single-turn demonstrations (the `train warmup` prompt and answer format) as (ids, mask)."""
    from bench.proofs.family import SHORT_SYSTEM, demonstrations
    from training.ppo.warmup import prompt_ids

    out = []
    for task, text, _ in demonstrations(fam.tasks, fam.backend, per_task, noise, fam.confusers):
        p = prompt_ids(tok, task, fam.backend, SHORT_SYSTEM)
        r = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        out.append((p + r, [0] * len(p) + [1] * len(r)))
    return out


def stage_warmup(fam: Family, sft: Path, out: Path, args: Any, limit_s: float) -> Path:
    from bench.proofs.family import SHORT_SYSTEM, expert_response
    from training.models import load_tokenizer
    from training.ppo.config import PPOConfig
    from training.ppo.warmup import WarmupConfig, run_warmup

    tok = load_tokenizer(str(sft))
    longest = max(len(tok.encode(expert_response(n, fam.backend), add_special_tokens=False)) for n in fam.names)
    ppo = PPOConfig(model=str(sft), device=fam.device, actor_lr=args.actor_lr, critic_lr=args.critic_lr, gamma=1.0,
                    lam=1.0, ppo_epochs=2, minibatches=2, micro_batch_size=args.micro_batch, whiten_advantages=False)
    cfg = WarmupConfig(ppo=ppo, tasks=[str(fam.tasks_dir)], out=out, steps=args.warmup_steps,
                       prompts_per_step=len(fam.names), samples=args.samples, max_new_tokens=longest + 32,
                       temperature=args.warmup_temperature, system_prompt=SHORT_SYSTEM, backend=fam.backend,
                       judge_workers=args.concurrency, judge_cache=True, save_every=1000, time_limit_s=limit_s,
                       tensorboard=False)
    run_warmup(cfg, lambda step, m: print(json.dumps({"stage": "warmup", "step": step, "pass_rate": m["pass_rate"],
                                                      "reward": m["reward/mean"]}), flush=True))
    return out / "final"


def stage_rollouts(fam: Family, actor: Path, out: Path, args: Any) -> Path:
    """Multi-turn episodes of `actor` served by the in-process engine: the judged trajectories, token ids and
    the engine's logprobs, in a harness run folder (what `train rft` and `train critic` read)."""
    from training.engine.hf import TransformersBackend
    from training.ppo.agentic import collect

    cfg = ppo_config(fam, out, actor, args)
    cfg.samples = args.rollout_samples
    backend = TransformersBackend(str(actor), device=fam.device, dtype="fp32", max_context=args.context_tokens)
    records, seconds, _ = collect(cfg, backend, out)
    backend.release()  # its KV cache (a share of the GPU's free memory) is not needed by the stages after it
    correct = sum(r.reward is not None and r.reward > 0 for r in records)
    print(json.dumps({"stage": "rollouts", "episodes": len(records), "correct": correct, "s": round(seconds)}),
          flush=True)
    return out


def stage_rft(rollouts: Path, actor: Path, out: Path, args: Any) -> Path:
    from training.rft import RFTConfig, prepare, train
    from training.rft_select import SelectConfig

    cfg = RFTConfig(data=[rollouts], model=str(actor), out=out, eval_fraction=0.0, epochs=args.rft_epochs,
                    learning_rate=args.rft_lr, batch_size=4, grad_accum=1, max_length=args.context_tokens,
                    gradient_checkpointing=False, dtype="fp32", logging_steps=1, save_steps=100000,
                    report_to=[], select=SelectConfig(min_milestone=args.min_milestone, max_per_task=None,
                                                      drop_truncated=not args.rft_keep_truncated))
    rows, eval_rows, summary = prepare(cfg)
    print(json.dumps({"stage": "rft", **{k: summary[k] for k in ("total", "kept", "dropped")}}), flush=True)
    return train(cfg, rows, eval_rows)


def stage_critic(rollouts: Path, actor: Path, out: Path, args: Any, fam: Family) -> dict[str, Any]:
    """Pretrains the critic, then measures a fresh value head on the same held-out episodes."""
    from training.models import load_tokenizer
    from training.ppo.config import PPOConfig
    from training.ppo.critic import (
        CriticConfig,
        explained_variance_on,
        load_samples,
        run_critic,
        split_holdout,
    )
    from training.ppo.learner import PPOLearner

    ppo = PPOConfig(model=str(actor), device=fam.device, critic_lr=args.critic_pretrain_lr, gamma=1.0, lam=1.0,
                    micro_batch_size=args.micro_batch)
    run_critic(CriticConfig(ppo=ppo, data=[rollouts], out=out, steps=args.critic_steps, batch_size=16,
                            save_every=100000, holdout=args.holdout, eval_every=max(1, args.critic_steps // 4),
                            tensorboard=False))
    report = json.loads((out / "critic_eval.json").read_text())
    _, heldout = split_holdout(load_samples([rollouts]), args.holdout)
    fresh = PPOLearner(ppo, pad_id=load_tokenizer(str(actor)).pad_token_id, train_actor=False)
    report["explained_variance_heldout_fresh_head"] = explained_variance_on(fresh, heldout)
    del fresh
    (out / "critic_eval.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"stage": "critic", **{k: report[k] for k in ("explained_variance_heldout",
                                                                     "explained_variance_heldout_fresh_head")}}),
          flush=True)
    return report


def stage_ppo(fam: Family, actor: Path, critic: Path | None, out: Path, args: Any, limit_s: float, t0: float,
              steps: int | None = None) -> Path:
    """`steps`: run to this step (resuming from the run's last checkpoint) rather than to args.steps."""
    from training.ppo.agentic import run_ppo

    cfg = ppo_config(fam, out, actor, args, critic_model=critic)
    cfg.time_limit_s = limit_s
    if steps is not None:
        cfg.steps = steps
    run_ppo(cfg, lambda step, m: print(step_line(step, m, t0), flush=True))
    return out


def alternate(names: list[str], steps_done: Any, target: int, run_to: Any, left: Any) -> list[tuple[str, int]]:
    """Runs the named PPO runs a step at a time, in turn, the run with fewest steps first (ties in `names`' order),
    until each has `target` steps, the time `left()` is less than the longest step so far, or a run makes no
    progress (its own time limit). Both curves then have as many points, whatever one step costs more than another:
    on a fresh machine the first step of a call also pays the judge's first builds and eager baselines, and a
    run given the first half of the time spent it on one step while the other, finding them cached, made two.
    `steps_done(name)`: its completed steps; `run_to(name, k)`: runs it to step k. Returns (name, k) as run."""
    ran: list[tuple[str, int]] = []
    longest = 0.0
    while True:
        pending = sorted((steps_done(n), i, n) for i, n in enumerate(names) if steps_done(n) < target)
        if not pending or left() <= longest:
            return ran
        k, _, name = pending[0]
        before = left()
        run_to(name, k + 1)
        longest = max(longest, before - left())
        if steps_done(name) <= k:
            return ran
        ran.append((name, k + 1))


def ppo_steps(path: Path) -> int:
    from training.ppo.stage import read_metrics

    rows = read_metrics(path)
    return int(rows[-1]["step"]) if rows else 0


def done(stage: str, path: Path, args: Any) -> bool:
    """Complete: the output the next stage reads is there, and a PPO stage ran all its steps (one stopped by
    the time limit has final/ too, and resumes from its checkpoint on the next call)."""
    from training.ppo.stage import read_metrics

    marker = {"rollouts": "summary.json", "critic": "final-critic/config.json"}.get(stage, "final/config.json")
    if not (path / marker).is_file():
        return False
    target = {"warmup": args.warmup_steps, "ppo": args.steps, "ppo-fresh-critic": args.steps}.get(stage)
    rows = read_metrics(path) if target else []
    return target is None or bool(rows and rows[-1]["step"] >= target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(ap)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--warmup-temperature", type=float, default=0.5)
    # 12: with 6 (24 episodes, 6 held out) the held-out explained variance moved between -0.53 and -0.01 as the
    # critic trained (H100); with 12 it settled at 0.43 (H200, docs/ppo.md)
    ap.add_argument("--rollout-samples", type=int, default=12, help="episodes per task for RFT and the critic")
    ap.add_argument("--min-milestone", default="correct", help="RFT keeps episodes at or above this milestone")
    ap.add_argument("--rft-keep-truncated", action="store_true",
                    help="RFT keeps episodes with a response cut at the token limit (the CPU hand-off test's "
                         "random model writes nothing else)")
    ap.add_argument("--rft-epochs", type=float, default=2.0)
    ap.add_argument("--rft-lr", type=float, default=1e-4)
    ap.add_argument("--critic-steps", type=int, default=300)
    ap.add_argument("--critic-pretrain-lr", type=float, default=3e-4)
    ap.add_argument("--holdout", type=float, default=0.25, help="share of the rollout episodes held out")
    ap.add_argument("--stages", default=",".join(STAGES), help="which stages this call may run (in order)")
    ap.set_defaults(steps=4)  # PPO steps of each of the two final runs
    args = ap.parse_args()

    import torch

    from training.models import load_tokenizer
    from training.ppo.stage import read_metrics

    t0 = time.perf_counter()
    budget = args.minutes * 60
    left = lambda: budget - (time.perf_counter() - t0)  # noqa: E731
    allowed = set(args.stages.split(","))
    paths = {"sft": args.out / "sft", "warmup": args.out / "1-warmup", "rollouts": args.out / "2-rollouts",
             "rft": args.out / "3-rft", "critic": args.out / "4-critic", "ppo": args.out / "5-ppo",
             "ppo-fresh-critic": args.out / "5-ppo-fresh-critic"}
    todo = [s for s in STAGES if s in allowed and not done(s, paths[s], args)]
    missing = missing_modules(todo)
    if missing:
        sys.exit(f"stages {', '.join(todo)} need {', '.join(missing)}, which this Python cannot import "
                 "(pip install 'cuda-agent[train]')")
    fam = make_family(args.out, args.tasks, args.rows, args.backend, args.device)
    if not (paths["sft"] / "config.json").is_file():
        from training.models import make_tiny_model

        base = args.out / "tiny"
        if not (base / "config.json").is_file():
            make_tiny_model(base, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, vocab=4096)
        extra = single_turn_sequences(fam, load_tokenizer(str(base)), args.demos_per_task, args.demo_noise)
        sft_model(fam, args, extra)
    warm_final = paths["warmup"] / "final"
    rft_final = paths["rft"] / "final"
    critic_final = paths["critic"] / "final-critic"
    critics = {"ppo": critic_final, "ppo-fresh-critic": None}

    def final_run(name: str, steps: int | None = None) -> Path:
        return stage_ppo(fam, rft_final, critics[name], paths[name], args, max(60.0, left()), t0, steps=steps)

    plan = [("warmup", lambda: stage_warmup(fam, paths["sft"], paths["warmup"], args, max(60.0, left() * 0.5))),
            ("rollouts", lambda: stage_rollouts(fam, warm_final, paths["rollouts"], args)),
            ("rft", lambda: stage_rft(paths["rollouts"], warm_final, paths["rft"], args)),
            ("critic", lambda: stage_critic(paths["rollouts"], rft_final, paths["critic"], args, fam)),
            ("ppo", lambda: final_run("ppo")),
            ("ppo-fresh-critic", lambda: final_run("ppo-fresh-critic"))]
    consumed = {"warmup": [paths["sft"]], "rollouts": [warm_final], "rft": [paths["rollouts"], warm_final],
                "critic": [paths["rollouts"], rft_final], "ppo": [rft_final, critic_final],
                "ppo-fresh-critic": [rft_final]}
    ran = []
    for stage, fn in plan:
        if done(stage, paths[stage], args) or stage not in allowed:
            continue
        if left() <= 0:
            print(json.dumps({"stopped_before": stage, "elapsed_s": round(time.perf_counter() - t0)}), flush=True)
            break
        s0 = time.perf_counter()
        if stage == "ppo" and "ppo-fresh-critic" in allowed and not done("ppo-fresh-critic",
                                                                            paths["ppo-fresh-critic"], args):
            # the comparison: both runs a step at a time, in turn (alternate); what it leaves resumes next call
            turns = alternate(["ppo", "ppo-fresh-critic"], lambda n: ppo_steps(paths[n]), args.steps, final_run, left)
            ran += [{"stage": n, "step": k} for n, k in turns]
            ran.append({"stage": "ppo and ppo-fresh-critic", "s": round(time.perf_counter() - s0)})
            break
        fn()
        ran.append({"stage": stage, "s": round(time.perf_counter() - s0)})
        # a stage stopped by the time limit has a checkpoint (and final/); it continues on the next call
        if not done(stage, paths[stage], args):
            break
    (args.out / "stages.json").write_text(json.dumps({
        "stages": [{"stage": s, "out": str(paths[s]), "consumed": [str(p) for p in consumed[s]],
                    "complete": done(s, paths[s], args)} for s in STAGES], "ran_this_call": ran}, indent=2))
    ppo_rows = {k: read_metrics(paths[k]) for k in ("ppo", "ppo-fresh-critic")}
    critic_eval = (json.loads((paths["critic"] / "critic_eval.json").read_text())
                   if (paths["critic"] / "critic_eval.json").is_file() else None)
    if ppo_rows["ppo"]:
        plot(ppo_rows["ppo"], args.out / "paper_stages.png",
             "multi-turn PPO from RFT: pretrained critic (solid) vs fresh value head (dashed)",
             {"fresh value head": ppo_rows["ppo-fresh-critic"]} if ppo_rows["ppo-fresh-critic"] else None)
    summary = {"device": torch.cuda.get_device_name() if fam.device.startswith("cuda") else "cpu",
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "warmup": summarize(read_metrics(paths["warmup"])),
               "rollouts": json.loads((paths["rollouts"] / "summary.json").read_text())
               if done("rollouts", paths["rollouts"], args) else None,
               "rft": json.loads((paths["rft"] / "selection.json").read_text())
               if (paths["rft"] / "selection.json").is_file() else None,
               "critic": critic_eval,
               "ppo_pretrained_critic": summarize(ppo_rows["ppo"]),
               "ppo_fresh_critic": summarize(ppo_rows["ppo-fresh-critic"]),
               "this_call_s": time.perf_counter() - t0}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"critic": critic_eval and {k: critic_eval.get(k) for k in (
        "explained_variance_heldout", "explained_variance_heldout_fresh_head")},
        "ppo_pretrained_critic": summary["ppo_pretrained_critic"]["last"],
        "ppo_fresh_critic": summary["ppo_fresh_critic"]["last"], "ran": ran}), flush=True)


if __name__ == "__main__":
    main()
