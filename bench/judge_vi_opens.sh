#!/usr/bin/env bash
# Issue 33 (items 3 and 6) on the device: this tree's judge against the judge before it (BEFORE_TAR, a `git archive`
# of an earlier commit), on one machine. Written for the pool that opens CUDA only under the shared lock (0cc4119
# before it); run again for the kept task processes (94e366b before them), whose counts the summary shows.
# One fresh pass fills the baselines and the build infrastructure; then the correct stream of
# bench/judge_throughput.py (--distinct-sources, cached baselines, COPIES x 8 judgments) once per item of RUNS,
# each a new process on the same cache, alternating; a summary of all side by side; then GPU_TESTS.
#   git archive -o old_judge.tar 0cc4119;  carry .whl old_judge.tar;  OUT=$OUT DEADLINE=500 bash bench/judge_vi_opens.sh
# RUNS: "name:tree:workers:expect[:keep[:separate[:VAR=VAL,...]]]" items; tree "before" (BEFORE_TAR) or "after" (this tree); expect 0
# = --no-expect; keep 0 = CUDA_AGENT_KEEP_TASK_PROCESSES=0 (no task process kept); separate 1 = --separate (verify and
# profile each with a candidate process of its own: this tree's judge as before one judgment shared one); the last
# field sets environment variables for that run (CUDA_AGENT_OPEN_BATCH=4, say).
set -u
OUT=${OUT:-/tmp/judge-vi-opens}
mkdir -p "$OUT"
py=${PYTHON:-python3}
site=/tmp/site
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | tail -n 3
fi
here=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
left() { echo $(( ${DEADLINE:-500} - ($(date +%s) - start) )); }
BEFORE_TAR=${BEFORE_TAR:-old_judge.tar}
if [ -f "$BEFORE_TAR" ]; then
  rm -rf /tmp/old-judge && mkdir -p /tmp/old-judge && tar -xf "$BEFORE_TAR" -C /tmp/old-judge
fi
if [ ! -f "$OUT/fresh/throughput.json" ]; then
  echo "== fresh pass (baselines, build infrastructure), this tree"
  PYTHONPATH=$site:$here timeout "${FRESH_S:-200}" $py bench/judge_throughput.py --only correct --passes 1 --copies 2 \
    --distinct-sources --workers 8 --out "$OUT/fresh" 2>&1 | grep -v "^USDT" | tail -n 2
  cp "$OUT/fresh/throughput.json" "$OUT/throughput_fresh.json" 2>/dev/null
fi
for item in ${RUNS:-before1:before:8:0 after1:after:8:1 before2:before:8:0 after2:after:8:1}; do
  IFS=: read -r name tree workers expect keep separate vars <<< "$item"
  envs=(); [ -n "${vars:-}" ] && IFS=, read -r -a envs <<< "$vars"
  budget=$(( $(left) - ${RESERVE_S:-100} ))
  if [ "$budget" -lt 45 ]; then echo "== $name: skipped, ${budget}s left"; continue; fi
  [ "$budget" -gt "${RUN_S:-110}" ] && budget=${RUN_S:-110}
  dir=$here; extra=()
  if [ "$tree" = before ]; then dir=/tmp/old-judge; else
    [ "$expect" = 0 ] && extra+=(--no-expect)
    [ "${separate:-0}" = 1 ] && extra+=(--separate)
  fi
  echo "== $name: $tree, workers $workers, expect $expect, ${vars:-} (limit ${budget}s)"
  (cd "$dir" && env "${envs[@]}" CUDA_AGENT_KEEP_TASK_PROCESSES=${keep:-} PYTHONPATH=$site:$dir timeout "$budget" $py bench/judge_throughput.py --only correct --passes 1 \
    --copies "${COPIES:-3}" --distinct-sources --workers "$workers" --cache "$OUT/fresh/cache" "${extra[@]}" \
    --out "$OUT/$name" 2>&1 | grep -v "^USDT" | grep -E "^\{" | tail -n 2)
  cp "$OUT/$name/throughput.json" "$OUT/throughput_$name.json" 2>/dev/null
