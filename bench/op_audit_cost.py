"""What the op audit below Python (sandbox/worker/op_audit.py) adds to verify's round trip.

    python -m bench.op_audit_cost --out op_audit_cost.json [--task example/swish_bias] [--repeats 5]

One workspace with the bundled solution for the backend, compiled once, then verify with the audit on
and off in alternating order (on, off, off, on, ...), so drift and warm caches fall on both sides alike.
Prints the medians of the whole verify, its set-up and its trials; the difference is the layer's cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    from sandbox.api import compile_workspace, init_workspace, verify_workspace
    from sandbox.backend import resolve_backend
    from sandbox.config import VerifyConfig
    from tasks.loader import EXAMPLES_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="example/swish_bias")
    ap.add_argument("--solution", default=None, help="a folder with kernels/ and model_new.py "
                    "(default: the bundled swish_bias solution for the backend)")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="op_audit_cost.json")
    args = ap.parse_args()
    backend = resolve_backend(args.backend)
    solution = Path(args.solution or EXAMPLES_DIR / "solutions" / "swish_bias" / backend)
    ws, _ = init_workspace(args.task, Path(tempfile.mkdtemp(prefix="op-audit-")) / "ws", backend)
    shutil.copytree(solution, ws.root, dirs_exist_ok=True)
    c = compile_workspace(ws)
    assert c.ok, c.log_tail
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for audit in ((True, False) if i % 2 == 0 else (False, True)):
            v = verify_workspace(ws, VerifyConfig(audit_ops=audit))
            assert v.ok, (v.reason, v.message)
            rows["on" if audit else "off"].append({"total_s": v.duration_s, "setup_s": v.phases.get("setup", 0.0),
                                                   "trials_s": v.phases.get("trials", 0.0)})
    summary = {k: {f: statistics.median(r[f] for r in rs) for f in ("total_s", "setup_s", "trials_s")}
               for k, rs in rows.items()}
    summary["cost_s"] = {f: summary["on"][f] - summary["off"][f] for f in ("total_s", "setup_s", "trials_s")}
    out = {"task": args.task, "backend": backend, "repeats": args.repeats, "rows": rows, "median": summary}
    Path(args.out).write_text(json.dumps(out, indent=2))
    for k in ("on", "off", "cost_s"):
        print(f"{k:7s} " + "  ".join(f"{f} {v:.3f}" for f, v in summary[k].items()))


if __name__ == "__main__":
    main()
