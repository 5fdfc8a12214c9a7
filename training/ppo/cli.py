"""`cuda-agent train warmup | critic | ppo`: registered on training.cli's train app. Nothing heavy is
imported here (torch, transformers load inside the commands). Every PPOConfig field can be set with
`--set FIELD=VALUE` (e.g. --set kl_coef=0.01 --set lora_r=16); the common ones have their own flags."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

Model = Annotated[str, typer.Option("--model", help="actor initialization: a folder (e.g. RFT's final/) or hub id")]
Out = Annotated[Path, typer.Option("--out", help="output folder (checkpoints, metrics.jsonl, tb/, final/)")]
Steps = Annotated[int, typer.Option(help="steps to run (a resumed run continues up to this)")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="PPOConfig FIELD=VALUE (repeatable)")]
Device = Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 (default: cuda if visible)")]
Fresh = Annotated[bool, typer.Option("--fresh", help="refuse to resume; fail if OUT holds checkpoints")]
NoTB = Annotated[bool, typer.Option("--no-tensorboard", help="metrics.jsonl only")]
SaveEvery = Annotated[int, typer.Option(help="checkpoint every N steps (and at the end)")]
Rewards = Annotated[list[str] | None, typer.Option("--reward", help="judge's milestone reward NAME=VALUE "
                                                                    "(repeatable; sandbox.config.RewardConfig, e.g. "
                                                                    "faster_than_eager=1.0)")]
Ray = Annotated[str | None, typer.Option("--ray", help="judge on a Ray cluster's judge actors: local, auto or "
                                                      "HOST:PORT (needs the ray extra)")]


def _bad_input() -> tuple[type[BaseException], ...]:
    """What a stage raises for bad input (exit 2); anything else is a failure with its traceback."""
    from tasks import TaskError

    return FileExistsError, FileNotFoundError, TaskError


def _cluster_error() -> tuple[type[BaseException], ...]:
    """--ray: a cluster that cannot serve the run (unreachable, no actors) is bad input too."""
    try:
        from harness.cluster.connect import ClusterError
    except ImportError:
        return ()
    return (ClusterError,)


def _fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _rewards(items: list[str] | None) -> dict[str, float] | None:
    """--reward NAME=VALUE items as AgentPPOConfig.reward, checked against RewardConfig before anything runs."""
    from training.ppo.agentic import reward_config

    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key.strip()] = float(raw)  # "" (no "=") and words raise alike
        except ValueError:
            _fail(f"--reward {item!r}: expected NAME=NUMBER")
    try:
        reward_config(out)
    except ValidationError as e:  # one line: each NAME=VALUE given and its rule
        _fail("; ".join(f"--reward {'.'.join(map(str, err['loc']))}={err.get('input')}: "
                        f"{err['msg'].removeprefix('Input ')}" for err in e.errors(include_url=False)))
    except ValueError as e:
        _fail(f"--reward: {e}")
    return out


def ppo_config(model: str, device: str | None, sets: list[str] | None, **given: Any) -> Any:
    from training.ppo.config import PPOConfig

    cfg = PPOConfig(model=model, device=device, **{k: v for k, v in given.items() if v is not None})
    types = {f.name: f.type for f in dataclasses.fields(PPOConfig)}
    for item in sets or []:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            _fail(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(types))}")
        text = raw.strip()
        try:
            value = None if text.lower() in ("none", "null") else json.loads(text.lower() if text.lower() in (
                "true", "false") else text)
        except json.JSONDecodeError:
            value = text
        setattr(cfg, key, value)
    if cfg.kl_estimator not in ("k1", "k3"):
        _fail("kl_estimator must be k1 or k3")
    from training.ppo.advantages import get_advantage_estimator

    try:
        get_advantage_estimator(cfg.advantage_estimator)
    except ValueError as e:
        _fail(str(e))
    return cfg


def _check_groups(cfg: Any, samples: int) -> None:
    """grpo and trloo compare the samples of a task with each other: one per task leaves every advantage at 0."""
    from training.ppo.advantages import uses_critic

    if samples < 2 and not uses_critic(cfg.advantage_estimator):
        _fail(f"advantage_estimator={cfg.advantage_estimator} compares each task's samples with each other: "
              f"--samples must be at least 2 (got {samples})")


def _progress(step: int, metrics: dict[str, Any]) -> None:
    keys = ("reward/mean", "pass_rate", "actor/pg_loss", "critic/value_loss", "value/explained_variance",
            "mismatch/abs_logp_diff")
    print(json.dumps({"step": step, **{k: round(metrics[k], 4) for k in keys if isinstance(metrics.get(k), float)}}),
          file=sys.stderr, flush=True)


def register(app: typer.Typer) -> None:
    @app.command("warmup")
    def warmup(tasks: Annotated[list[str], typer.Option("--tasks", help="task specs (see `cuda-agent rollout`)")],
               model: Model, out: Out, steps: Steps = 100,
               prompts_per_step: Annotated[int, typer.Option(help="tasks per step")] = 8,
               samples: Annotated[int, typer.Option(help="responses per task")] = 4,
               max_new_tokens: Annotated[int, typer.Option(help="tokens per response")] = 4096,
               temperature: Annotated[float, typer.Option(help="sampling temperature (the learner scores "
                                                                "softmax(logits / T))")] = 1.0,
               backend: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if visible)")] = None,
               judge_workers: Annotated[int, typer.Option(help="workspaces judged at once")] = 4,
               judge_gpus: Annotated[str | None, typer.Option(help="GPUs the judge spreads over, e.g. 0,1 "
                                                                  "(default: every visible GPU)")] = None,
               judge_cache: Annotated[bool, typer.Option(help="reuse judgments of identical files")] = False,
               actor_lr: Annotated[float, typer.Option()] = 1e-6,
               critic_lr: Annotated[float, typer.Option()] = 1e-5,
               device: Device = None, save_every: SaveEvery = 10, fresh: Fresh = False, no_tensorboard: NoTB = False,
               sets: Sets = None, ray: Ray = None) -> None:
        """Single-turn PPO: the whole solution in one message, judged by the sandbox."""
        from training.ppo.warmup import WarmupConfig, run_warmup

        ppo_cfg = ppo_config(model, device, sets, actor_lr=actor_lr, critic_lr=critic_lr)
        _check_groups(ppo_cfg, samples)
        cfg = WarmupConfig(ppo=ppo_cfg, tasks=tasks, out=out, steps=steps, prompts_per_step=prompts_per_step,
                           samples=samples, max_new_tokens=max_new_tokens, temperature=temperature, backend=backend,
                           judge_workers=judge_workers, judge_cache=judge_cache, save_every=save_every,
                           judge_gpus=[g.strip() for g in judge_gpus.split(",") if g.strip()] if judge_gpus else None,
                           resume=not fresh, tensorboard=not no_tensorboard, ray=ray)
        try:
            run = run_warmup(cfg, _progress)
        except (*_bad_input(), *_cluster_error()) as e:
            _fail(str(e))
        print(json.dumps({"out": str(run.out), "final": str(run.out / "final")}))

    @app.command("critic")
    def critic(data: Annotated[list[Path], typer.Option("--data", help="run folder(s) or episodes JSONL file(s)")],
               model: Model, out: Out, steps: Steps = 200,
               batch_size: Annotated[int, typer.Option(help="samples per step")] = 16,
               critic_lr: Annotated[float, typer.Option()] = 1e-5,
               lam: Annotated[float, typer.Option(help="GAE lambda of the targets (1: Monte-Carlo returns)")] = 1.0,
               holdout: Annotated[float, typer.Option(help="fraction of episodes held out to measure explained "
                                                           "variance on (OUT/critic_eval.json)")] = 0.0,
               eval_every: Annotated[int, typer.Option(help="held-out evaluation every N steps")] = 25,
               zero_head: Annotated[bool, typer.Option("--zero-head", help="start a fresh value head at zero "
                                                                           "instead of small random weights")] = False,
               device: Device = None, save_every: SaveEvery = 50, fresh: Fresh = False, no_tensorboard: NoTB = False,
               sets: Sets = None) -> None:
        """Value pretraining on collected trajectories with the actor frozen."""
        from training.ppo.advantages import uses_critic
        from training.ppo.critic import CriticConfig, NoData, run_critic

        ppo_cfg = ppo_config(model, device, sets, critic_lr=critic_lr, lam=lam)
        if not uses_critic(ppo_cfg.advantage_estimator):
            _fail(f"advantage_estimator={ppo_cfg.advantage_estimator} uses no critic: there is nothing to pretrain")
        cfg = CriticConfig(ppo=ppo_cfg, data=data, out=out, steps=steps, batch_size=batch_size,
                           save_every=save_every, resume=not fresh, tensorboard=not no_tensorboard, holdout=holdout,
                           eval_every=eval_every, random_head=not zero_head)
        try:
            run = run_critic(cfg)
        except (*_bad_input(), NoData) as e:
            _fail(str(e))
        print(json.dumps({"out": str(run.out), "critic": str(run.out / "final-critic")}))

    @app.command("ppo")
    def ppo(tasks: Annotated[list[str], typer.Option("--tasks", help="task specs (see `cuda-agent rollout`)")],
            model: Model, out: Out, steps: Steps = 150,
            critic_model: Annotated[str | None, typer.Option(help="a pretrained critic (train critic's "
                                                                  "final-critic/)")] = None,
            samples: Annotated[int, typer.Option(help="episodes per task per step")] = 4,
            concurrency: Annotated[int, typer.Option(help="episodes at once")] = 8,
            backend: Annotated[str | None, typer.Option(help="cuda or cpu (default: the tool server's)")] = None,
            mcp_url: Annotated[list[str] | None, typer.Option(help="`cuda-agent serve --transport http` "
                                                                   "endpoint(s); default: spawn stdio")] = None,
            max_turns: Annotated[int, typer.Option(help="model calls per episode")] = 40,
            context_tokens: Annotated[int, typer.Option(help="prompt plus response per call")] = 32768,
            max_response_tokens: Annotated[int, typer.Option(help="tokens per model call")] = 4096,
            temperature: Annotated[float, typer.Option(help="1.0 only: the engine's logprobs are untempered")] = 1.0,
            verify_trials: Annotated[int | None, typer.Option(help="judge's verify trials (default 5)")] = None,
            actor_lr: Annotated[float, typer.Option()] = 1e-6,
            critic_lr: Annotated[float, typer.Option()] = 1e-5,
            device: Device = None, save_every: SaveEvery = 1, fresh: Fresh = False, no_tensorboard: NoTB = False,
            sets: Sets = None, ray: Ray = None, rewards: Rewards = None) -> None:
        """Multi-turn agentic PPO: harness episodes through the engine and the MCP tools, judged."""
        from training.ppo.agentic import AgentPPOConfig, run_ppo

        if temperature != 1.0:
            _fail("train ppo samples at temperature 1.0 only: the engine reports untempered logprobs, so the "
                  "behaviour policy of other temperatures is unknown to the learner (train warmup supports them)")
        ppo_cfg = ppo_config(model, device, sets, actor_lr=actor_lr, critic_lr=critic_lr, critic_model=critic_model)
        _check_groups(ppo_cfg, samples)
        cfg = AgentPPOConfig(ppo=ppo_cfg, tasks=tasks, out=out, steps=steps, samples=samples, concurrency=concurrency,
                             backend=backend, tool_urls=mcp_url or [], ray=ray,
                             max_turns=max_turns, context_tokens=context_tokens,
                             max_response_tokens=max_response_tokens, temperature=temperature,
                             verify_trials=verify_trials, save_every=save_every, resume=not fresh,
                             tensorboard=not no_tensorboard, reward=_rewards(rewards))
        try:
            run = run_ppo(cfg, _progress)
        except (*_bad_input(), *_cluster_error()) as e:
            _fail(str(e))
        print(json.dumps({"out": str(run.out), "final": str(run.out / "final")}))
