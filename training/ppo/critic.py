"""`cuda-agent train critic`: value pretraining on collected trajectories with the actor frozen.

The critic regresses the returns of judged episodes (harness run folders, through harness.export's
RL rows) before multi-turn PPO starts, so that the first PPO steps get advantages from a critic that
already knows what a failing or a passing trajectory looks like instead of from a random value head.
By default lambda = 1: the targets are the discounted Monte-Carlo returns, fixed while the actor is
frozen. The trained critic is in OUT/final-critic/ for `train ppo --critic-model`."""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.ppo.config import PPOConfig
from training.ppo.stage import StageRun, open_learner


class NoData(ValueError):
    """The data holds no episode the critic can learn from."""


@dataclass
class CriticConfig:
    ppo: PPOConfig
    data: list[Path]
    out: Path
    steps: int = 200
    batch_size: int = 16  # samples per step
    save_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = True
    tensorboard: bool = True
    holdout: float = 0.0  # fraction of the episodes kept out of training, to measure the critic on (by episode id)
    eval_every: int = 25  # held-out explained variance every N steps (and at the start and the end)
    random_head: bool = True  # a fresh value head starts from small random weights, not zero (models.py says why)


def load_samples(data: list[Path]) -> list[Any]:
    """Every episode of every run given. Not training.records.load_episodes: it keeps one episode per
    (task, sample) key across runs, and the steps of a PPO run reuse those keys."""
    from harness.export import rl_rows
    from harness.trajectory import latest_records
    from training.ppo.samples import from_rl_row

    missing = [str(p) for p in data if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"no such run folder or file: {', '.join(missing)}")
    records = [r for p in data for r in latest_records(Path(p) / "episodes.jsonl" if Path(p).is_dir()
                                                       else Path(p)).values()]
    rows = rl_rows(records)
    if not rows:
        raise NoData("no episode in the data has token ids (roll out with --token-ids through the engine)")
    return [from_rl_row(r) for r in rows]


def split_holdout(samples: list[Any], fraction: float) -> tuple[list[Any], list[Any]]:
    """(train, held out): whole episodes (every segment of one episode on the same side). Episodes are ranked
    by a hash of their id and the first round(fraction * n) are held out, at least one and never all, so
    the split is the same on every run and resume and both sides hold something from two episodes on."""
    if fraction <= 0:
        return samples, []

    def key(s: Any) -> str:
        return hashlib.sha256(str(s.meta.get("episode_id") or id(s)).encode()).hexdigest()

    episodes = sorted({key(s) for s in samples})
    if len(episodes) < 2:
        raise NoData(f"holdout {fraction}: {len(episodes)} episode(s) cannot be split into training and held-out")
    held = set(episodes[: min(len(episodes) - 1, max(1, round(fraction * len(episodes))))])
    return [s for s in samples if key(s) not in held], [s for s in samples if key(s) in held]


def explained_variance_on(learner: Any, samples: list[Any]) -> float:
    """The critic's explained variance of the returns of `samples` (its targets under the learner's settings),
    over their model tokens, without training on them."""
    return learner.batch_stats(learner.prepare(samples))["value/explained_variance"]


def run_critic(cfg: CriticConfig) -> StageRun:
    from training.ppo.advantages import uses_critic
    from training.ppo.models import randomize_fresh_head

    if not uses_critic(cfg.ppo.advantage_estimator):
        raise ValueError(f"advantage_estimator={cfg.ppo.advantage_estimator!r} uses no critic: nothing to pretrain")
    samples, heldout = split_holdout(load_samples(cfg.data), cfg.holdout)
    run = StageRun(cfg.out, "critic", {**asdict(cfg), "ppo": cfg.ppo.to_dict()}, resume=cfg.resume,
                   tensorboard=cfg.tensorboard, keep=cfg.keep_checkpoints)
    learner, _tok, first = open_learner(cfg.ppo, run, train_actor=False)
    if first == 1 and cfg.random_head:
        randomize_fresh_head(learner.critic)
    evals: dict[int, float] = {}
    if heldout and first == 1:
        evals[0] = explained_variance_on(learner, heldout)
    rng = random.Random(cfg.ppo.seed)
    order: list[int] = []
    size = min(cfg.batch_size, len(samples))  # at most the whole data per step
    try:
        for step in range(first, cfg.steps + 1):
            # the same batches in the same order after a resume: the sequence depends only on the seed
            while len(order) < step * size:
                block = list(range(len(samples)))
                rng.shuffle(block)
                order += block
            batch = [samples[i] for i in order[(step - 1) * size: step * size]]
            t0 = time.perf_counter()
            items = learner.prepare(batch)
            stats = learner.batch_stats(items)
            metrics = learner.fit_values(items, step=step)
            row = {"value/explained_variance": stats["value/explained_variance"], "value/mean": stats["value/mean"],
                   "return/mean": stats["return/mean"], **metrics, "step_s": time.perf_counter() - t0,
                   "samples": len(batch)}
            if heldout and (step % cfg.eval_every == 0 or step == cfg.steps):
                evals[step] = row["value/explained_variance_heldout"] = explained_variance_on(learner, heldout)
            run.log(step, row)
            if step % cfg.save_every == 0 or step == cfg.steps:
                run.save(step, learner, {}, cfg.ppo.model)
        final = cfg.out / "final-critic"
        learner.critic.save_pretrained(final)
        if heldout:
            last = max(evals) if evals else None
            (cfg.out / "critic_eval.json").write_text(json.dumps({
                "train_samples": len(samples), "heldout_samples": len(heldout),
                "heldout_episodes": len({s.meta.get("episode_id") for s in heldout}),
                "explained_variance_heldout": evals.get(last) if last is not None else None,
                "explained_variance_heldout_by_step": evals}, indent=2))
    finally:
        run.close()
    return run
