#!/usr/bin/env bash
# Issue 33 (items 3 and 6) on the device: how many readers the device lock admits at once, and a pool sized
# before the first judgment. One fresh pass fills the baselines and the build infrastructure; then the correct
# stream of bench/judge_throughput.py (--distinct-sources, cached baselines) once per setting in RUNS, each a
# new process on the same cache, each printing its rate; a summary of all side by side.
#   carry .whl;  OUT=$OUT DEADLINE=480 bash bench/judge_vi_readers.sh
# RUNS: "name:readers:workers:expect" items (expect 0 = --no-expect, the pool as before this round).
set -u
OUT=${OUT:-/tmp/judge-vi-readers}
mkdir -p "$OUT"
py=${PYTHON:-python3}
site=/tmp/site
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | tail -n 3
fi
export PYTHONPATH=$site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
start=$(date +%s)
left() { echo $(( ${DEADLINE:-480} - ($(date +%s) - start) )); }
COPIES=${COPIES:-3}
if [ ! -f "$OUT/fresh/throughput.json" ]; then
  echo "== fresh pass (baselines, build infrastructure), 2 readers, expect"
  timeout "${FRESH_S:-200}" $py bench/judge_throughput.py --only correct --passes 1 --copies 2 --distinct-sources \
    --workers 8 --out "$OUT/fresh" 2>&1 | grep -v "^USDT" | tail -n 3
  cp "$OUT/fresh/throughput.json" "$OUT/throughput_fresh.json" 2>/dev/null
fi
for item in ${RUNS:-old:0:8:0 r2:2:8:1 r3:3:8:1 r1:1:8:1 r2w12:2:12:1}; do
  IFS=: read -r name readers workers expect <<< "$item"
  budget=$(( $(left) - 5 ))
  if [ "$budget" -lt 40 ]; then echo "== $name: skipped, ${budget}s left"; continue; fi
  [ "$budget" -gt "${RUN_S:-110}" ] && budget=${RUN_S:-110}
  extra=(); [ "$expect" = 0 ] && extra=(--no-expect)
  echo "== $name: readers $readers, workers $workers, expect $expect (limit ${budget}s)"
  CUDA_AGENT_DEVICE_READERS=$readers timeout "$budget" $py bench/judge_throughput.py --only correct --passes 1 \
    --copies "$COPIES" --distinct-sources --workers "$workers" --cache "$OUT/fresh/cache" "${extra[@]}" \
    --out "$OUT/$name" 2>&1 | grep -v "^USDT" | grep -E "^\{|\[(8|16|24|32)/" | tail -n 5
  cp "$OUT/$name/throughput.json" "$OUT/throughput_$name.json" 2>/dev/null
done
$py - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None

for f in sorted(Path(sys.argv[1]).glob("throughput_*.json")):
    run, d = f.stem.removeprefix("throughput_"), json.loads(f.read_text())
    for i, p in enumerate(d["passes"]):
        rows, s = p["rows"], p["summary"]
        pp = lambda k: med([r["profile_phases"].get(k) for r in rows])
        vp = lambda k: med([r["verify_phases"].get(k) for r in rows])
        waits = sorted(r.get("worker_wait_max_s", 0.0) for r in rows)
        print(f"{run} (readers {d.get('device_readers')}, workers {d['workers']}, expect {d.get('expect')}) pass {i}: "
              f"{s['per_minute']}/min ({s['judgments']} in {s['wall_s']} s), wrong {s['verdicts_wrong']}, unscored "
              f"{sum(1 for r in rows if r['speedup_vs_eager'] is None)}; medians: wall {med([r['wall_s'] for r in rows])} "
              f"build {med([r['build_s'] for r in rows])} verify {med([r['verify_s'] for r in rows])} "
              f"(queued {vp('queued')} trials {vp('trials')} comparisons {vp('comparisons')}) profile "
              f"{med([r['profile_s'] for r in rows])} (setup_queued {pp('setup_queued')} queued "
              f"{med([r['profile_queued_s'] for r in rows])} exclusive {med([r['exclusive_s'] for r in rows])} spot "
              f"{pp('spot_checks')}); worker waits max {[round(w, 2) for w in waits[-3:]]}, over 0.5 s: "
              f"{sum(w > 0.5 for w in waits)} of {len(waits)}")
PY
echo "== done in $(( $(date +%s) - start )) s"
