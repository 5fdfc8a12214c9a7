"""bench.judge_share: the wall time a step's judgments and sandbox calls covered, and the outcomes after a
failed first verify, from episode records (no judge, no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _episode(key, start, duration, judge_s, turns, milestone, reason=None):
    return {"key": key, "started_at": start, "duration_s": duration, "turns": turns,
            "judgment": {"duration_s": judge_s, "reward": {"milestone": milestone, "reason": reason}}}


def _turn(started, model_s, tools_s, calls):
    return {"started_s": started, "model_s": model_s, "tools_s": tools_s,
            "tool_calls": [{"name": n, "result_text": t} for n, t in calls]}


def test_shares_and_outcomes(tmp_path):
    from bench.judge_share import run_shares, union

    assert union([(0, 2), (1, 3), (5, 6)]) == 4
    failed, ok = ("verify", "verify FAILED [value_mismatch]"), ("verify", "verify OK (cuda)")
    eps = [
        # first try right: model 0-2, tools 2-4, judge 6-10
        _episode("a#0", 100.0, 10.0, 4.0, [_turn(0, 2, 2, [("write_file", ""), ok]), _turn(4, 1, 0, [])], "correct"),
        # failed, edited, passed: judge 8-12 overlaps the first judgment
        _episode("a#1", 100.0, 12.0, 4.0, [_turn(0, 2, 2, [failed]), _turn(4, 1, 2, [("edit_file", ""), ok])],
                 "correct", "timing_noisy"),
        # failed, answered: gave up
        _episode("a#2", 100.0, 6.0, 1.0, [_turn(0, 2, 1, [failed]), _turn(3, 1, 0, [])], "failed"),
        # verified but the judge failed it
        _episode("a#3", 100.0, 6.0, 1.0, [_turn(0, 2, 1, [ok]), _turn(3, 1, 0, [])], "failed"),
    ]
    run = tmp_path / "run"
    (run / "rollouts" / "step-000001").mkdir(parents=True)
    (run / "rollouts" / "step-000001" / "episodes.jsonl").write_text("\n".join(json.dumps(e) for e in eps))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout_s": 12.0, "learn_s": 0.0,
                                                   "rollout/waited_for_timings_s": 1.5}) + "\n")
    (row,) = run_shares(run)
    assert row["judge_wall_s"] == 7.0  # [5, 12]: 5-6 and 5-6 from the short ones, 6-10 and 8-12
    assert row["judge_share"] == round(7 / 12, 3)
    assert row["outcomes"] == {"first_ok": 2, "repaired": 1, "gave_up": 1}
    assert row["verified_but_judged_failed"] == ["a#3: None"]
    assert row["speed_unscored"] == 1 and row["waited_for_timings_s"] == 1.5
