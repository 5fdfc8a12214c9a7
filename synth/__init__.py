"""Task synthesis: seed operators -> fused tasks -> filtered by execution -> decontaminated.

Each stage reads and writes a folder of KernelBench-format task files plus `manifest.jsonl`
(`synth.manifest`), so stages compose, resume, and accept tasks users bring.
This package sits above the sandbox and the harness (it runs tasks in the sandbox's isolated
workers and asks models through the harness's clients), like `training/`; `tasks.loader` below
it knows nothing of it.
"""
