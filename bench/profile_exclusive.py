"""How long a profile holds the device to itself, and how long it takes in all (cached baseline).

    python -m bench.profile_exclusive --workspace /tmp/pe-ws [--calls 5] [--pause 1] [--out pe.json]
        [--set min_rounds=5 ...]

Builds the workspace once (the example task with its CPU solution by default; an existing built workspace at
--workspace is reused, so two checkouts of the judge can be compared on the same build, alternating runs),
profiles it once to fill the baseline cache, then --calls profiles one every --pause seconds. Each row: the
profile's duration, the seconds it held the device's lock exclusively (ProfileResult.exclusive_s; for judges
from before that field, the phases spent inside the lock: timing, spot_checks and kernels), the phases, the
rounds the paired timing ran and why it stopped. --set key=value overrides a ProfileConfig field.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def exclusive_s(p) -> float:
    got = getattr(p, "exclusive_s", None)
    if got is not None:
        return got
    return sum(p.phases.get(k, 0.0) for k in ("timing", "spot_checks", "kernels"))  # inside the lock before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="example/swish_bias")
    ap.add_argument("--solution", default=str(HERE.parent / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--workspace", required=True, help="built here once; reused when it exists")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], help="ProfileConfig field=value (JSON value)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from sandbox.api import ProfileConfig, compile_workspace, init_workspace, profile_workspace
    from sandbox.workspace import Workspace

    root = Path(args.workspace)
    if (root / ".cuda_agent").is_dir():
        ws = Workspace(root)
    else:
        ws, _ = init_workspace(args.task, root, args.backend, check=False)
        shutil.copytree(args.solution, ws.root, dirs_exist_ok=True)
    c = compile_workspace(ws)  # a no-op when the build is current
    assert c.ok, c.message
    fields = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = ProfileConfig(**fields)
    first = profile_workspace(ws, cfg)  # fills the baseline cache (or finds it filled)
    print(f"first profile: ok={first.ok} {first.duration_s:.2f} s cached={first.baseline_cached}", flush=True)
    rows = []
    for _ in range(args.calls):
        time.sleep(args.pause)
        p = profile_workspace(ws, cfg)
        paired = p.paired
        row = {"ok": p.ok, "reason": str(p.reason) if p.reason else None, "duration_s": p.duration_s,
               "exclusive_s": exclusive_s(p), "phases": p.phases, "speedup": p.speedup_vs_eager,
               "rounds": len(paired.rounds) if paired else None,
               "stopped": getattr(paired, "stopped", None) if paired else None,
               "attempts": paired.attempts if paired else None,
               "eager_ms": p.eager.median_ms if p.eager else None,
               "candidate_ms": p.candidate.median_ms if p.candidate else None,
               "batch_calls": [b.calls for b in p.candidate.batches] if p.candidate else None,
               "speedup_range": p.speedup_vs_eager_range,
               "round_speedups": [r.speedup for r in paired.rounds] if paired else None}
        rows.append(row)
        print(f"ok={p.ok} reason={row['reason']} total {p.duration_s:.2f} s, exclusive {row['exclusive_s']:.2f} s, "
              f"rounds {row['rounds']} ({row['stopped']}), speedup {p.speedup_vs_eager} {row['speedup_range']}, "
              f"calls a batch {row['batch_calls']}, "
              f"phases {({k: round(v, 2) for k, v in p.phases.items()})}", flush=True)
    ok = [r for r in rows if r["ok"]]
    summary = {"profiles": len(rows), "ok": len(ok), "median_duration_s": median([r["duration_s"] for r in ok]),
               "median_exclusive_s": median([r["exclusive_s"] for r in ok]),
               "median_timing_s": median([r["phases"].get("timing", 0.0) for r in ok]),
               "median_spot_checks_s": median([r["phases"].get("spot_checks", 0.0) for r in ok]),
               "median_rounds": median([r["rounds"] for r in ok if r["rounds"] is not None])}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"config": fields, "summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
