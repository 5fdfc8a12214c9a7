"""One line per `bench.judge_throughput` report in a folder (its throughput_*.json files): the rate overall and after
the first wave, wrong verdicts, unscored correct ones, and the medians of where a judgment's time went.

    python -m bench.throughput_summary OUT_DIR

`bench/device.sh` prints it after its throughput parts (`throughput`, `two`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from pathlib import Path


def _steps(rows: list[dict], suffix: str) -> list[float]:
    """Seconds of every build step whose source ends in `suffix` ('link' for the link), over the rows."""
    return [t for r in rows for k, t in (r.get("build_steps") or {}).items() if k.endswith(suffix)]


def geo(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def steady_rate(rows: list[dict], started_at: float, workers: int) -> float | None:
    """Judgments a minute after the first wave (whose processes all start, and open the device, at once)."""
    ends = sorted(r["started_at"] + r["wall_s"] - started_at for r in rows)
    k = min(workers, len(ends) - 2)
    if len(ends) <= 2 or ends[-1] <= ends[k]:
        return None
    return round((len(ends) - 1 - k) / (ends[-1] - ends[k]) * 60, 1)


def line(run: str, d: dict, i: int, p: dict) -> str:
    rows, s = p["rows"], p["summary"]
    correct = [r for r in rows if r.get("kind") == "correct"]
    pp = lambda k: med([(r.get("profile_phases") or {}).get(k) for r in correct])  # noqa: E731
    vp = lambda k: med([(r.get("verify_phases") or {}).get(k) for r in rows])  # noqa: E731
    ex = [r["exclusive_s"] for r in correct if r.get("exclusive_s") is not None]
    waits = sorted(max((r.get("verify_phases") or {}).get("worker_wait", 0.0),
                       (r.get("profile_phases") or {}).get("worker_wait", 0.0)) for r in rows)
    kinds = sorted({r.get("kind") for r in rows})
    return (f"{run} (workers {d['workers']}, rows {d.get('rows')}, {'/'.join(kinds)}, separate {d.get('separate')}) "
            f"pass {i}: {s['per_minute']}/min, correct {s['correct_per_minute']}, failing {s['failing_per_minute']} "
            f"(after the first wave {steady_rate(rows, s['started_at'], d['workers'])}/min) "
            f"({s['judgments']} in {s['wall_s']} s, baselines {s.get('baselines')}), wrong verdicts "
            f"{s['verdicts_wrong']}, failed for another cause {s.get('reasons_unexpected', 'not recorded')}, correct unscored {sum(1 for r in correct if r.get('speedup_vs_eager') is None)} "
            f"(eager spread median {med([(r.get('pairing') or {}).get('eager_spread') for r in correct])}, max "
            f"{max([(r.get('pairing') or {}).get('eager_spread') or 0 for r in correct], default=None)}; rounds left out "
            f"{sum((r.get('pairing') or {}).get('disturbed_rounds') or 0 for r in correct)}; judge clock "
            f"{dict(Counter((r.get('pairing') or {}).get('judge_clock') for r in correct if r.get('pairing')))}); "
            f"medians: wall {med([r['wall_s'] for r in rows])} build {med([r['build_s'] for r in rows])} "
            f"(.cpp {med(_steps(rows, '.cpp'))} .cu {med(_steps(rows, '.cu'))} link {med(_steps(rows, 'link'))}; "
            f"{sum(len(r.get('full_bindings') or []) for r in rows)} .cpp against the full header) verify "
            f"{med([r.get('verify_s') for r in rows])} (queued {vp('queued')} trials {vp('trials')}) profile "
            f"{med([r.get('profile_s') for r in correct])} (queued {med([r.get('profile_queued_s') for r in correct])} "
            f"exclusive {med(ex)}, mean {round(sum(ex) / max(1, len(ex)), 2)}, over 1.5 s {sum(e > 1.5 for e in ex)}; "
            f"timing ahead {pp('timing_ahead')} begin {pp('timing_begin')} batches {pp('timing_batches')} (clock {pp('timing_batches_clock')}) "
            f"end {pp('timing_end')} pauses {pp('timing_pauses')}); candidate device init {vp('candidate_device_init')} "
            f"(runtime {vp('candidate_device_runtime')} context {vp('candidate_device_context')}); "
            f"worker waits max {[round(w, 2) for w in waits[-3:]]}, over 0.5 s: {sum(w > 0.5 for w in waits)} of "
            f"{len(waits)}; candidate context opened in its set-up {sum(1 for r in rows if _opened_in_setup(r))} of "
            f"{len(rows)}; candidate timed in its verify's process "
            f"{sum((r.get('profile_phases') or {}).get('candidate_carried', 0) for r in rows):.0f}; eager_drift median "
            f"{med([(r.get('pairing') or {}).get('eager_drift') for r in rows])}, speedup geomean "
            f"{geo([r.get('speedup_vs_eager') for r in correct])}; host CPU {s.get('host_cpu')}")


def _opened_in_setup(r: dict) -> bool:
    """The candidate's worker came from the pool before its device was opened, so its set-up opened it (under the
    device's shared lock, on the judgment's path): its set-up took at least the device's initialisation."""
    v = r.get("verify_phases") or {}
    init, work = v.get("candidate_device_init"), v.get("candidate_setup_work")
    steps = sum(v.get(f"candidate_{k}", 0.0) for k in ("confine", "task", "canaries", "extension", "model"))
    return init is not None and work is not None and work >= init + steps - 0.01 and init > 0.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a folder of bench.judge_throughput reports (throughput_*.json)")
    for f in sorted(ap.parse_args().folder.glob("throughput_*.json")):
        run, d = f.stem.removeprefix("throughput_"), json.loads(f.read_text())
        for i, p in enumerate(d["passes"]):
            print(line(run, d, i, p))


if __name__ == "__main__":
    main()
