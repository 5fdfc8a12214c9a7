"""The dataset card (README.md) of a synthesized set, in the Hugging Face convention."""

from __future__ import annotations

from synth.report import report_lines
from tasks.synthset import split_file

LICENSE = "apache-2.0"


def _size_category(n: int) -> str:
    for bound, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K")):
        if n < bound:
            return label
    return "100K<n<1M"


def _sample_note(backend: str, n: int) -> str:
    if backend == "cuda":
        return ""
    # a CPU build sizes its tasks for a CPU and times them there: no stand-in for the GPU set
    return (f"\n**A small CPU-built sample ({n} tasks), not the GPU training set.** Its tasks are sized for a CPU "
            "and their eager times were measured on one; it shows the format and the machinery. The training "
            "set is built on the `cuda` backend.\n")


def card(rep: dict, n: int, band_ms: tuple[float, float], threshold: float, backend: str) -> str:
    lo, hi = band_ms
    stats = "\n".join(f"- {line}" for line in report_lines(rep))
    top = "\n".join(f"| `{op}` | {c} |" for lib in ("torch", "transformers")
                    for op, c in list(rep["operators"]["counts"][lib].items())[:15])
    sp = rep.get("splits") or {}
    frac = sp.get("eval_fraction", 0.0)
    return f"""---
license: {LICENSE}
task_categories:
- text-generation
language:
- en
tags:
- code
- cuda
- pytorch
- kernelbench-format
pretty_name: cuda-agent synthesized kernel tasks
size_categories:
- {_size_category(n)}
configs:
- config_name: default
  data_files:
  - split: train
    path: {split_file("train")}
  - split: eval
    path: {split_file("eval")}
---

# cuda-agent synthesized kernel tasks
{_sample_note(backend, n)}
{n} PyTorch reference models in the KernelBench format (`Model`, `get_inputs()`, `get_init_inputs()`),
each a fusion of torch and transformers operators, for training agents that write CUDA kernels. Built
with `cuda-agent synth build` on the `{backend}` backend; `report.json` holds every number below.

## Splits

`train` ({sp.get("train", "?")} tasks) and `eval` ({sp.get("eval", "?")} tasks), held out: a task is in `eval`
when the SHA-256 of `{sp.get("salt", "")}:TASK_ID` falls in the lowest {frac:.0%} of its range. The split
depends on the task's id alone, so it is the same on every machine and stays put as the set grows.
Train on `train`, evaluate on `eval`: `cuda-agent eval --tasks synth:eval ...` (or any command that
takes task specs).

## Columns

`task_id`, `code` (the task's source), `ops` (its operators, e.g. `torch.nn.GELU`), `libraries`,
`fusion_depth` (how many operators it fuses), `origin`, `backend`, `eager_ms` (the judge's eager time),
`nearest_kernelbench` (the closest KernelBench level 1-3 problem by computation), `score` (the
similarity to it) and `split`.

Load with `datasets.load_from_disk(FOLDER)` (a `DatasetDict` of both splits; after `cuda-agent synth
card` where the build machine lacked `datasets`), `datasets.load_dataset("json", data_files=...)` over
the `*.jsonl.gz` files, or by the project's task ids: `cuda-agent tasks synth:FOLDER/eval` lists a
split and `cuda-agent init synth:FOLDER/eval/TASK_ID ws/` opens a task (FOLDER/ left out: the set
shipped with the project).

## How it was made

1. crawl: operators of torch (`torch.nn.functional`, `torch.nn` modules, tensor ops) and transformers
   (activations, RMSNorms, rotary embeddings, gated MLPs, inlined) found by introspection and recipes;
2. compose: 2 to 5 operators fused into one model by shape rules;
3. filter: each task run in an isolated worker, kept if it builds, is finite, deterministic, sensitive
   to every input, compiles under `torch.compile` and runs in the eager band;
4. decontaminate: dropped when it computes what a KernelBench problem computes (below);
5. self-check: kept only if the judge can judge it (below).

## Decontamination

By computation: every task's forward is traced to its ATen ops (argument roles, dtypes, shape
relations) and normalized (module and functional forms, aliases and decompositions, names, constants
and sizes do not count), then compared with every KernelBench level 1-3 problem. A task scoring
{threshold} or more against any problem is dropped; the textual similarity is kept as a second opinion.
Each row records its nearest problem and score.

## Self-check

Every task passed the judge's own self-check before entering the set: its reference verified against
itself through the real judge (builds, runs, gives the same outputs across trials and seeds), and its
eager time measured by the judge's timing protocol within {lo:g}-{hi:g} ms. Failures are counted by
reason under the `selfcheck` stage below.

## Statistics

{stats}

| most used operators | tasks |
|---|---|
{top}

## License

{LICENSE}: the generated code is the project's; the operators it calls belong to PyTorch (BSD-3-Clause)
and the inlined transformers code to Hugging Face transformers (Apache-2.0).
"""
