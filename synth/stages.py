"""The four stages as functions over folders, and `build` (all four, one subfolder each)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from synth.manifest import StageOutput, input_rows, read_rows, summarize
from synth.ops import SIZES, START, OpSpec, plan_step, render, steps_to_json


def _seed_id(name: str) -> str:
    return "seed_" + re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")[:80]


def crawl_stage(out: Path, backend: str = "cpu", resume: bool = False, transformers: bool = True) -> dict:
    import random

    from synth.crawl import crawl

    ops, dropped, notes = crawl(include_transformers=transformers)
    with StageOutput(out, "crawl", resume) as so:
        for op in ops:
            tid = _seed_id(op.name)
            if so.done(tid):
                continue
            shape = SIZES[backend][START[op.family]]
            step = plan_step(op, shape, random.Random(tid), backend)
            row = {"id": tid, "origin": "crawl", "ops": [op.name], "libraries": [op.library], "how": op.how,
                   "op_specs": [op.to_json()]}
            if step is None:
                so.write({**row, "status": "dropped", "reason": "no_shape"})
                continue
            src = render([step], shape, f"{op.name} ({op.how})")
            so.write({**row, "status": "kept", "spec": {"input": list(shape), "steps": steps_to_json([step])}}, src)
        for d in dropped:
            tid = _seed_id(d["op"])
            if not so.done(tid):
                so.write({"id": tid, "origin": "crawl", "ops": [d["op"]], "status": "dropped",
                          "reason": d["reason"].split(":", 1)[0], "detail": d["reason"]})
        summary = so.summary()
    summary["notes"] = notes
    summary["libraries"] = sorted({lib for r in read_rows(out) if r.get("status") == "kept" for lib in r["libraries"]})
    return summary


def compose_stage(inp: Path, out: Path, count: int = 100, seed: int = 0, max_ops: int = 5, backend: str = "cpu",
                  resume: bool = False, llm=None) -> dict:
    """llm: None for the programmatic composer, else (ModelConfig, SamplingConfig)."""
    from synth.compose import compose_llm, compose_programmatic

    ops = []
    seen: set[str] = set()
    for r in input_rows(inp):
        for spec in r.get("op_specs") or []:
            if spec["name"] not in seen:
                seen.add(spec["name"])
                ops.append(OpSpec(**spec))
    if not ops:
        from synth.manifest import StageError

        raise StageError(f"{inp} holds no crawled operators (op_specs): run `cuda-agent synth crawl` first")
    if llm is None:  # deterministic in the seed: a resumed run makes the same rows again and skips them
        rows = compose_programmatic(ops, count, seed, max_ops, backend)
    else:  # a model's answers are not: ask only the requests no earlier run made (each row says its request)
        asked = [r.get("request", -1) for r in read_rows(out)] if resume else []
        rows = compose_llm(ops, count, seed, llm[0], llm[1], max_ops, backend, start=max(asked, default=-1) + 1)
    with StageOutput(out, "compose", resume) as so:
        for r in rows:
            if so.done(r["id"]):
                continue
            if r.get("status") == "dropped":
                so.write(r)
            else:
                so.write({**r, "status": "kept"}, r["source"])
        summary = so.summary()
    summary["operators"] = len(ops)
    return summary


def _never() -> bool:
    return False


def _pending(rows: list[dict], so: StageOutput) -> int:
    """Input tasks the stage has not decided yet (left by a time limit, for a resumed run)."""
    return sum(1 for r in rows if not so.done(r["id"]))


def filter_stage(inp: Path, out: Path, cfg, resume: bool = False, progress: bool = True,
                 expired: Callable[[], bool] = _never) -> dict:
    from synth.filter import filter_dir

    rows = input_rows(inp)
    with StageOutput(out, "filter", resume) as so:
        faults = filter_dir(rows, so, cfg, progress, expired)
        summary = so.summary()
        summary["notes"] = summary.get("notes", []) + faults.notes("filter")
        summary["pending"] = _pending(rows, so)
    summary["band_ms"] = list(cfg.band())
    return summary


def selfcheck_stage(inp: Path, out: Path, cfg, resume: bool = False, progress: bool = True,
                    expired: Callable[[], bool] = _never) -> dict:
    """The judge's self-check on each task (synth.gate): only tasks it can judge go on."""
    from synth.gate import run_gate

    rows = input_rows(inp)
    with StageOutput(out, "selfcheck", resume) as so:
        todo = [r for r in rows if not so.done(r["id"])]
        faults = run_gate(todo, inp, cfg.backend, cfg.band(), cfg.jobs,
                          lambda row: so.write(row, row.get("source") if row["status"] == "kept" else None), expired,
                          progress, gpus=[str(g) for g in cfg.gpus] if cfg.gpus is not None else None)
        summary = so.summary()
        summary["notes"] = summary.get("notes", []) + faults.notes("gate")
        summary["pending"] = _pending(rows, so)
    summary["band_ms"] = list(cfg.band())
    return summary


