"""`cuda-agent train ...` and `cuda-agent engine ...`: typer apps mounted by cuda_agent.cli.

Nothing heavy is imported at module import time (torch, transformers, trl load inside commands).
Exit status: 0 done, 1 failed, 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from training.ppo.cli import register as register_ppo

train_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                        help="Make tiny models; rejection fine-tuning (RFT); PPO (warmup, critic, ppo).")
engine_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                         help="The rollout engine: an OpenAI-compatible server with token ids, logprobs, "
                              "policy versions and weight sync.")
register_ppo(train_app)  # train warmup | critic | ppo (training/ppo/cli.py)


def _fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


@train_app.command("tiny-model")
def tiny_model(out: Annotated[Path, typer.Argument(help="folder to write the model and tokenizer to")],
               layers: Annotated[int, typer.Option(help="decoder layers")] = 2,
               hidden: Annotated[int, typer.Option(help="hidden size")] = 64,
               vocab: Annotated[int, typer.Option(help="BPE vocabulary size (incl. 256 bytes, specials)")] = 2048,
               heads: Annotated[int, typer.Option(help="attention heads")] = 4,
               kv_heads: Annotated[int, typer.Option(help="key/value heads")] = 2,
               intermediate: Annotated[int | None, typer.Option(help="MLP size (default 3 x hidden)")] = None,
               seed: Annotated[int, typer.Option()] = 0) -> None:
    """A random-weight Qwen3 model with a BPE tokenizer trained on the project's own text (as pinned in
    training/tokenizer_corpus.py)."""
    if hidden % heads or heads % kv_heads:
        _fail("hidden must be a multiple of heads, and heads a multiple of kv-heads")
    from training.models import ModelSpec, count_parameters, load_model, make_tiny_model

    path = make_tiny_model(out, layers=layers, hidden=hidden, vocab=vocab, heads=heads, kv_heads=kv_heads,
                           intermediate=intermediate, seed=seed)
    model, tok = load_model(ModelSpec(str(path), device="cpu"))
    print(json.dumps({"path": str(path), "parameters": count_parameters(model), "vocab": len(tok)}))


@train_app.command("rft")
def rft(data: Annotated[list[Path], typer.Option("--data", help="run folder(s) or episodes JSONL file(s)")],
        model: Annotated[str, typer.Option("--model", help="model id or folder to fine-tune")],
        out: Annotated[Path, typer.Option("--out", help="output folder")],
        min_milestone: Annotated[str, typer.Option(help="failed, correct, faster_than_eager, "
                                                        "faster_than_compile")] = "faster_than_eager",
        min_reward: Annotated[float | None, typer.Option(help="also require this reward")] = None,
        keep_invalid_tool_calls: Annotated[bool, typer.Option(help="do not drop episodes with invalid calls")] = False,
        max_identical_calls: Annotated[int, typer.Option(help="identical consecutive calls allowed (0: no "
                                                              "limit)")] = 2,
        max_failed_compiles: Annotated[int, typer.Option(help="failing compiles without a file change allowed "
                                                              "(0: no limit)")] = 2,
        keep_truncated: Annotated[bool, typer.Option(help="do not drop truncated episodes")] = False,
        no_dedupe: Annotated[bool, typer.Option(help="keep duplicate conversations")] = False,
        max_per_task: Annotated[int, typer.Option(help="episodes per task (0: no cap)")] = 4,
        select_only: Annotated[bool, typer.Option(help="select and write the rows, do not train")] = False,
        eval_fraction: Annotated[float, typer.Option()] = 0.1,
        epochs: Annotated[float, typer.Option()] = 3.0,
        max_steps: Annotated[int, typer.Option(help="> 0 overrides --epochs")] = -1,
        learning_rate: Annotated[float, typer.Option()] = 1e-5,
        batch_size: Annotated[int, typer.Option()] = 1,
        grad_accum: Annotated[int, typer.Option()] = 8,
        max_length: Annotated[int, typer.Option(help="tokens per conversation (longer ones are cut)")] = 32768,
        warmup: Annotated[float, typer.Option(help="< 1: fraction of the steps; >= 1: steps")] = 0.03,
        weight_decay: Annotated[float, typer.Option()] = 0.0,
        lr_scheduler: Annotated[str, typer.Option()] = "cosine",
        dtype: Annotated[str, typer.Option(help="auto, bf16, fp16, fp32")] = "auto",
        gradient_checkpointing: Annotated[bool, typer.Option("--gradient-checkpointing/--no-gradient-checkpointing"
                                                             )] = True,
        lora_r: Annotated[int, typer.Option(help="LoRA rank (0: full fine-tuning)")] = 0,
        lora_alpha: Annotated[int, typer.Option()] = 32,
        save_steps: Annotated[int, typer.Option()] = 200,
        save_total_limit: Annotated[int, typer.Option()] = 3,
        logging_steps: Annotated[int, typer.Option()] = 10,
        eval_steps: Annotated[int | None, typer.Option(help="default: once per epoch")] = None,
        seed: Annotated[int, typer.Option()] = 0,
        resume: Annotated[bool, typer.Option(help="continue from the last checkpoint in --out")] = False,
        report_to: Annotated[str, typer.Option(help="comma-separated trainer loggers, or none")] = "tensorboard",
        ) -> None:
    """Rejection fine-tuning: select judged episodes, filter them, and fine-tune on the rest."""
    from training.rft import RFTConfig, prepare, train
    from training.rft_select import MILESTONES, SelectConfig

    if min_milestone not in MILESTONES:
        _fail(f"--min-milestone must be one of {', '.join(MILESTONES)}")
    sel = SelectConfig(min_milestone=min_milestone, min_reward=min_reward,
                       drop_invalid_tool_calls=not keep_invalid_tool_calls,
                       max_identical_consecutive_calls=max_identical_calls,
                       max_failed_compiles_without_change=max_failed_compiles, drop_truncated=not keep_truncated,
                       dedupe=not no_dedupe, max_per_task=max_per_task or None)
    cfg = RFTConfig(data=data, model=model, out=out, select=sel, eval_fraction=eval_fraction, epochs=epochs,
                    max_steps=max_steps, learning_rate=learning_rate, batch_size=batch_size, grad_accum=grad_accum,
                    max_length=max_length, warmup=warmup, weight_decay=weight_decay,
                    lr_scheduler=lr_scheduler, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                    lora_r=lora_r, lora_alpha=lora_alpha, save_steps=save_steps, save_total_limit=save_total_limit,
                    logging_steps=logging_steps, eval_steps=eval_steps, seed=seed, resume=resume,
                    report_to=[] if report_to == "none" else [r for r in report_to.split(",") if r])
    try:
        train_rows, eval_rows, summary = prepare(cfg)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    print(json.dumps({k: summary[k] for k in ("total", "kept", "dropped", "train", "eval")}))
    if select_only:
        return
    if not train_rows:
        _fail("no episodes left to train on after selection (see selection.json)", 1)
    final = train(cfg, train_rows, eval_rows)
    print(json.dumps({"model": str(final)}))


@engine_app.command("serve")
def serve(model: Annotated[str, typer.Option("--model", help="model id or folder")],
          backend: Annotated[str, typer.Option(help="transformers or vllm")] = "transformers",
          host: Annotated[str, typer.Option()] = "127.0.0.1",
          port: Annotated[int, typer.Option()] = 8000,
          name: Annotated[str | None, typer.Option(help="model name to answer to (default: folder name)")] = None,
          dtype: Annotated[str, typer.Option(help="auto, bf16, fp16, fp32")] = "auto",
          device: Annotated[str | None, typer.Option(help="transformers: cpu, cuda, cuda:1 (default: cuda if "
                                                          "visible)")] = None,
          max_context: Annotated[int | None, typer.Option(help="tokens (default: the model's)")] = None,
          max_tokens: Annotated[int, typer.Option(help="default max_tokens per response")] = 1024,
          gpu_memory_utilization: Annotated[float, typer.Option(help="vllm")] = 0.85,
          enable_sleep_mode: Annotated[bool, typer.Option(help="vllm: allow sleep/wake (colocated learner)")] = False,
          attention_backend: Annotated[str | None, typer.Option(help="vllm: e.g. TRITON_ATTN (default: "
                                                                     "vLLM's choice)")] = None,
          enforce_eager: Annotated[bool, typer.Option(help="vllm: no CUDA graphs (faster start)")] = False,
          ) -> None:
    """Serve /v1/chat/completions with tool calls, token ids, logprobs and a policy version."""
    from training.engine.server import serve as run_server

    if backend == "transformers":
        from training.engine.hf import TransformersBackend

        be = TransformersBackend(model, device=device, dtype=dtype, name=name, max_context=max_context)
    elif backend == "vllm":
        try:
            from training.engine.vllm_backend import VLLMBackend
            be = VLLMBackend(model, dtype=dtype, name=name, max_context=max_context,
                             gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                             attention_backend=attention_backend, enforce_eager=enforce_eager)
        except ImportError as e:
            _fail(f"the vllm backend needs `pip install -e '.[vllm]'` ({e})")
    else:
        _fail("--backend must be transformers or vllm")
    print(f"serving {be.model_name} (version {be.version}) on http://{host}:{port}/v1", file=sys.stderr)
    run_server(be, host, port, max_tokens)
