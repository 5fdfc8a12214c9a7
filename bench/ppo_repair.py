"""Proof that multi-turn episodes repair: the agent loop over the MCP tools, a tiny model, the real judge.

1. Tasks: bench/ppo_learns.py's elementwise operators. The expert solution is one text for every task but
   the expression line; a wrong expression builds and then fails `verify` with a value mismatch.
2. Demonstrations are real harness episodes of a scripted expert that reads its tools' answers: turn 1
   writes model_new.py and the kernel with some expression, compiles and verifies; if verify passed it
   answers "Done." (a first-try episode), otherwise turn 2 says what the reference returns and writes the
   kernel anew with the task's own expression (`--repair rewrite`; `edit` replaces the expression line
   instead), compiles and verifies again, and turn 3 answers (a repair episode). A fraction
   `--demo-noise` of each task's demonstrations starts with a confuser's expression (as in ppo_learns), so
   the fine-tuned policy's first attempt is often wrong, and a share `--give-up` of those answers after the
   failed verify without repairing, so the fine-tuned policy repairs only some of its failures: PPO can
   raise the share that ends correct by making it read the feedback and repair every time.
3. A tiny Qwen3 is fine-tuned on those conversations (loss on the assistant turns only: the chat
   template's generation marks, tool output masked).
4. `train ppo`'s loop (training.ppo.agentic.run_ppo): each step runs `--samples` episodes per task through
   the harness against the in-process engine, at most `--max-turns` model calls each, judged by the
   harness's judge, and updates the policy over whole episodes (tool output masked). Every correct
   episode writes one kernel text, so the judge's speed milestones earn `correct`'s reward (`--speed-rewards`
   restores the paper's scale).
5. Per step: the share of episodes the judge found correct within the turn budget (`pass_rate`) beside the
   share whose first turn's verify had passed (`solved_first_turn`): the gap is what reading the feedback
   added. OUT/ppo/metrics.jsonl has every step (and the per-turn series the viewer charts),
   OUT/ppo_repair.png plots them, OUT/summary.json has the first and last steps.

    python bench/ppo_repair.py --out /tmp/repair --minutes 6           # H100: one device call; repeat to resume
    python bench/ppo_repair.py --out /tmp/rp --device cpu --backend cpu --tasks 2 --layers 1 --hidden 64 \\
        --sft-steps 30 --samples 1 --steps 1 --concurrency 2           # CPU smoke: every part once
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.ppo_learns import OPS, SHORT_SYSTEM, expert_files, pick_confusers, write_tasks  # noqa: E402
from bench.repair_sft import (  # noqa: E402, F401 (re-exported: tests and paper_stages import them from here)
    demo_sequences,
    fit_sequences,
    longest,
    sft_diagnostic,
    turn_ids,
    vary_numbers,
)

# the model sees the four tools a repair needs; the rest of the server's tools stay hidden from it
SHOWN_TOOLS = ("write_file", "edit_file", "compile", "verify")
HIDDEN_TOOLS = ["list_tasks", "open_task", "close_workspace", "list_files", "read_file", "profile", "read_skill"]
DONE = "Done."


def kernel_path(backend: str) -> str:
    return "kernels/op.cu" if backend == "cuda" else "kernels/op.cpp"


def expression_line(op: str) -> str:
    """The text an edit replaces: `= expr;` occurs once in either backend's kernel."""
    return f"= {OPS[op][1]};"


