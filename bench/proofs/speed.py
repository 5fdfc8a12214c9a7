"""Proof that PPO learns speed: every response the policy chooses between is correct, and the judge's paired
timings alone say which is fast.

1. Tasks: short elementwise chains that eager runs as one kernel per op, each a pass over memory:
   `torch.relu(x) * 2.0 + 1.0` is three passes, `x * x + 1.0` two. The response is one fused kernel (a pass),
   bench.proofs.family's generic text (op_kernel, launch_op, op_forward, register_op) with the task's fused expression,
   and one line where the variants differ, the element each thread (CUDA) or iteration (CPU) handles:
   - straight, `k = i`: consecutive threads touch consecutive floats; one pass, so it beats eager by about
     the number of eager's passes (2-3x; `faster_than_eager`, reward 2; torch.compile fuses the chain
     too, so `faster_than_compile` is a coin toss around its 5% margin);
   - strided, `k = (i % (n / 32)) * 32 + i / (n / 32)`: the same permutation walked as 32 interleaved
     columns, consecutive threads 128 bytes apart. Every load and store then has a 32-byte sector (a
     64-byte line on the CPU) to itself, and the sector's neighbours come round only after n/32 other
     elements, long after the caches dropped it (n/32 sectors is n bytes per tensor: 512 MB at the CUDA
     default, against a 50 MB L2): about 8x the memory traffic of the straight walk, plus a 64-bit division,
     so it is correct and slower than eager (`correct`, reward 1).
   The index line's two expressions start with different tokens, so the decision is one token.
2. The variants are judged before anything is trained (`--check-repeats` times each, through the same judge
   as the PPO steps): the summary's `variants` shows what each earns on this machine, and warns when the
   straight walk is not faster than eager or the strided one is.
3. A tiny Qwen3 (bench.proofs.family's model, SFT and offline diagnostic) is fine-tuned on demonstrations of which
   `--demo-slow` (70%) take the strided walk, so the policy starts well below the best. Models,
   checkpoints and kept builds go to `--work`, the results alone to `--out`.
4. PPO (training.ppo.warmup.run_warmup) for at most `--minutes`, every response judged by the real judge:
   compile, verify and a paired profile (eager timed beside the candidate, sandbox/timing/paired.py) with
   the cheap but complete settings in PROFILE (`--profile KEY=VALUE` changes them). Identical files of a
   task are built and verified once (the workspace is kept), and every response is profiled again in a
   pairing of its own (WarmupConfig.reprofile): no reward rests on a cached time. That is also how the
   noise is measured: responses with the same files judged more than once (within a step, across the
   run) and how often they got different milestones (`flips`: groups of such repeats, groups with more
   than one milestone, share of pairs that disagree); a converging policy repeats itself, so there are
   many repeats.
5. OUT/metrics.jsonl (every step's metrics), OUT/responses.jsonl (every response with milestone,
   speedup and how it was judged), OUT/ppo_speed.png, OUT/summary.json (variants, diagnostics, per step:
   share faster than eager, mean reward, share of straight and strided texts, flips; flips over the run).

    python -m bench.proofs.speed --out $OUT --work /tmp/ps --minutes 4 --advantage-estimator grpo  # H100: ~8 min
    python -m bench.proofs.speed --out /tmp/ps --device cpu --backend cpu --tasks 1 --rows 4096 --layers 1 \\
        --hidden 64 --sft-steps 2 --diagnose 1 --samples 2 --steps 1 --judge-workers 2   # CPU smoke, ~3 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections import defaultdict
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.proofs import family as pl  # noqa: E402
from bench.proofs.speed_family import (  # noqa: E402
    FAST,
    FASTER,
    PROFILE,
    SLOW,
    TASKS,
    VARIANTS,
    classify,
    demonstrations,
    response,
    write_tasks,
)


def diagnose(model_dir: Path, tasks: dict, backend: str, system: str | None, per_task: int, temperature: float,
             max_new: int, device: str) -> dict:
    texts = pl.sample_texts(model_dir, tasks, backend, system, per_task, temperature, max_new, device)
    kinds = {n: [classify(t, n, backend) for t in ts] for n, ts in texts.items()}
    flat = [k for ks in kinds.values() for k in ks]
    return {"samples": len(flat), "temperature": temperature,
            **{k: flat.count(k) / len(flat) for k in (*VARIANTS, "malformed")},
            "per_task": {n: {k: ks.count(k) / len(ks) for k in VARIANTS} for n, ks in kinds.items()}}


def flips(rows: list[dict]) -> dict:
    """Responses whose files were judged more than once, each judgment with a profile of its own (rows that
    reused a verdict, from the cache or from an identical response of the step, do not count): groups of
    such repeats, how many got more than one milestone, the share of pairs within a group that disagree."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.get("judged") in ("full", "reprofiled"):
            groups[r["key"]].append(r["milestone"])
    rep = [g for g in groups.values() if len(g) > 1]
    pairs = [(a, b) for g in rep for a, b in combinations(g, 2)]
    return {"repeat_groups": len(rep), "repeat_judgments": sum(map(len, rep)),
            "groups_flipped": sum(len(set(g)) > 1 for g in rep),
            "pair_flip_rate": sum(a != b for a, b in pairs) / len(pairs) if pairs else None}


