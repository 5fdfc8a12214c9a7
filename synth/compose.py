"""Compose operators into fused tasks: by shape rules (no model), or by asking an LLM.

The programmatic composer draws chains of 2..max_ops operators whose shape families accept the
running shape; a chain's parameters come from one `random.Random(seed, index)`, so a seed gives the
same tasks on any machine. The LLM composer shows a model a few operators and asks for one coherent
fused Model; its answer is parsed and checked statically here, then executed on the meta device in
an isolated worker (`sandbox.correctness.taskcheck`), never in this process.
"""

from __future__ import annotations

import hashlib
import random
import re

from synth.ops import SIZES, START, OpSpec, Step, plan_step, render, steps_to_json


def _pick(ops: list[OpSpec], rng: random.Random) -> OpSpec:
    # family first, then an operator of it: a hundred introspected activations must not crowd out the rest
    families = sorted({o.family for o in ops})
    fam = rng.choice(families)
    return rng.choice([o for o in ops if o.family == fam])


def _chain(ops: list[OpSpec], rng: random.Random, max_ops: int, backend: str) -> tuple[tuple, list[Step]] | None:
    first = _pick(ops, rng)
    shape = SIZES[backend][START[first.family]]
    steps: list[Step] = []
    st = plan_step(first, shape, rng, backend)
    if st is None:
        return None
    steps.append(st)
    want = rng.randint(2, max(2, max_ops))
    for _ in range(8 * want):
        if len(steps) >= want:
            break
        op = _pick(ops, rng)
        if op.name == steps[-1].op.name:
            continue
        nxt = plan_step(op, steps[-1].out, rng, backend)
        if nxt is not None and all(d > 0 for d in nxt.out):
            steps.append(nxt)
    return (shape, steps) if len(steps) >= 2 else None


def task_id(prefix: str, text: str) -> str:
    return f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def compose_programmatic(ops: list[OpSpec], count: int, seed: int, max_ops: int = 5,
                         backend: str = "cpu") -> list[dict]:
    """Up to `count` distinct fused tasks, as manifest rows with their source."""
    if not ops:
        return []
    out: list[dict] = []
    seen: set[str] = set()
    attempt = 0
    while len(out) < count and attempt < 50 * count:
        rng = random.Random(f"{seed}:{attempt}")
        attempt += 1
        got = _chain(ops, rng, max_ops, backend)
        if got is None:
            continue
        shape, steps = got
        names = [s.op.name for s in steps]
        title = "Fused: " + " -> ".join(n.rsplit(".", 1)[-1] for n in names)
        source = render(steps, shape, title)
        tid = task_id("fused", source)
        if tid in seen:
            continue
        seen.add(tid)
        out.append({"id": tid, "origin": "compose:programmatic", "ops": names,
                    "libraries": sorted({s.op.library for s in steps}),
                    "spec": {"input": list(shape), "steps": steps_to_json(steps)}, "source": source})
    return out


# ----------------------------------------------------------------------------------------------
# LLM composer

PROMPT = """You write PyTorch benchmark tasks in the KernelBench format.

Fuse these operators, applied in this order, into ONE coherent PyTorch model:
{ops}

Requirements:
- Define `class Model(nn.Module)` with `__init__` and `forward`, `get_inputs()` returning a list of input
  tensors, and `get_init_inputs()` returning the list of arguments for `Model(...)`.
- Shapes must be consistent: each operator's output must be a valid input to the next; choose sizes so that
  every operator is used meaningfully and every input of forward affects the output.
- Deterministic: no dropout, no sampling, no random numbers in forward.
- Use only torch (import torch, torch.nn as nn, torch.nn.functional as F, math); no other packages, no I/O.
- Aim for an eager run time of roughly {band} on {device}.

Answer with one Python code block and nothing else."""

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
_ALLOWED_IMPORTS = {"torch", "math", "typing", "types", "functools", "itertools", "collections"}