def decontaminate_stage(inp: Path, out: Path, threshold: float | None = None, resume: bool = False,
                        kernelbench: Path | None = None, by: str = "computation",
                        expired: Callable[[], bool] = _never) -> dict:
    """threshold None: the default of `by` (see synth.signature and synth.decontam)."""
    from synth.decontam import DEFAULT_THRESHOLD, Decontaminator
    from synth.signature import DEFAULT_THRESHOLD as COMPUTED_THRESHOLD
    from synth.tracing import BATCH

    with StageOutput(out, "decontaminate", resume) as so:
        rows = input_rows(inp)
        todo = [r for r in rows if not so.done(r["id"])]
        # the reference suite is traced (or its cache read) only when there is something to judge: a resumed
        # build whose decontamination is done does not pay it on a fresh machine
        judge = Decontaminator(kernelbench, threshold, by=by) if todo else None
        for i in range(0, len(todo), BATCH):  # a batch at a time, so an interrupted run keeps what it judged
            if judge is None or (i and expired()):  # past the limit, after one batch at least (progress)
                break
            chunk = todo[i:i + BATCH]
            for r, (near, why) in zip(chunk, judge.judge(chunk), strict=True):
                row = {**r, "nearest": near}
                if why:
                    so.write({**row, "status": "dropped", "reason": "similar_to_kernelbench", "detail": why})
                else:
                    so.write({**row, "status": "kept", "reason": None}, r["source"])
        summary = so.summary()
        summary["pending"] = _pending(rows, so)
    if threshold is None:
        threshold = COMPUTED_THRESHOLD if by == "computation" else DEFAULT_THRESHOLD
    summary["threshold"] = judge.threshold if judge else threshold
    summary["by"] = by
    summary["tasks"] = _report(list(so.rows.values()))
    if judge is not None and judge.ref is not None:
        summary["kernelbench"] = {"problems": len(judge.ref.signatures) + len(judge.ref.errors),
                                  "untraced": sorted(judge.ref.errors), "cached": judge.ref.cached}
    return summary


def _report(rows: list[dict], kept_shown: int = 5) -> list[dict]:
    """Every dropped task and the kept tasks closest to KernelBench, nearest first, for the summary."""
    def brief(r: dict) -> dict:
        near = r.get("nearest") or {}
        return {"id": r["id"], "status": r.get("status"), "problem": near.get("problem"),
                "score": near.get("score"), "by": near.get("by"), "matched": near.get("matched"),
                "text": near.get("text")}

    closest = sorted(rows, key=lambda r: -float((r.get("nearest") or {}).get("score") or 0.0))
    dropped = [brief(r) for r in closest if r.get("status") != "kept"]
    return dropped + [brief(r) for r in closest if r.get("status") == "kept"][:kept_shown]


def export_dataset(folder: Path, backend: str) -> dict:
    """The kept tasks as a Hugging Face dataset: save_to_disk under dataset/, and dataset.parquet."""
    rows = []
    for r in input_rows(folder):
        near = r.get("nearest") or {}
        rows.append({"id": r["id"], "code": r["source"], "ops": list(r.get("ops") or []),
                     "libraries": list(r.get("libraries") or []), "origin": r.get("origin", ""),
                     "backend": backend, "eager_ms": float((r.get("metrics") or {}).get("eager_ms") or 0.0),
                     "nearest_kernelbench": near.get("problem") or "", "similarity": float(near.get("score") or 0.0)})
    try:
        from datasets import Dataset
    except ImportError:
        return {"rows": len(rows), "dataset": None, "parquet": None,
                "note": "datasets is not installed (pip install 'cuda-agent[synth]'): the task folder only"}
    ds = Dataset.from_list(rows) if rows else Dataset.from_dict({k: [] for k in ("id", "code")})
    ds.save_to_disk(str(folder / "dataset"))
    ds.to_parquet(str(folder / "dataset.parquet"))
    return {"rows": len(rows), "dataset": str(folder / "dataset"), "parquet": str(folder / "dataset.parquet")}