def step_stats(rows: list[dict], name_of: dict[str, str], backend: str) -> dict:
    kinds = [classify(r["response"], name_of[r["task_id"]], backend) for r in rows]
    n = max(1, len(rows))
    return {"faster_than_eager": sum(r["milestone"] in FASTER for r in rows) / n,
            "reward": sum(r["reward"] for r in rows) / n,
            **{f"{v}_text": kinds.count(v) / n for v in VARIANTS}, "flips": flips(rows),
            "timing_noisy": sum(r.get("reason") == "timing_noisy" for r in rows)}


def by_variant(rows: list[dict], name_of: dict[str, str], backend: str) -> dict:
    """Over the run: each variant's milestones, and the flips among its repeats."""
    out = {}
    for v in VARIANTS:
        mine = [r for r in rows if classify(r["response"], name_of[r["task_id"]], backend) == v]
        counts: dict[str, int] = defaultdict(int)
        for r in mine:
            counts[r["milestone"]] += 1
        out[v] = {"responses": len(mine), "milestones": dict(counts), "flips": flips(mine)}
    return out


def check_variants(judge, tasks: dict, backend: str, repeats: int, root: Path) -> dict:
    """Each task's variants judged `repeats` times (the first builds and verifies, the others profile again)."""
    from training.ppo.warmup import parse_solution

    labels = [(n, v) for n in tasks for v in VARIANTS for _ in range(repeats)]
    results = judge([(tasks[n], parse_solution(response(n, v, backend))) for n, v in labels], root)
    out: dict = {n: {v: [] for v in VARIANTS} for n in tasks}
    for (n, v), r in zip(labels, results, strict=True):
        out[n][v].append({k: r.get(k) for k in ("milestone", "reward", "speedup_vs_eager", "speedup_vs_compile",
                                                 "reason", "verify_ok", "judge_s")})
    return out


def variant_warnings(check: dict) -> list[str]:
    bad = []
    for n, vs in check.items():
        for r in vs[FAST]:
            if r["milestone"] not in FASTER:
                bad.append(f"{n}: the straight walk got {r['milestone']} ({r['speedup_vs_eager']}x eager, {r['reason']})")
        for r in vs[SLOW]:
            if r["milestone"] != "correct":
                bad.append(f"{n}: the strided walk got {r['milestone']} ({r['speedup_vs_eager']}x eager, {r['reason']})")
    return bad


