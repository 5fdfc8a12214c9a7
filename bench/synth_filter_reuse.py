"""The filter with a fresh probe process per task against one worker serving several (`--per-worker`), side by side.

    python -m bench.synth_filter_reuse --backend cuda --count 96 --jobs 16 --per-worker 1,8 --repeats 2 --out /tmp/sfr
    python -m bench.synth_filter_reuse --backend cpu --count 16 --jobs 2 --out /tmp/sfr        # a CPU run

Crawls and composes COUNT candidates once, then filters the same candidates with each --per-worker value in turn
(alternating, --repeats rounds), so the settings share the machine's state. Each run: tasks a minute, the median
probe and torch.compile seconds, the kept share, and whether every verdict (status and reason) matches the
first setting's (time_band verdicts near the band's edges may differ with the machine's noise: counted apart).
JSON to OUT/reuse.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from synth.filter import FilterConfig, run_filter  # noqa: E402
from synth.manifest import input_rows  # noqa: E402
from synth.stages import compose_stage, crawl_stage  # noqa: E402


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r["metrics"][key] for r in rows if r.get("metrics", {}).get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--count", type=int, default=96)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--gpus", default=None, help="e.g. 0,1 (default: all visible)")
    ap.add_argument("--per-worker", default="1,8", help="settings compared, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("synth-filter-reuse"))
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    crawl_stage(args.out / "1-crawl", args.backend)
    compose_stage(args.out / "1-crawl", args.out / "2-compose", args.count, args.seed, 5, args.backend)
    rows = input_rows(args.out / "2-compose")[:args.count]
    settings = [int(v) for v in args.per_worker.split(",")]
    runs: list[dict] = []
    first: dict = {}
    for rep in range(args.repeats):
        for pw in settings:
            cfg = FilterConfig(backend=args.backend, jobs=args.jobs, per_worker=pw,
                               gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None)
            got: list[dict] = []
            t0 = time.perf_counter()
            run_filter(rows, cfg, got.append, progress=False)
            wall = time.perf_counter() - t0
            verdicts = {r["id"]: (r["status"], r.get("reason")) for r in got}
            if not first:
                first = verdicts
            differ = {k: [list(first[k]) if k in first else None, list(v)] for k, v in verdicts.items()
                      if first.get(k) != v}
            run = {"repeat": rep, "per_worker": pw, "tasks": len(got), "wall_s": round(wall, 1),
                   "tasks_per_min": round(60 * len(got) / wall, 1), "kept": sum(r["status"] == "kept" for r in got),
                   "probe_s_median": _median(got, "probe_s"), "compile_s_median": _median(got, "compile_s"),
                   "retried_fresh": sum(1 for r in got if r.get("metrics", {}).get("retried_fresh")),
                   "verdicts_differ": len(differ),
                   "differ_time_band_only": all("time_band" in (a or []) + b for a, b in differ.values()),
                   "differ": dict(list(differ.items())[:10])}
            runs.append(run)
            print(json.dumps(run), flush=True)
    by = {pw: [r for r in runs if r["per_worker"] == pw] for pw in settings}
    summary = {"backend": args.backend, "jobs": args.jobs, "count": len(rows), "runs": runs,
               "tasks_per_min": {pw: statistics.median(r["tasks_per_min"] for r in rs) for pw, rs in by.items()}}
    (args.out / "reuse.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"tasks_per_min": summary["tasks_per_min"]}))


if __name__ == "__main__":
    main()