def build(out: Path, cfg, count: int = 100, seed: int = 0, max_ops: int = 5, threshold: float | None = None,
          resume: bool = False, transformers: bool = True, llm=None, progress: bool = True,
          time_limit_s: float | None = None, kernelbench: Path | None = None,
          eval_fraction: float | None = None, package_to: Path | None = None) -> dict:
    """All five stages, one subfolder each, then the dataset folder (synth.dataset) in its train and eval
    splits, and with `package_to` the shipped form of it (synth.package). With a time limit, stages stop
    starting tasks once it passes, the build says `complete: false`, and the same command with --resume
    continues, in this folder or a copy of it on another machine: every task decided stays decided
    (manifests are appended as tasks finish), and the parameters are held to the first run's (synth.buildinfo)."""
    from synth.buildinfo import open_build, read_info, record_run
    from synth.dataset import write_dataset
    from synth.report import read_timings, record_time
    from synth.splits import EVAL_FRACTION

    started, t_start = time.time(), time.perf_counter()
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s

    def expired() -> bool:
        return deadline is not None and time.monotonic() > deadline

    params = {"backend": cfg.backend, "count": count, "seed": seed, "max_ops": max_ops, "band_ms": list(cfg.band()),
              "threshold": threshold, "compile": cfg.compile, "transformers": transformers,
              "composer": "programmatic" if llm is None else f"llm:{llm[0].model}",
              "eval_fraction": eval_fraction}
    if eval_fraction is None:  # not given: a resumed build's own, else the default
        was = (read_info(out) or {}).get("params", {}).get("eval_fraction") if resume else None
        params["eval_fraction"] = EVAL_FRACTION if was is None else was
    info = open_build(out, params, resume)
    # a resumed build keeps a finished crawl (the operators its composition drew from) instead of crawling
    # again; finished means its time was recorded, which happens only after the stage returned
    crawled = read_rows(out / "1-crawl") if resume and "crawl" in read_timings(out) else []
    steps = [("crawl", "1-crawl", lambda: summarize("crawl", crawled) if crawled else
              crawl_stage(out / "1-crawl", cfg.backend, resume, transformers)),
             ("compose", "2-compose", lambda: compose_stage(out / "1-crawl", out / "2-compose",
                                                            info["params"]["count"], seed, max_ops,
                                                            cfg.backend, resume, llm)),
             ("filter", "3-filter", lambda: filter_stage(out / "2-compose", out / "3-filter", cfg, resume, progress,
                                                         expired)),
             ("decontaminate", "4-decontaminate",
              lambda: decontaminate_stage(out / "3-filter", out / "4-decontaminate", threshold, resume, kernelbench,
                                          expired=expired)),
             ("selfcheck", "5-selfcheck", lambda: selfcheck_stage(out / "4-decontaminate", out / "5-selfcheck", cfg,
                                                                  resume, progress, expired))]
    stages: list[dict] = []
    decided: dict[str, int] = {}
    complete = True
    for name, folder, run in steps:
        # past the limit, stop between stages, but only once this invocation has decided something: a limit
        # shorter than a stage's start-up (reading the crawl, composing) must still move the build on
        if expired() and any(decided.values()):
            complete = False
            break
        before = len(read_rows(out / folder))
        t0 = time.perf_counter()
        st = run()
        decided[name] = st["seen"] - before
        record_time(out, name, time.perf_counter() - t0, decided[name])
        stages.append(st)
        if st.get("pending"):
            complete = False
            break
        resume = True  # later stages of a build continue what an earlier invocation of it left
    result = {"stages": stages, "complete": complete, "tasks": str(out / "5-selfcheck")}
    if complete:
        exp = write_dataset(out, cfg.backend, cfg.band(), stages[3]["threshold"], info["params"]["eval_fraction"])
        result["export"] = {k: v for k, v in exp.items() if k != "report"}
        result["report"] = exp["report"]
        if package_to is not None:
            from synth.package import package

            result["package"] = package(out, package_to)
    record_run(out, cfg.backend, started, time.perf_counter() - t_start, complete, decided)
    return result


__all__ = ["build", "compose_stage", "crawl_stage", "decontaminate_stage", "export_dataset", "filter_stage",
           "selfcheck_stage", "summarize"]