def plot(per_step: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in per_step]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in per_step], marker="o", label="mean reward")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("mean reward (1 correct, 2 beats eager, 3 beats compile)")
    ax.set_ylim(-1.1, 3.1)
    ax2 = ax.twinx()
    ax2.plot(steps, [r["faster_than_eager"] for r in per_step], marker="s", color="tab:green",
             label="share faster than eager (judge)")
    ax2.plot(steps, [r[f"{FAST}_text"] for r in per_step], ls="--", color="tab:olive", label="straight walk, exact text")
    rates = [(r["step"], r["flips"]["pair_flip_rate"]) for r in per_step if r["flips"]["pair_flip_rate"] is not None]
    if rates:
        ax2.plot(*zip(*rates, strict=True), ls=":", marker="x", color="tab:red",
                 label="repeats with different milestones (pairs)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("share of responses")
    fig.legend(loc="lower center", ncol=2, fontsize="small", bbox_to_anchor=(0.5, 0.12))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _values(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def ppo_settings(args, model: str, device: str):
    """PPOConfig from the flags; --set FIELD=VALUE for any field, --advantage-estimator through the same path.
    A field this tree's PPOConfig lacks stops the run before anything is trained."""
    import typer

    from training.ppo.cli import ppo_config
    from training.ppo.config import PPOConfig

    sets = list(args.set)
    if args.advantage_estimator:
        if "advantage_estimator" not in {f.name for f in dataclasses.fields(PPOConfig)}:
            sys.exit("error: --advantage-estimator: this tree's PPOConfig has no advantage_estimator field (it "
                     "comes with PPOConfig's GRPO option, issue 25 part 4)")
        sets.append(f"advantage_estimator={args.advantage_estimator}")
    try:
        return ppo_config(model, device, sets, actor_lr=args.actor_lr, critic_lr=args.critic_lr, gamma=1.0, lam=1.0,
                          ppo_epochs=2, minibatches=2, micro_batch_size=16, kl_coef=args.kl_coef,
                          whiten_advantages=args.whiten_advantages, bf16=False, entropy_coef=0.0)
    except typer.Exit as e:  # ppo_config printed why
        sys.exit(e.exit_code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="results: summary.json, ppo_speed.png, metrics.jsonl, responses.jsonl (small)")
    ap.add_argument("--work", type=Path, default=None,
                    help="models, checkpoints, kept builds (default: OUT/work; put it outside a device call's OUT)")
    ap.add_argument("--device", default=None, help="default: cuda if visible")
    ap.add_argument("--backend", default=None, help="workspace backend (default: cuda if visible)")
    ap.add_argument("--tasks", type=int, default=4, help=f"how many of the {len(TASKS)} chains")
    ap.add_argument("--rows", type=int, default=None,
                    help="rows of the [rows, 1024] input (default: 131072 on CUDA, 128M floats; 4096 on the CPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=4.0, help="PPO time budget (the step that passes it is the last)")
    ap.add_argument("--steps", type=int, default=1000, help="PPO steps at most (0: variants, SFT and diagnostic)")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--demo-slow", type=float, default=0.7, help="share of demonstrations with the strided walk")
    ap.add_argument("--demos-per-task", type=int, default=10)
    ap.add_argument("--check-repeats", type=int, default=2, help="judgments of each variant before training (0: skip)")
    ap.add_argument("--diagnose", type=int, default=16, help="samples per task for the offline diagnostic (0: skip)")
    ap.add_argument("--samples", type=int, default=8, help="responses per task per PPO step")
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--actor-lr", type=float, default=3e-5)
    ap.add_argument("--critic-lr", type=float, default=3e-4)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--whiten-advantages", action="store_true")
    ap.add_argument("--advantage-estimator", choices=("gae", "grpo"), default=None,
                    help="PPOConfig.advantage_estimator (default: PPOConfig's own). On the CPU check of "
                         "docs/ppo.md GRPO learned the walk and GAE with bench.proofs.family's settings did not")
    ap.add_argument("--set", action="append", default=[], help="PPOConfig FIELD=VALUE (repeatable)")
    ap.add_argument("--profile", action="append", default=[], help=f"ProfileConfig KEY=VALUE over {PROFILE}")
    ap.add_argument("--judge-workers", type=int, default=8,
                    help="judgments at once (timings still take the GPU one at a time; each holds two workers)")
    args = ap.parse_args()

    import torch

    from harness.specs import select_tasks
    from sandbox.backend import resolve_backend
    from sandbox.config import ProfileConfig
    from training.models import load_tokenizer, make_tiny_model
    from training.ppo.stage import read_metrics
    from training.ppo.warmup import Judge, WarmupConfig, run_warmup

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(args.backend)
    rows = args.rows or (131072 if backend == "cuda" else 4096)
    profile = {**PROFILE, **_values(args.profile)}
    ProfileConfig(**profile)  # refuse a bad --profile before anything runs
    ppo = ppo_settings(args, "", device)  # and a bad --set
    names = list(TASKS)[: args.tasks]
    system = pl.SHORT_SYSTEM
    work = args.work or args.out / "work"
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_tasks(work / "tasks", rows, names)
    tasks = {t.name: t for t in select_tasks([str(work / "tasks")])}
    tasks = {n: tasks[n] for n in names}
    name_of = {t.id: n for n, t in tasks.items()}
    cfg = WarmupConfig(ppo=ppo, tasks=[str(work / "tasks")], out=work / "ppo", steps=args.steps,
                       prompts_per_step=len(tasks), samples=args.samples, max_new_tokens=0,
                       temperature=args.temperature, system_prompt=system, backend=backend,
                       judge_workers=args.judge_workers, judge_cache=True, reprofile=True, profile=profile,
                       save_every=1000, time_limit_s=args.minutes * 60, tensorboard=False)
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "backend": backend, "rows": rows, "profile": profile,
                     "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}

    def save() -> None:
        summary["total_s"] = time.perf_counter() - t0
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    if args.check_repeats:
        check = check_variants(Judge(cfg, backend), tasks, backend, args.check_repeats, cfg.out / "workspaces" / "check")
        summary["variants"], summary["variant_warnings"] = check, variant_warnings(check)
        summary["check_s"] = time.perf_counter() - t0
        print(json.dumps({"variants": {n: {v: [(r["milestone"], r["speedup_vs_eager"] and round(r["speedup_vs_eager"], 2))
                                              for r in rs] for v, rs in vs.items()} for n, vs in check.items()},
                          "warnings": summary["variant_warnings"], "check_s": round(summary["check_s"])}), flush=True)
        save()

    base = work / "tiny"
    if not (base / "config.json").is_file():
        make_tiny_model(base, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, vocab=4096)
    tok = load_tokenizer(str(base))
    longest = max(len(tok.encode(response(n, v, backend), add_special_tokens=False)) for n in names for v in VARIANTS)
    cfg.max_new_tokens = longest + 32  # room for a little drift; a response that runs past it is cut and fails
    demos = demonstrations(tasks, backend, args.demos_per_task, args.demo_slow)
    sft_dir = work / "sft"
    if not (sft_dir / "config.json").is_file():
        pl.supervised(base, sft_dir, demos, backend, system, args.sft_steps, args.sft_lr, device, args.sft_batch)
    summary.update(response_tokens=longest, demos=len(demos), fast_demos=sum(d[2] for d in demos),
                   sft_s=time.perf_counter() - t0)
    if args.diagnose:
        summary["diagnostic_sft"] = diagnose(sft_dir, tasks, backend, system, args.diagnose, args.temperature,
                                             cfg.max_new_tokens, device)
        print(json.dumps({"diagnostic_sft": summary["diagnostic_sft"]}), flush=True)
    save()
    if args.steps == 0:
        return

    cfg.ppo = dataclasses.replace(ppo, model=str(sft_dir))
    per_step: list[dict] = []
    title = (f"PPO learns speed: {len(tasks)} chains ({summary['device']}, T={args.temperature}, "
             f"{args.demo_slow:.0%} slow demos)")

    def progress(step: int, m: dict) -> None:
        rows_ = [r for r in map(json.loads, (cfg.out / "responses.jsonl").read_text().splitlines()) if r["step"] == step]
        s = {"step": step, **step_stats(rows_, name_of, backend), "pass_rate": m["pass_rate"],
             "reprofiled": m["judge_reprofiled"], "generate_s": round(m["generate_s"], 1),
             "judge_wall_s": round(m["judge_wall_s"], 1), "learn_s": round(m["learn_s"], 1),
             "elapsed_s": round(time.perf_counter() - t0)}
        per_step.append(s)
        print(json.dumps(s), flush=True)
        summary["per_step"] = per_step
        save()  # a run cut short keeps its results so far
        for f in ("metrics.jsonl", "responses.jsonl"):
            shutil.copyfile(cfg.out / f, args.out / f)
        plot(per_step, args.out / "ppo_speed.png", title)

    run_warmup(cfg, progress)
    if args.diagnose and (cfg.out / "final" / "config.json").is_file():
        summary["diagnostic_final"] = diagnose(cfg.out / "final", tasks, backend, system, args.diagnose,
                                               args.temperature, cfg.max_new_tokens, device)
        print(json.dumps({"diagnostic_final": summary["diagnostic_final"]}), flush=True)
    every = [json.loads(ln) for ln in (cfg.out / "responses.jsonl").read_text().splitlines()]
    summary.update(steps=len(read_metrics(cfg.out)), flips=flips(every), by_variant=by_variant(every, name_of, backend),
                   first=per_step[0] if per_step else None, last=per_step[-1] if per_step else None)
    save()
    print(json.dumps({k: summary.get(k) for k in ("device", "steps", "first", "last", "flips", "total_s")}), flush=True)


if __name__ == "__main__":
    main()
