"""Task synthesis throughput: all five stages on COUNT composed candidates, timed per stage.

    python -m bench.synth_throughput --backend cuda --count 300 --jobs 8 --out /tmp/synth-bench

Prints seconds per stage (and per task each stage saw), tasks per minute through the filter and end to
end, and the share of its input each stage keeps (with the drop reasons); writes the same as JSON to
OUT/bench.json.
The dataset export runs only where the `datasets` package is installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from synth.filter import FilterConfig  # noqa: E402
from synth.stages import (  # noqa: E402
    compose_stage,
    crawl_stage,
    decontaminate_stage,
    export_dataset,
    filter_stage,
    selfcheck_stage,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--gpus", default=None, help="e.g. 0,1 (default: all visible)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ops", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="synth-bench")
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    cfg = FilterConfig(backend=args.backend, jobs=args.jobs, compile=not args.no_compile,
                       gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None)
    stages, times = [], {}
    steps = [("crawl", lambda: crawl_stage(out / "1-crawl", args.backend)),
             ("compose", lambda: compose_stage(out / "1-crawl", out / "2-compose", args.count, args.seed,
                                               args.max_ops, args.backend)),
             ("filter", lambda: filter_stage(out / "2-compose", out / "3-filter", cfg)),
             ("decontaminate", lambda: decontaminate_stage(out / "3-filter", out / "4-decontaminate")),
             ("selfcheck", lambda: selfcheck_stage(out / "4-decontaminate", out / "5-selfcheck", cfg))]
    t_all = time.perf_counter()
    for name, fn in steps:
        t0 = time.perf_counter()
        stages.append(fn())
        times[name] = time.perf_counter() - t0
    total = time.perf_counter() - t_all
    export = export_dataset(out / "5-selfcheck", args.backend)
    candidates = stages[1]["kept"]
    report = {"backend": args.backend, "jobs": args.jobs, "candidates": candidates, "seconds": times,
              "total_s": total, "filter_tasks_per_min": 60 * candidates / max(times["filter"], 1e-9),
              "end_to_end_tasks_per_min": 60 * candidates / max(total, 1e-9),
              "seconds_per_task": {st["stage"]: times[st["stage"]] / st["seen"] for st in stages if st["seen"]},
              "final_kept": stages[4]["kept"], "stages": stages, "export": export}
    print(f"{'stage':<14}{'in':>6}{'kept':>6}{'share':>8}{'seconds':>10}{'s/task':>8}  drop reasons")
    for st in stages:
        share = st["kept"] / st["seen"] if st["seen"] else 0.0
        reasons = ", ".join(f"{k} {v}" for k, v in st["reasons"].items())
        per = times[st["stage"]] / st["seen"] if st["seen"] else 0.0
        print(f"{st['stage']:<14}{st['seen']:>6}{st['kept']:>6}{share:>8.0%}{times[st['stage']]:>10.1f}{per:>8.2f}"
              f"  {reasons}")
    print(f"filter: {report['filter_tasks_per_min']:.1f} tasks/min; end to end: "
          f"{report['end_to_end_tasks_per_min']:.1f} tasks/min; {stages[4]['kept']} of {candidates} candidates kept")
    (out / "bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
