"""Rejection fine-tuning, part two: supervised fine-tuning on the selected episodes with trl's SFTTrainer.

The loss covers only the model's own tokens (assistant_only_loss through the chat template's
{% generation %} blocks), over whole multi-turn tool conversations. Out folder:
    selection.json   how many episodes each rule dropped, and what was kept
    train.jsonl, eval.jsonl   the chat rows trained and evaluated on (harness.export's SFT rows)
    metrics.jsonl    every logged step (loss, eval_loss, learning rate, ...); TensorBoard logs in runs/
    checkpoint-N/    trainer checkpoints (--resume continues from the last)
    final/           the fine-tuned model and tokenizer, loadable by from_pretrained and the engine
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.export import sft_rows
from training.models import ModelSpec, load_model, pick_device
from training.records import load_episodes
from training.rft_select import SelectConfig, select


@dataclass
class RFTConfig:
    data: list[Path]
    model: str
    out: Path
    select: SelectConfig = field(default_factory=SelectConfig)
    eval_fraction: float = 0.1
    epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides epochs
    learning_rate: float = 1e-5
    batch_size: int = 1
    grad_accum: int = 8
    max_length: int | None = 32768
    warmup: float = 0.03  # < 1: a fraction of the steps; >= 1: steps
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"
    dtype: str = "auto"
    gradient_checkpointing: bool = True
    lora_r: int = 0
    lora_alpha: int = 32
    save_steps: int = 200
    save_total_limit: int | None = 3
    logging_steps: int = 10
    eval_steps: int | None = None  # None: evaluate once per epoch
    seed: int = 0
    resume: bool = False
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])


def chat_dataset(rows: list[dict[str, Any]]) -> Any:
    """Only what the trainer reads. Messages are Json values, so arguments keep their own keys (Arrow
    structs would give every call every key seen); tools travel as JSON text, which trl decodes."""
    import datasets

    features = datasets.Features({"messages": datasets.List(datasets.Json()), "tools": datasets.Value("string")})
    return datasets.Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows],
                                      features=features)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def prepare(cfg: RFTConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Selects episodes and splits their chat rows; writes selection.json, train.jsonl and eval.jsonl."""
    sel = select(load_episodes(cfg.data), cfg.select)
    rows = sft_rows(sel.kept)
    rng = random.Random(cfg.seed)
    rng.shuffle(rows)
    n_eval = int(len(rows) * cfg.eval_fraction) if len(rows) > 1 else 0
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary = {**sel.summary(), "train": len(train_rows), "eval": len(eval_rows),
               "select": asdict(cfg.select)}
    (cfg.out / "selection.json").write_text(json.dumps(summary, indent=2))
    _write_jsonl(cfg.out / "train.jsonl", train_rows)
    _write_jsonl(cfg.out / "eval.jsonl", eval_rows)
    return train_rows, eval_rows, summary


def _metrics_callback(path: Path) -> Any:
    from transformers import TrainerCallback

    class MetricsJsonl(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and state.is_world_process_zero:
                with open(path, "a") as fh:
                    fh.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")

    return MetricsJsonl()


def train(cfg: RFTConfig, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]]) -> Path:
    """Runs SFT and returns the final model's folder."""
    from trl import SFTConfig, SFTTrainer

    if not train_rows:
        raise ValueError("no episodes left to train on after selection (see selection.json)")
    device = pick_device(None)
    model, tok = load_model(ModelSpec(cfg.model, dtype=cfg.dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                                      lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha))
    model.train()
    bf16 = device.startswith("cuda") and str(next(model.parameters()).dtype) == "torch.bfloat16"
    args = SFTConfig(
        output_dir=str(cfg.out), assistant_only_loss=True, max_length=cfg.max_length, packing=False,
        num_train_epochs=cfg.epochs, max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay,
        lr_scheduler_type=cfg.lr_scheduler, logging_steps=cfg.logging_steps, save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit, eval_strategy=("steps" if cfg.eval_steps else "epoch")
        if eval_rows else "no", eval_steps=cfg.eval_steps, seed=cfg.seed, report_to=cfg.report_to,
        bf16=bf16, gradient_checkpointing=cfg.gradient_checkpointing,
        use_cpu=device == "cpu", dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=chat_dataset(train_rows),
                         eval_dataset=chat_dataset(eval_rows) if eval_rows else None,
                         callbacks=[_metrics_callback(cfg.out / "metrics.jsonl")])
    resume = cfg.resume and any(cfg.out.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    final = cfg.out / "final"
    if cfg.lora_r > 0:
        trainer.model = trainer.model.merge_and_unload()  # the engine serves plain weights
    trainer.model.save_pretrained(final)
    tok.save_pretrained(final)
    return final


def run_rft(cfg: RFTConfig) -> tuple[Path, dict[str, Any]]:
    train_rows, eval_rows, summary = prepare(cfg)
    return train(cfg, train_rows, eval_rows), summary