class ComposeError(ValueError):
    pass


def extract_task(text: str) -> str:
    """The task code from a model's answer, checked statically: the format, and imports of torch only."""
    import ast

    from tasks import TaskError, check_source

    blocks = _BLOCK.findall(text or "")
    code = max(blocks, key=len) if blocks else (text or "")
    try:
        check_source(code, "the model's answer")
    except TaskError as e:
        raise ComposeError(str(e)) from None
    for node in ast.walk(ast.parse(code)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        bad = [m for m in mods if m.split(".")[0] not in _ALLOWED_IMPORTS]
        if bad:
            raise ComposeError(f"the model's answer imports {', '.join(bad)}: only torch and the standard math "
                               "helpers are allowed")
    return code.strip() + "\n"


async def _ask(policy, prompt: str, max_tokens: int | None) -> str:
    from harness.policy import EpisodeContext
    from tasks import Task

    ctx = EpisodeContext(task=Task(id="synth-compose", source=""), sample=0, backend="cpu", workspace_id=None)
    try:
        turn = await policy.complete(ctx, [{"role": "user", "content": prompt}], [], max_tokens)
    finally:
        await policy.end_episode(ctx)
    return turn.message.get("content") or ""


def compose_llm(ops: list[OpSpec], count: int, seed: int, model_cfg, sampling_cfg, max_ops: int = 5,
                backend: str = "cpu", band: str = "1-100 ms", concurrency: int = 8, start: int = 0) -> list[dict]:
    """Ask the model for fused tasks, requests `start` to `count` - 1 (a resumed run asks only the ones no earlier
    run made); a row per request, its number in `request`, dropped rows saying why not."""
    import anyio

    if model_cfg.provider == "anthropic":
        from harness.anthropic_client import AnthropicPolicy as PolicyCls
    else:
        from harness.openai_client import OpenAIChatPolicy as PolicyCls
    from sandbox.correctness.taskcheck import check_task
    from tasks import Task, TaskError

    requests = []
    for i in range(start, count):
        rng = random.Random(f"{seed}:llm:{i}")
        chosen = [rng.choice(ops) for _ in range(rng.randint(2, max(2, max_ops)))]
        listing = "\n".join(f"{k + 1}. {o.name}" + (f" (as `{o.module}`)" if o.module and "{" not in o.module else "")
                            for k, o in enumerate(chosen))
        requests.append((chosen, PROMPT.format(ops=listing, band=band, device="a GPU" if backend == "cuda" else "a CPU")))
    answers: list[str | Exception] = [""] * len(requests)

    async def main() -> None:
        policy = PolicyCls(model_cfg, sampling_cfg)
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(i: int) -> None:
            async with limiter:
                try:
                    answers[i] = await _ask(policy, requests[i][1], sampling_cfg.max_tokens)
                except Exception as e:  # one failed request costs one task, not the run
                    answers[i] = e

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
        finally:
            await policy.aclose()

    anyio.run(main)
    rows = []
    for k, ((chosen, _), answer) in enumerate(zip(requests, answers, strict=True)):
        names = [o.name for o in chosen]
        base = {"origin": "compose:llm", "ops": names, "libraries": sorted({o.library for o in chosen}),
                "request": start + k}
        if isinstance(answer, Exception):
            rows.append({**base, "id": task_id("llm", repr(names) + repr(answer)), "status": "dropped",
                         "reason": "model_error", "detail": str(answer)[:500]})
            continue
        try:
            source = extract_task(answer)
            tid = task_id("llm", source)
            check_task(Task(id=tid, source=source))  # executes it on the meta device, in a worker
        except (ComposeError, TaskError) as e:
            rows.append({**base, "id": task_id("llm", answer), "status": "dropped", "reason": "invalid_task",
                         "detail": str(e)[:500]})
            continue
        rows.append({**base, "id": tid, "source": source})
    return rows
