"""`cuda-agent train ppo`: multi-turn agentic PPO. Each step runs a batch of harness episodes (the
real agent loop over the MCP tools, judged by the harness's judge) against the engine, which serves
the current actor on loopback inside this process; turns them into token-level samples through
harness.export.rl_rows (tool results masked, the engine's logprobs as the behaviour policy); updates
actor and critic; and loads the new weights into the engine, whose policy_version is the step."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.ppo.config import PPOConfig
from training.ppo.stage import StageRun, episode_metrics, open_learner
from training.ppo.turns import turn_metrics


@dataclass
class AgentPPOConfig:
    ppo: PPOConfig
    tasks: list[str]
    out: Path
    steps: int = 150
    samples: int = 4  # episodes per task per step
    concurrency: int = 8
    backend: str | None = None  # workspace backend: cuda, cpu (None: the tool server's)
    tool_urls: list[str] = field(default_factory=list)  # running `cuda-agent serve --transport http`; empty: spawn
    ray: str | None = None  # judge actors on this Ray cluster instead (local, auto, HOST:PORT; harness.cluster)
    max_turns: int = 40
    system_prompt: str | None = None  # None: the harness's (SKILL.md); small models get a sentence
    hidden_tools: list[str] | None = None  # tools the model is not shown (None: the harness's default)
    context_tokens: int = 32768
    max_response_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    verify_trials: int | None = None
    judge_timeout_s: float = 3600.0
    # the judge's milestone rewards (sandbox.config.RewardConfig fields), None: the paper's scale. A family whose
    # correct solutions are one text (bench/proofs/repair.py) sets the speed milestones to `correct`'s reward, so
    # the timing noise between identical kernels stays out of the advantages; a caught cheat is `failed` always
    reward: dict[str, float] | None = None
    save_every: int = 1
    keep_checkpoints: int = 2
    resume: bool = True
    tensorboard: bool = True
    # stop (with a checkpoint and final/) after the step that passes it, or before a next step as long as the
    # last one would pass it: one device call or job slot holds a whole number of steps
    time_limit_s: float | None = None


def reward_config(reward: dict[str, float] | None) -> Any:
    """The RewardConfig of `reward`, refusing a key it does not have (a typo would silently keep the default)."""
    from sandbox.config import RewardConfig

    unknown = sorted(set(reward or {}) - set(RewardConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown reward setting(s) {unknown}; the settings are {sorted(RewardConfig.model_fields)}")
    return RewardConfig(**(reward or {}))


def rollout_config(cfg: AgentPPOConfig, url: str, out: Path, model_name: str) -> Any:
    from harness.config import (
        AgentConfig,
        JudgeConfig,
        ModelConfig,
        RolloutConfig,
        SamplingConfig,
        ToolServerConfig,
    )

    return RolloutConfig(
        tasks=cfg.tasks, samples=cfg.samples, concurrency=cfg.concurrency, out=out, resume=True, progress=False,
        model=ModelConfig(model=model_name, base_url=[url], api_key="none", return_token_ids=True, max_retries=0),
        sampling=SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_response_tokens,
                                logprobs=True),
        agent=AgentConfig(backend=cfg.backend, max_turns=cfg.max_turns, context_budget_tokens=cfg.context_tokens,
                          system_prompt=cfg.system_prompt,
                          **({"hidden_tools": cfg.hidden_tools} if cfg.hidden_tools is not None else {})),
        tools=ToolServerConfig(urls=cfg.tool_urls, ray=cfg.ray),
        judge=JudgeConfig(verify_trials=cfg.verify_trials, timeout_s=cfg.judge_timeout_s,
                          reward=reward_config(cfg.reward)))


def collect(cfg: AgentPPOConfig, backend: Any, out: Path) -> tuple[list[Any], float, dict[str, float]]:
    """Runs (or, after a crash, finishes) one step's episodes; returns the records, the seconds and what the
    tool servers cost (episodes run again elsewhere, servers lost)."""
    import anyio

    from harness.rollout import records_of, run_rollout
    from training.engine.server import serve_in_thread

    t0 = time.perf_counter()
    with serve_in_thread(backend, default_max_tokens=cfg.max_response_tokens) as url:
        summary = anyio.run(run_rollout, rollout_config(cfg, url, out, backend.model_name))
    servers = {"rollout/episodes_retried": float(summary.retried), "rollout/servers_lost": float(len(summary.servers_lost))}
    return list(records_of(out).values()), time.perf_counter() - t0, servers


def trainable(records: list[Any]) -> list[Any]:
    """Episodes the policy is answerable for: one that ended in the harness's or a server's error (a host went
    away with no other left, the engine failed) says nothing of the policy, and a reward of -1 for it would
    teach the policy to avoid whatever it happened to be doing."""
    from harness.trajectory import ERROR_ENDS

    return [r for r in records if r.ended not in ERROR_ENDS]


def record_metrics(records: list[Any]) -> dict[str, float]:
    rewards = [r.reward if r.reward is not None else -1.0 for r in records]
    milestones = [r.judgment.reward.milestone if r.judgment else "failed" for r in records]
    judge_s = [r.judgment.duration_s for r in records if r.judgment and r.judgment.duration_s is not None]
    out = episode_metrics(rewards, milestones, judge_s, [len(r.turns) for r in records])
    for r in records:
        out[f"ended/{r.ended}"] = out.get(f"ended/{r.ended}", 0) + 1
    out["episodes/untrainable"] = float(len(records) - len(trainable(records)))
    out.update(turn_metrics(records))
    return out


def run_ppo(cfg: AgentPPOConfig, on_step: Any = None) -> StageRun:
    """Runs steps until cfg.steps, resuming from the output folder's last checkpoint."""
    from harness.export import rl_rows
    from training.engine.hf import TransformersBackend
    from training.ppo.samples import from_rl_row

    if cfg.temperature != 1.0 or cfg.ppo.temperature != 1.0:
        # the engine reports logprobs of the untempered distribution, so episodes sampled at another
        # temperature have no behaviour logprobs to correct against (train warmup supports it)
        raise ValueError(f"train ppo samples at temperature 1.0 only (the engine's logprobs are untempered); "
                         f"got {cfg.temperature} (PPOConfig.temperature {cfg.ppo.temperature})")
    reward_config(cfg.reward)  # a bad setting fails here, not after the first step's rollouts
    run = StageRun(cfg.out, "ppo", {**asdict(cfg), "ppo": cfg.ppo.to_dict()}, resume=cfg.resume,
                   tensorboard=cfg.tensorboard, keep=cfg.keep_checkpoints)
    learner, tok, first = open_learner(cfg.ppo, run)
    backend = TransformersBackend(cfg.ppo.model, device=str(learner.device), dtype=cfg.ppo.dtype,
                                  max_context=cfg.context_tokens)
    backend.version = first - 1
    if first > 1:  # the engine serves the checkpoint's weights, under the version they had
        backend.update_state_dict(learner.engine_state_dict(), version=first - 1)
    started = time.perf_counter()
    try:
        for step in range(first, cfg.steps + 1):
            step_started = time.perf_counter() - started
            waited = backend.turns.waited_s if backend.turns else 0.0
            records, rollout_s, servers = collect(cfg, backend, cfg.out / "rollouts" / f"step-{step:06d}")
            rows = rl_rows(trainable(records))
            metrics: dict[str, Any] = {**record_metrics(records), **servers, "rollout_s": rollout_s,
                                       "policy_version": backend.version, "samples": len(rows)}
            completion = sum(sum(r["response_mask"]) for r in rows)
            metrics["rollout/tokens_per_s"] = completion / rollout_s if rollout_s > 0 else 0.0
            stale = [v for r in rows for v in r["policy_versions"] if v is not None and v != backend.version]
            metrics["rollout/stale_turns"] = len(stale)
            # the engine's forward passes waiting for the judge's timings on its device (engine/device_turns.py)
            metrics["rollout/waited_for_timings_s"] = (backend.turns.waited_s if backend.turns else 0.0) - waited
            if rows:
                t0 = time.perf_counter()
                items = learner.prepare([from_rl_row(r) for r in rows])
                metrics.update(learner.batch_stats(items))
                metrics.update(learner.train_step(items, step))
                learn_s = time.perf_counter() - t0
                metrics["learn_s"] = learn_s
                metrics["learner/tokens_per_s"] = sum(len(r["prompt_ids"]) + len(r["response_ids"])
                                                      for r in rows) / learn_s
                backend.update_state_dict(learner.engine_state_dict(), version=step)
            metrics["policy_version_after"] = backend.version
            run.log(step, metrics)
            elapsed = time.perf_counter() - started
            over = cfg.time_limit_s is not None and elapsed + (elapsed - step_started) > cfg.time_limit_s
            if step % cfg.save_every == 0 or step == cfg.steps or over:
                run.save(step, learner, {"policy_version": backend.version}, cfg.ppo.model)
            if on_step is not None:
                on_step(step, metrics)
            if over:
                break
        run.save_final(learner, cfg.ppo.model)
    finally:
        run.close()
    return run
