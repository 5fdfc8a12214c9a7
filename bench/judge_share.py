"""How much of each PPO step the judge took, from a `train ppo` run folder (issue 36, item 5).

Each step's episodes run concurrently, so the judge's seconds summed over episodes say little about the
step's wall time; this reads the episode records of OUT/rollouts/step-N/episodes.jsonl and measures, per
step, the wall time covered by at least one final judgment (the harness's judge: compile, verify, profile of
the final workspace; it ends the episode, so its interval is [end - judgment.duration_s, end]), by at least
one in-episode sandbox tool call (the agent's own compile/verify/write/edit: [turn start + model_s, + tools_s]),
by either, by at least one model call (the engine generating a turn), and by sandbox work while no model call
was in flight (what a faster judge would take off the step), beside the step's rollout_s and learn_s from OUT/metrics.jsonl.

Beside it, per step, what happened after a failed first verify (`outcomes`): how many episodes' first turn failed
verify, how many of those the judge then found correct (repaired), how many stopped without another write or edit
(gave up) and how many edited and still failed; episodes whose last verify passed but the judge failed; final
judgments left at `correct` because the timing was too noisy to score (`speed_unscored`); and how long the engine's
passes waited for the judge's timings (`waited_for_timings_s`, training/engine/device_turns.py).

    python -m bench.judge_share RUN_DIR [RUN_DIR ...]      # prints one JSON line per step, then a mean per run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of intervals."""
    total, xs, ys, i, j = 0.0, merged(xs), merged(ys), 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def outcome(r: dict) -> str | None:
    """'first_ok', 'repaired', 'gave_up', 'edit_failed' (after a failed first verify), or None (no verify)."""
    passed = (r.get("judgment") or {}).get("reward", {}).get("milestone", "failed") != "failed"
    first = None
    for i, t in enumerate(r.get("turns", [])):
        for c in t.get("tool_calls", []):
            if c["name"] == "verify" and first is None:
                first = (i, c.get("result_text", "").startswith("verify OK"))
    if first is None:
        return None
    if first[1]:
        return "first_ok"
    if passed:
        return "repaired"
    later = [c["name"] for t in r["turns"][first[0] + 1:] for c in t.get("tool_calls", [])]
    return "edit_failed" if any(n in ("edit_file", "write_file") for n in later) else "gave_up"


def verified_but_failed(r: dict) -> bool:
    verdicts = [c.get("result_text", "") for t in r.get("turns", []) for c in t.get("tool_calls", [])
                if c["name"] == "verify"]
    milestone = (r.get("judgment") or {}).get("reward", {}).get("milestone", "failed")
    return bool(verdicts) and verdicts[-1].startswith("verify OK") and milestone == "failed"


def step_share(episodes: Path, metrics: dict) -> dict:
    judge, tools, model = [], [], []
    outcomes: dict[str, int] = {}
    odd = []
    unscored = 0
    for line in episodes.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        # correct, but the machine too noisy to score a speedup: the speed reward the policy did not see
        unscored += (r.get("judgment") or {}).get("reward", {}).get("reason") == "timing_noisy"
        o = outcome(r)
        outcomes[str(o)] = outcomes.get(str(o), 0) + 1
        if verified_but_failed(r):
            odd.append(f"{r['key']}: {(r['judgment'] or {}).get('reward', {}).get('reason')}")
        end = r["started_at"] + r["duration_s"]
        j = (r.get("judgment") or {}).get("duration_s") or 0.0
        if j > 0:
            judge.append((end - j, end))
        for t in r.get("turns", []):
            m = r["started_at"] + t["started_s"]
            model.append((m, m + t["model_s"]))
            if t.get("tools_s"):
                a = m + t["model_s"]
                tools.append((a, a + t["tools_s"]))
    rollout_s, learn_s = metrics.get("rollout_s", 0.0), metrics.get("learn_s", 0.0)
    step_s = rollout_s + learn_s
    j, t, s = union(judge), union(tools), union(judge + tools)
    return {"step": metrics["step"], "episodes": len(judge), "rollout_s": round(rollout_s, 1),
            "learn_s": round(learn_s, 1), "judge_wall_s": round(j, 1), "tools_wall_s": round(t, 1),
            "sandbox_wall_s": round(s, 1),
            "model_wall_s": round(union(model), 1),
            "sandbox_only_wall_s": round(s - overlap(judge + tools, model), 1), "judge_s_summed": round(sum(b - a for a, b in judge), 1),
            "judge_share": round(j / step_s, 3) if step_s else None,
            "sandbox_share": round(s / step_s, 3) if step_s else None,
            "sandbox_only_share": round((s - overlap(judge + tools, model)) / step_s, 3) if step_s else None,
            "outcomes": outcomes, "verified_but_judged_failed": odd, "speed_unscored": unscored,
            "waited_for_timings_s": metrics.get("rollout/waited_for_timings_s")}


def run_shares(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for m in rows:
        ep = run / "rollouts" / f"step-{m['step']:06d}" / "episodes.jsonl"
        if ep.is_file():
            out.append(step_share(ep, m))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="`train ppo` output folders (their rollouts/step-N/episodes.jsonl)")
    for arg in ap.parse_args().runs:
        rows = run_shares(Path(arg))
        for r in rows:
            print(json.dumps({"run": arg, **r}))
        if rows:
            mean = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in ("judge_share", "sandbox_share",
                                                                              "sandbox_only_share")}
            print(json.dumps({"run": arg, "steps": len(rows), "mean": mean}))


if __name__ == "__main__":
    main()