done
export PYTHONPATH=$site:$here
$py - "$OUT" <<'PY'
import json, math, statistics, sys
from pathlib import Path

def geo(xs):
    xs = [x for x in xs if x]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None

def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None

for f in sorted(Path(sys.argv[1]).glob("throughput_*.json")):
    run, d = f.stem.removeprefix("throughput_"), json.loads(f.read_text())
    for i, p in enumerate(d["passes"]):
        rows, s = p["rows"], p["summary"]
        pp = lambda k: med([r["profile_phases"].get(k) for r in rows])
        vp = lambda k: med([r["verify_phases"].get(k) for r in rows])
        ex = [r["exclusive_s"] for r in rows if r["exclusive_s"] is not None]
        waits = sorted(max(r["verify_phases"].get("worker_wait", 0.0), r["profile_phases"].get("worker_wait", 0.0))
                       for r in rows)
        ends = sorted(r["started_at"] + r["wall_s"] - s["started_at"] for r in rows)
        k = min(d["workers"], len(ends) - 2)  # after the first wave (its processes' contexts all opened at once)
        steady = round((len(ends) - 1 - k) / (ends[-1] - ends[k]) * 60, 1) if len(ends) > 2 and ends[-1] > ends[k] else None
        print(f"{run} (workers {d['workers']}, expect {d.get('expect')}, separate {d.get('separate')}) pass {i}: {s['per_minute']}/min "
              f"(after the first wave {steady}/min) "
              f"({s['judgments']} in {s['wall_s']} s), wrong {s['verdicts_wrong']}, unscored "
              f"{sum(1 for r in rows if r['speedup_vs_eager'] is None)}; medians: wall {med([r['wall_s'] for r in rows])} "
              f"build {med([r['build_s'] for r in rows])} verify {med([r['verify_s'] for r in rows])} (queued "
              f"{vp('queued')} trials {vp('trials')}) profile {med([r['profile_s'] for r in rows])} (setup_queued "
              f"{pp('setup_queued')} queued {med([r['profile_queued_s'] for r in rows])} exclusive {med(ex)}, mean "
              f"{round(sum(ex) / max(1, len(ex)), 2)}, over 1.5 s {sum(e > 1.5 for e in ex)}; timing_batches "
              f"{pp('timing_batches')}); worker waits max {[round(w, 2) for w in waits[-3:]]}, over 0.5 s: "
              f"{sum(w > 0.5 for w in waits)} of {len(waits)}; task process kept: verify "
              f"{sum(r['verify_phases'].get('reference_kept', 0) for r in rows):.0f}, profile "
              f"{sum(r['profile_phases'].get('eager_kept', 0) for r in rows):.0f} of {len(rows)}; candidate timed in its "
              f"verify's process {sum(r['profile_phases'].get('candidate_carried', 0) for r in rows):.0f}; setup medians: "
              f"verify {vp('setup')} reference {vp('reference_setup_work')} candidate {vp('candidate_setup_work')}, "
              f"profile {pp('setup')}; eager_drift median {med([(r['pairing'] or {}).get('eager_drift') for r in rows])}, "
              f"speedup geomean {geo([r['speedup_vs_eager'] for r in rows])}")
PY
if [ "${GPU_TESTS:-}" != none ]; then
  echo "== gpu tests"
  timeout "$(( $(left) > 60 ? $(left) : 60 ))" $py -m pytest -m gpu tests/test_gpu.py tests/test_template.py \
    tests/exploits/test_gpu_forgery.py -q -p no:cacheprovider -k "${GPU_TESTS:-gated_pool or ready_cuda_worker or \
forked_worker_initialises or example_solution or honest_kernel or cached_baseline}" --tb=short 2>&1 | grep -v "^USDT" | tail -n 40
fi
echo "== done in $(( $(date +%s) - start )) s"
