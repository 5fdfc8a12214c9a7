"""Where the judging process's own CPU goes in a judgment: cProfile over compile + judge_workspace, one judgment
at a time, of bench/ppo_learns.py's elementwise family (every job's sources its own, as --distinct-sources).

    python bench/judge_side.py --kind wrong --judgments 6            # GPU (cuda when visible)
    python bench/judge_side.py --backend cpu --rows 256 --kind wrong

In bench/judge_throughput.py every judgment's judge-side Python runs in one process, under one interpreter lock,
so its CPU a judgment bounds the rate (at 0.5 CPU-s a judgment, 120 a minute whatever the workers): this prints
that CPU, and the functions that spend it, by their own time and by their cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ppo_learns as pl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    ap.add_argument("--kind", choices=["wrong", "correct"], default="wrong")
    ap.add_argument("--judgments", type=int, default=6, help="profiled, after two that are not")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--out", default="/tmp/judge-side")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    from sandbox.api import compile_workspace, init_workspace, judge_workspace
    from sandbox.backend import resolve_backend
    from sandbox.config import VerifyConfig
    from tasks.loader import load_task

    backend = args.backend or resolve_backend(None)
    out = Path(args.out)
    names = list(pl.OPS)
    paths = pl.write_tasks(out / "tasks", args.rows, names[:2])
    task = load_task(paths[names[0]])
    expr = pl.OPS[names[1] if args.kind == "wrong" else names[0]][1]

    def one(i: int, prof: cProfile.Profile | None) -> tuple[float, float, str]:
        ws, _ = init_workspace(task, out / f"ws{i:03d}-{time.time_ns()}", backend=backend, check=False)
        for path, body in pl.expert_files(expr, backend).items():
            ws.write_text(path, f"// job {i} {time.time_ns()}\n" + body if path.startswith("kernels/") else body)
        c0, w0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        c = compile_workspace(ws)
        v, p = judge_workspace(ws, VerifyConfig(trial_timeout_s=30)) if c.ok else (None, None)
        if prof:
            prof.disable()
        verdict = "compile " + str(c.reason) if not c.ok else ("ok" if v.ok else str(v.reason))
        return time.process_time() - c0, time.perf_counter() - w0, verdict

    for i in range(2):
        print(f"warm-up {i}: cpu %.3f s wall %.2f s %s" % one(i, None), flush=True)
    prof = cProfile.Profile()
    rows = [one(2 + i, prof) for i in range(args.judgments)]
    for cpu, wall, verdict in rows:
        print(f"judgment: judge-side cpu {cpu:.3f} s, wall {wall:.2f} s, {verdict}")
    print(f"judge-side cpu a judgment: {sum(r[0] for r in rows) / len(rows):.3f} s ({backend}, {args.kind})")
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
        text = s.getvalue()
        print(text[text.find("   ncalls"):])
    prof.dump_stats(str(out / "judge_side.prof"))


if __name__ == "__main__":
    main()
