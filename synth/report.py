"""A build's report: throughput per stage, drops per filter and reason, and the set's statistics.

Built from what the build folder holds (each stage's manifest, plus `timings.json`, the seconds and
decided tasks of each stage summed over every invocation of a resumed build), so it can be made again
at any time, on any machine, without rerunning anything.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

from synth.manifest import read_rows, summarize

STAGES = ["1-crawl", "2-compose", "3-filter", "4-decontaminate", "5-selfcheck"]
TIMINGS = "timings.json"
QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
EAGER_BINS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
SCORE_BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def read_timings(build: Path) -> dict:
    path = build / TIMINGS
    return json.loads(path.read_text()) if path.is_file() else {}


def record_time(build: Path, stage: str, seconds: float, decided: int) -> None:
    """Add one invocation's seconds and newly decided tasks to the stage's running total."""
    path = build / TIMINGS
    data = read_timings(build)
    st = data.setdefault(stage, {"seconds": 0.0, "decided": 0, "runs": 0})
    st["seconds"] = round(st["seconds"] + seconds, 3)
    st["decided"] += decided
    st["runs"] += 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {f"p{round(q * 100)}": round(v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))], 4) for q in QUANTILES}


def histogram(values: list[float], edges: tuple[float, ...]) -> dict[str, int]:
    """Counts per [edge_i, edge_i+1) bin, with one bin below the first and one at or above the last edge."""
    out: dict[str, int] = {}
    labels = [f"<{edges[0]:g}"] + [f"{a:g}-{b:g}" for a, b in pairwise(edges)] + [f">={edges[-1]:g}"]
    for label in labels:
        out[label] = 0
    for x in values:
        i = sum(1 for e in edges if x >= e)
        out[labels[i]] += 1
    return {k: n for k, n in out.items() if n or k not in (labels[0], labels[-1])}


def library_of(op: str) -> str:
    return "transformers" if op.startswith("transformers.") else "torch"


def set_rows(build: Path) -> list[dict]:
    """The tasks of the set: the last stage's kept rows."""
    return [r for r in read_rows(build / STAGES[-1]) if r.get("status") == "kept"]


def eager_of(row: dict) -> float:
    m = row.get("metrics") or {}
    return float(m.get("judge_eager_ms") or m.get("eager_ms") or 0.0)


def make_report(build: Path, band_ms: tuple[float, float] | None = None) -> dict:
    timings = read_timings(build)
    stages = []
    for folder in STAGES:
        rows = read_rows(build / folder)
        if not rows and not (build / folder).is_dir():
            continue
        name = folder.split("-", 1)[1]
        st = summarize(name, rows)
        t = timings.get(name)
        if t:
            st.update(seconds=t["seconds"], decided=t["decided"], runs=t["runs"],
                      tasks_per_min=round(60 * t["decided"] / t["seconds"], 2) if t["seconds"] > 0 else None)
        stages.append(st)
    rows = set_rows(build)
    eager = [eager_of(r) for r in rows]
    depth = Counter(len(r.get("ops") or []) for r in rows)
    ops = Counter(op for r in rows for op in (r.get("ops") or []))
    scores = [float((r.get("nearest") or {}).get("score") or 0.0) for r in rows]
    nearest = Counter((r.get("nearest") or {}).get("problem") or "none" for r in rows)
    coverage: dict[str, dict[str, int]] = {"torch": {}, "transformers": {}}
    for op, n in ops.most_common():
        coverage[library_of(op)][op] = n
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tasks": len(rows),
        "stages": stages,
        "eager_ms": {"quantiles": quantiles(eager), "histogram": histogram(eager, EAGER_BINS_MS),
                     "band": list(band_ms) if band_ms else None,
                     "all_in_band": bool(band_ms) and all(band_ms[0] <= x <= band_ms[1] for x in eager)},
        "operators": {"distinct": len(ops), "by_library": {lib: {"distinct": len(c), "uses": sum(c.values())}
                                                           for lib, c in coverage.items()},
                      "counts": coverage},
        "fusion_depth": {str(k): depth[k] for k in sorted(depth)},
        "nearest_kernelbench": {"quantiles": quantiles(scores), "histogram": histogram(scores, SCORE_BINS),
                                "most_common": dict(nearest.most_common(10))},
    }
    return report


def report_lines(rep: dict) -> list[str]:
    """The report as short text lines, for the terminal and the card."""
    lines = [f"tasks in the set: {rep['tasks']}"]
    if rep.get("splits"):
        sp = rep["splits"]
        lines.append(f"splits: train {sp['train']}, eval {sp['eval']} (held out by id hash, fraction "
                     f"{sp['eval_fraction']:g})")
    for st in rep["stages"]:
        reasons = ", ".join(f"{k} {v}" for k, v in st["reasons"].items()) or "none"
        rate = f", {st['tasks_per_min']} tasks/min over {st['seconds']:.0f} s" if st.get("tasks_per_min") else ""
        lines.append(f"{st['stage']}: {st['seen']} seen, {st['kept']} kept, {st['dropped']} dropped ({reasons}){rate}")
    e = rep["eager_ms"]
    lines.append(f"eager ms quantiles: {e['quantiles']}; all in band {e['band']}: {e['all_in_band']}")
    lines.append(f"fusion depth: {rep['fusion_depth']}")
    o = rep["operators"]
    lines.append(f"operators: {o['distinct']} distinct; " + ", ".join(
        f"{lib} {v['distinct']} ({v['uses']} uses)" for lib, v in o["by_library"].items()))
    lines.append(f"nearest KernelBench score quantiles: {rep['nearest_kernelbench']['quantiles']}")
    return lines
