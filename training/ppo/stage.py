"""What every stage shares: its output folder, checkpoints it resumes from, and metrics.

    OUT/config.json          the stage's settings (a resumed run keeps them)
    OUT/metrics.jsonl        one line per step
    OUT/tb/                  TensorBoard event files (when torch's SummaryWriter can load)
    OUT/checkpoints/step-N/  actor/, critic/ (save_pretrained, with the tokenizer), optimizers.pt, state.json
    OUT/final/               the last actor, plain weights, loadable by the engine and from_pretrained
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"


class StageRun:
    def __init__(self, out: Path, stage: str, config: dict[str, Any], resume: bool = True,
                 tensorboard: bool = True, keep: int = 2):
        self.out = Path(out)
        self.stage = stage
        self.keep = keep
        self.out.mkdir(parents=True, exist_ok=True)
        cfg_path = self.out / "config.json"
        self.resumed_from = self.latest() if resume else None
        if self.resumed_from is None and any((self.out / CHECKPOINTS).glob("step-*")):
            raise FileExistsError(f"{self.out} already holds checkpoints: resume, or choose another --out")
        if self.resumed_from is None:
            cfg_path.write_text(json.dumps({"stage": stage, **config}, indent=2, default=str))
        self._trim_metrics(self.resumed_from[0] if self.resumed_from else 0)
        self.writer = _tensorboard(self.out / "tb") if tensorboard else None

    # ---- checkpoints ------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        done = [p for p in (self.out / CHECKPOINTS).glob("step-*") if (p / "state.json").is_file()]
        if not done:
            return None
        path = max(done, key=lambda p: int(p.name.split("-")[1]))
        return int(path.name.split("-")[1]), path

    def state(self) -> dict[str, Any]:
        return json.loads((self.resumed_from[1] / "state.json").read_text()) if self.resumed_from else {}

    def save(self, step: int, learner: Any, state: dict[str, Any], tokenizer_from: str | None) -> Path:
        path = self.out / CHECKPOINTS / f"step-{step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        learner.save(tmp, tokenizer_from)
        # state.json last: a folder without it is a checkpoint that did not finish
        (tmp / "state.json").write_text(json.dumps({"step": step, "saved_at": time.time(), **state}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        done = sorted((p for p in (self.out / CHECKPOINTS).glob("step-*") if not p.name.endswith(".tmp")),
                      key=lambda p: int(p.name.split("-")[1]))
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def save_final(self, learner: Any, tokenizer_from: str | None) -> Path:
        from training.models import load_tokenizer

        final = self.out / "final"
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir(parents=True)
        model = learner.actor
        if hasattr(model, "merge_and_unload"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(final)
        if tokenizer_from:
            load_tokenizer(tokenizer_from).save_pretrained(final)
        return final

    # ---- metrics ----------------------------------------------------------------------------
    def _trim_metrics(self, upto: int) -> None:
        """A resumed run repeats the steps after its checkpoint; their old lines go."""
        for name in ("metrics.jsonl", "responses.jsonl"):
            path = self.out / name
            if not path.is_file():
                continue
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= upto]
            path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "stage": self.stage, "time": time.time(), **metrics}
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row, default=_jsonable) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _jsonable(x: Any) -> Any:
    return float(x) if hasattr(x, "__float__") else str(x)


def _tensorboard(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional; metrics.jsonl has everything
        return None
    return SummaryWriter(str(path))


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def episode_metrics(rewards: list[float], milestones: list[str], judge_s: list[float],
                    turns: list[int]) -> dict[str, float]:
    """Reward mean and spread, count per milestone, pass rate (any milestone past failed), judge seconds
    per episode and episode length in turns."""
    n = len(rewards)
    if not n:
        return {"episodes": 0}
    mean = sum(rewards) / n
    out: dict[str, float] = {"episodes": n, "reward/mean": mean, "reward/min": min(rewards),
                             "reward/max": max(rewards),
                             "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
                             "pass_rate": sum(m != "failed" for m in milestones) / n}
    for m in ("failed", "correct", "faster_than_eager", "faster_than_compile"):
        out[f"milestone/{m}"] = sum(x == m for x in milestones) / n
    if judge_s:
        out["judge_s_per_episode"] = sum(judge_s) / len(judge_s)
    if turns:
        out["turns/mean"] = sum(turns) / len(turns)
        out["turns/max"] = max(turns)
    return out


def open_learner(cfg: Any, run: StageRun, train_actor: bool = True) -> tuple[Any, Any, int]:
    """(learner, tokenizer, first step): from the run's last checkpoint when there is one, else from
    cfg.model (and cfg.critic_model); optimizer state comes back with the checkpoint."""
    from training.models import load_tokenizer
    from training.ppo.learner import PPOLearner

    tok = load_tokenizer(cfg.model)
    if run.resumed_from is not None:
        step, path = run.resumed_from
        # a checkpoint of a run without a critic (grpo) has no critic/
        critic = str(path / "critic") if (path / "critic").is_dir() else None
        learner = PPOLearner(cfg, actor_path=str(path / "actor"), critic_path=critic, pad_id=tok.pad_token_id,
                             train_actor=train_actor)
        learner.load_optimizers(path)
        return learner, tok, step + 1
    return PPOLearner(cfg, pad_id=tok.pad_token_id, train_actor=train_actor), tok, 1