def _call(turn: int, i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"demo_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def plans(fam: Family) -> dict[str, list[tuple[str, bool]]]:
    """Per task, the demonstration episodes by sample number: (expression of the first attempt, whether a
    failed verify is repaired). Sample 0 starts right; then each confuser once repaired, once given up."""
    return {n: [(n, True), *((c, True) for c in fam.confusers[n]), *((c, False) for c in fam.confusers[n])]
            for n in fam.names}


REPAIRS = ("rewrite", "edit")


def repair_reason(op: str) -> str:
    """What the repair turn says before it acts: the reference's expression, read off the task, and the
    kernel's expression it implies. A tiny model picks the right expression for the repair by copying the
    first from its prompt and mapping it to the second next to where it writes it, where a bare tool call
    would have to fetch the task from ~700 tokens back (issue 36: its live repairs wrote a wrong expression
    in 3 of 11 edits)."""
    return f"verify failed. The reference returns {OPS[op][0]}, so the kernel must compute {OPS[op][1]}."


def repair_calls(name: str, first: str, backend: str, how: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of a repair: rewrite the kernel file with the task's expression, or edit the first
    attempt's expression line into it. An edit must copy the failed expression into old_text, which a tiny
    model gets wrong (issue 36: 5 of 11 live edits missed their own text); a rewrite needs no copy of it."""
    path = kernel_path(backend)
    if how == "rewrite":
        return [("write_file", {"path": path, "content": expert_files(OPS[name][1], backend)[path]})]
    return [("edit_file", {"path": path, "old_text": expression_line(first), "new_text": expression_line(name)})]


class RepairExpert:
    """A scripted expert (harness Policy) that decides from the tool results it is given: the episode's
    sample number picks its plan (`plans`): the expression of its first attempt, and whether after a failed
    verify it repairs or answers as it is. A repair by `how="rewrite"` says what the reference computes
    (`repair_reason`) and writes the kernel anew; by `"edit"` it is a bare edit of the expression line (the
    form of the runs before issue 36's rewrite). Its turns are what the tiny model is fine-tuned on."""

    def __init__(self, plan: dict[str, list[tuple[str, bool]]], name_of: dict[str, str], how: str = "rewrite"):
        if how not in REPAIRS:
            raise ValueError(f"repair by one of {REPAIRS}, not {how!r}")
        self.plan, self.name_of, self.how = plan, name_of, how

    def describe(self) -> dict[str, Any]:
        return {"provider": "scripted", "model": "repair-expert"}

    def sampling(self) -> dict[str, Any]:
        return {}

    async def complete(self, ctx: Any, messages: list[dict[str, Any]], tools: Any, max_tokens: int | None) -> Any:
        from harness.policy import ModelTurn

        name = self.name_of[ctx.task.id]
        first, repairs = self.plan[name][ctx.sample]
        turn = sum(m["role"] == "assistant" for m in messages)
        last_verify = next((m["content"] for m in reversed(messages) if m["role"] == "tool"), "")
        check = [("compile", {}), ("verify", {})]
        if turn == 0:
            files = expert_files(OPS[first][1], ctx.backend)
            calls = [("write_file", {"path": p, "content": body}) for p, body in files.items()] + check
        elif turn == 1 and repairs and not last_verify.startswith("verify OK"):
            calls = repair_calls(name, first, ctx.backend, self.how) + check
        else:
            return ModelTurn(message={"role": "assistant", "content": DONE}, finish_reason="stop")
        # the edit form stays as the runs before the rewrite had it: a bare tool call
        message = {"role": "assistant", "content": repair_reason(name) if turn and self.how == "rewrite" else "",
                   "tool_calls": [_call(turn, i, n, a) for i, (n, a) in enumerate(calls)]}
        return ModelTurn(message=message, finish_reason="tool_calls")

    async def end_episode(self, ctx: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


@dataclass
class Family:
    out: Path
    names: list[str]
    tasks: dict[str, Any]  # name -> Task
    tasks_dir: Path
    backend: str
    device: str
    confusers: dict[str, list[str]]


def make_family(out: Path, n_tasks: int, rows: int, backend: str | None, device: str | None,
                confusers: int = 2) -> Family:
    import torch

    from harness.specs import select_tasks
    from sandbox.backend import resolve_backend

    names = list(OPS)[:n_tasks]
    out.mkdir(parents=True, exist_ok=True)
    write_tasks(out / "tasks", rows, names)
    by_name = {t.name: t for t in select_tasks([str(out / "tasks")])}
    return Family(out=out, names=names, tasks={n: by_name[n] for n in names}, tasks_dir=out / "tasks",
                  backend=resolve_backend(backend), device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                  confusers=pick_confusers(names, confusers))


def agent_settings(max_turns: int, backend: str) -> dict[str, Any]:
    return {"backend": backend, "max_turns": max_turns, "system_prompt": SHORT_SYSTEM, "hidden_tools": HIDDEN_TOOLS}


def collect_demos(fam: Family, out: Path, concurrency: int, verify_trials: int = 1, how: str = "rewrite") -> list[Any]:
    """One real episode per plan (`plans`): the task's own expression first (sample 0), then each confuser's
    first and repaired by `how`, then each confuser's first and left as it is."""
    import anyio

    from harness.config import AgentConfig, JudgeConfig, ModelConfig, RolloutConfig
    from harness.rollout import records_of, run_rollout

    plan = plans(fam)
    expert = RepairExpert(plan, {t.id: n for n, t in fam.tasks.items()}, how)
    cfg = RolloutConfig(tasks=[str(fam.tasks_dir)], samples=len(next(iter(plan.values()))),
                        concurrency=concurrency, out=out, resume=True, progress=False,
                        # the validator wants a model or a replay folder; the expert passed below answers instead
                        model=ModelConfig(model="repair-expert", base_url=["http://127.0.0.1:9/v1"]),
                        agent=AgentConfig(**agent_settings(4, fam.backend)),
                        judge=JudgeConfig(verify_trials=verify_trials))
    anyio.run(run_rollout, cfg, expert)
    return list(records_of(out).values())


def ppo_config(fam: Family, out: Path, model: Path, args: Any, critic_model: Path | None = None) -> Any:
    from training.ppo.agentic import AgentPPOConfig
    from training.ppo.config import PPOConfig

    # lam = gamma = 1: every model token of an episode carries its return minus the critic's value; not
    # whitened and a small actor lr, the settings under which ppo_learns kept its text intact
    ppo = PPOConfig(model=str(model), critic_model=str(critic_model) if critic_model else None, device=fam.device,
                    actor_lr=args.actor_lr, critic_lr=args.critic_lr, gamma=1.0, lam=1.0, ppo_epochs=2,
                    minibatches=2, micro_batch_size=args.micro_batch, whiten_advantages=False,
                    advantage_estimator=getattr(args, "advantage_estimator", "gae"))
    return AgentPPOConfig(ppo=ppo, tasks=[str(fam.tasks_dir)], out=out, steps=args.steps, samples=args.samples,
                          concurrency=args.concurrency, backend=fam.backend, tool_urls=[],
                          context_tokens=args.context_tokens, max_response_tokens=args.max_response_tokens,
                          verify_trials=args.verify_trials, save_every=1000, tensorboard=False, top_p=args.top_p,
                          time_limit_s=args.minutes * 60, reward=None if getattr(args, "speed_rewards", True)
                          else dict(CORRECTNESS_ONLY), **{k: v for k, v in agent_settings(
                              args.max_turns, fam.backend).items() if k != "backend"})


# every correct episode of this family writes one kernel text, so a speed milestone between two of them is the
# timing noise of the moment (the H200 paper_stages run's first PPO steps: 6 of 34 correct episodes
# `faster_than_eager`, reward 2 against 1, speedups 1.13-1.69 of identical kernels; 61 of 237 in the rewrite
# runs); as a reward it is noise in the group baselines
CORRECTNESS_ONLY = {"faster_than_eager": 1.0, "faster_than_compile": 1.0}

STEP_KEYS = ("pass_rate", "solved_first_turn", "verified_by_turn/2", "reward/mean", "turns/mean",
             "tool_calls/write_file", "tool_calls/edit_file", "tool_calls/verify", "value/explained_variance", "rollout_s", "learn_s")


def step_line(step: int, m: dict[str, Any], t0: float) -> str:
    return json.dumps({"step": step, **{k: round(m[k], 3) for k in STEP_KEYS if isinstance(m.get(k), int | float)},
                       "elapsed_s": round(time.perf_counter() - t0)})


def plot(rows: list[dict], path: Path, title: str, others: dict[str, list[dict]] | None = None) -> None:
    """Per step: the share correct within the turn budget and the share solved on the first turn (and, with
    `others`, the same two series of other runs, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rs, style in [("", rows, "-"), *((f" ({k})", v, "--") for k, v in (others or {}).items())]:
        steps = [r["step"] for r in rs]
        ax.plot(steps, [r.get("pass_rate", 0) for r in rs], style, marker="o", color="tab:green",
                label=f"correct within the turn budget{label}")
        ax.plot(steps, [r.get("solved_first_turn", 0) for r in rs], style, marker="s", color="tab:blue",
                label=f"solved on the first turn{label}")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("share of episodes")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small", loc="center right")  # the shares sit near 1 and below 0.4
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(rows: list[dict]) -> dict[str, Any]:
    keys = ("pass_rate", "solved_first_turn", "reward/mean", "turns/mean")
    pick = (lambda r: {k: r.get(k) for k in keys}) if rows else None
    return {"steps": len(rows), "first": pick(rows[0]) if rows else None, "last": pick(rows[-1]) if rows else None,
            "per_step": [{"step": r["step"], **{k: r.get(k) for k in (*keys, "value/explained_variance")}}
                         for r in rows]}


def add_common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default=None, help="default: cuda if visible")
    ap.add_argument("--backend", default=None, help="workspace backend (default: cuda if visible)")
    ap.add_argument("--tasks", type=int, default=4, help=f"how many of the {len(OPS)} operators")
    ap.add_argument("--rows", type=int, default=4096, help="rows of the tasks' [rows, 1024] input")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--demo-noise", type=float, default=0.6, help="share of demonstrations whose first try is wrong")
    ap.add_argument("--give-up", type=float, default=0.3,
                    help="share of the wrong-first demonstrations that answer after the failed verify, unrepaired. "
                         "Their context is the repairs' (the plan is not in it), so this is the noise on the "
                         "decision: a faithful SFT model repairs 1 - give_up of its failures, and 0.5 would put the "
                         "issue's 'at least half' exactly at the expectation; 0.3 leaves PPO 30%% to recover")
    ap.add_argument("--demos-per-task", type=int, default=10)
    ap.add_argument("--repair", choices=REPAIRS, default="rewrite",
                    help="how the demonstrations repair (when they are collected): rewrite says what the reference "
                         "computes and writes the kernel file anew; edit replaces the expression line, which needs a "
                         "copy of the failed text (the form before issue 36's live repairs were read)")
    ap.add_argument("--demo-numbers", choices=("fresh", "fixed"), default="fresh",
                    help="fresh: every SFT draw of a demonstration gets new numbers in its tool results; fixed: the "
                         "copies' numbers are drawn once (before issue 36: the model keyed its repair-or-give-up "
                         "decision on them and, on numbers of its own, repaired none; bench/repair_sft.py)")
    ap.add_argument("--samples", type=int, default=6, help="episodes per task per PPO step")
    ap.add_argument("--concurrency", type=int, default=16, help="episodes at once")
    ap.add_argument("--max-turns", type=int, default=4, help="the turn budget: model calls per episode")
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--max-response-tokens", type=int, default=1024,
                    help="per model call (turn 1 writes both files: ~630 tokens for the cuda backend)")
    ap.add_argument("--verify-trials", type=int, default=1, help="the judge's verify trials")
    ap.add_argument("--top-p", type=float, default=0.98,
                    help="nucleus of the episodes' sampling (temperature is 1 in train ppo). A tiny model leaves ~1%% "
                         "of each position's mass spread over the vocabulary's tail, which over a 450-token tool call "
                         "breaks nearly every first turn at top-p 1 (CPU: 7 of 8 after SFT to loss 0.01); 0.98 cuts "
                         "the tail and keeps the expression choice. The learner scores the untruncated distribution: "
                         "its ratio for a sampled token is off by at most -log(top_p)")
    ap.add_argument("--actor-lr", type=float, default=3e-5)
    ap.add_argument("--critic-lr", type=float, default=3e-4)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=6.0,
                    help="time budget of this call: no PPO step starts that would likely pass it")
    ap.add_argument("--steps", type=int, default=1000, help="PPO steps at most")


def demos(fam: Family, args: Any) -> list[Any]:
    """The demonstration episodes (collected once, then read back)."""
    from harness.rollout import records_of

    folder = fam.out / "demos"
    if (folder / "summary.json").is_file():
        return list(records_of(folder).values())
    return collect_demos(fam, folder, args.concurrency, how=args.repair)


def sft_model(fam: Family, args: Any, extra: list[tuple] | None = None) -> Path:
    """The tiny model fine-tuned on the repair demonstrations (and `extra` sequences); reused when present."""
    from training.models import load_tokenizer, make_tiny_model

    sft_dir = fam.out / "sft"
    if (sft_dir / "config.json").is_file():
        return sft_dir
    base = fam.out / "tiny"
    if not (base / "config.json").is_file():
        make_tiny_model(base, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, vocab=4096)
    tok = load_tokenizer(str(base))
    records = demos(fam, args)
    correct = sum(r.reward is not None and r.reward > 0 for r in records)
    seqs = demo_sequences(records, tok, fam, args.demos_per_task, args.demo_noise, args.give_up,
                          fresh=args.demo_numbers == "fresh") + list(extra or [])
    print(json.dumps({"demo_episodes": len(records), "demo_correct": correct, "sequences": len(seqs),
                      "demo_numbers": args.demo_numbers, "tokens_max": longest(seqs)}), flush=True)
    return fit_sequences(base, sft_dir, seqs, args.sft_steps, args.sft_lr, fam.device, args.sft_batch)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(ap)
    ap.add_argument("--diagnose", type=int, default=16,
                    help="first turns sampled per task from the fine-tuned model, each failed one followed by a "
                         "failed verify and a sampled second turn, compared with the demonstrations (0: skip); "
                         "--steps 0 stops after it")
    ap.add_argument("--advantage-estimator", default="gae", help="gae, grpo or trloo (training.ppo.advantages)")
    ap.add_argument("--speed-rewards", action="store_true",
                    help="reward the judge's speed milestones as the paper's scale does (default: every correct "
                         "episode earns `correct`'s reward, as they all write one kernel; CORRECTNESS_ONLY)")
    ap.add_argument("--estimators", default=None,
                    help="comma-separated: one PPO run per estimator from the same SFT model, each in OUT/ppo-NAME "
                         "with an equal share of the time left, plotted together (e.g. grpo,trloo)")
    # feedback is worth what the first try misses: at 0.6 PPO learned the first try (0.38 -> 0.75 in two updates)
    # as it learned to repair, so every episode ended correct with a gap of 0.25; at 0.8 the SFT policy is right
    # first ~1 time in 5 and what PPO adds is the repairs (docs/training.md, "Repairs that rewrite")
    ap.set_defaults(demo_noise=0.8)
    return ap


def main() -> None:
    args = parser().parse_args()

    import torch

    from training.ppo.agentic import run_ppo
    from training.ppo.stage import read_metrics

    t0 = time.perf_counter()
    fam = make_family(args.out, args.tasks, args.rows, args.backend, args.device)
    sft = sft_model(fam, args)
    diag = None
    if args.diagnose and not (args.out / "diagnostic_sft.json").is_file():
        diag = sft_diagnostic(sft, demos(fam, args), fam, args.diagnose, args.top_p)
        (args.out / "diagnostic_sft.json").write_text(json.dumps(diag))
        print(json.dumps({"diagnostic_sft": diag}), flush=True)
    elif (args.out / "diagnostic_sft.json").is_file():
        diag = json.loads((args.out / "diagnostic_sft.json").read_text())
    if args.steps == 0:
        return
    names = args.estimators.split(",") if args.estimators else [args.advantage_estimator]
    runs: dict[str, list[dict]] = {}
    for i, name in enumerate(names):
        args.advantage_estimator = name
        cfg = ppo_config(fam, args.out / ("ppo" if not args.estimators else f"ppo-{name}"), sft, args)
        left = args.minutes * 60 - (time.perf_counter() - t0)
        cfg.time_limit_s = max(60.0, left / (len(names) - i))  # --minutes bounds the call, shared by the runs
        run_ppo(cfg, lambda step, m, n=name: print(json.dumps({"estimator": n, **json.loads(step_line(step, m, t0))}),
                                                   flush=True))
        runs[name] = read_metrics(cfg.out)
    first, *others = names
    plot(runs[first], args.out / "ppo_repair.png",
         f"multi-turn PPO ({first}{' vs ' + ', '.join(others) if others else ''}), {len(fam.names)} repair tasks "
         f"({fam.device}), {args.max_turns}-turn budget", {k: runs[k] for k in others})
    summary = {"device": torch.cuda.get_device_name() if fam.device.startswith("cuda") else "cpu",
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "diagnostic_sft": diag, "total_s": time.perf_counter() - t0, **summarize(runs[first]),
               "by_estimator": {k: summarize(v) for k, v in runs.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("device", "steps", "first", "last", "total_s")}), flush=True)

if __name__ == "__main__":
    main()
