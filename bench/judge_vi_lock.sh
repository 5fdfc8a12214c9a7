#!/usr/bin/env bash
# Issue 33 (item 6) on the device: the device lock's timings back to back and verifies stepping aside, against the
# judge before it on the same machine. The GPU tests of the judge's exploits and of an honest kernel, then the
# correct stream of bench/judge_throughput.py under eight judgments, first with the judge of BEFORE_TAR (a `git
# archive` of the earlier commit, if carried), then with this tree's; a summary of both side by side.
#   git archive -o old_judge.tar 34a95dd   # ignored locally (.git/info/exclude), carried
#   carry .whl old_judge.tar;  OUT=$OUT THROUGHPUT_S=200 bash bench/judge_vi_lock.sh
set -u
OUT=${OUT:-/tmp/judge-vi-lock}
mkdir -p "$OUT"
py=${PYTHON:-python3}
site=/tmp/site
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | tail -n 3
fi
export PYTHONPATH=$site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
args=(--only correct --passes 2 --copies "${COPIES:-2}" --distinct-sources --workers "${WORKERS:-8}")
if [ "${GPU_TESTS:-}" != none ]; then
  echo "== gpu tests"
  timeout 300 $py -m pytest -m gpu tests/test_gpu.py tests/exploits/test_gpu_forgery.py -q -s -p no:cacheprovider \
    -k "${GPU_TESTS:-example_solution or honest_kernel or delegation or patched_kernel_audit or forged}" 2>&1 \
    | grep -v "^USDT" | tail -n 15
fi
BEFORE_TAR=${BEFORE_TAR:-old_judge.tar}
if [ -f "$BEFORE_TAR" ]; then
  echo "== throughput, the judge before ($BEFORE_TAR)"
  rm -rf /tmp/old-judge && mkdir -p /tmp/old-judge && tar -xf "$BEFORE_TAR" -C /tmp/old-judge
  (cd /tmp/old-judge && PYTHONPATH=$site:/tmp/old-judge timeout "${THROUGHPUT_S:-200}" $py bench/judge_throughput.py \
    "${args[@]}" --out "$OUT/before" 2>&1 | grep -v "^USDT" | tail -n 8)
fi
for n in ${AFTER_WORKERS:-8}; do
  echo "== throughput, this judge, $n workers"
  run=after; [ "$n" = "${WORKERS:-8}" ] || run=after-w$n
  timeout "${THROUGHPUT_S:-200}" $py bench/judge_throughput.py "${args[@]}" --workers "$n" --out "$OUT/$run" 2>&1 \
    | grep -v "^USDT" | tail -n 4
  cp "$OUT/$run/throughput.json" "$OUT/throughput_$run.json" 2>/dev/null
done
cp "$OUT/before/throughput.json" "$OUT/throughput_before.json" 2>/dev/null
$py - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None

for f in sorted(Path(sys.argv[1]).glob("throughput_*.json")):
    run = f.stem.removeprefix("throughput_")
    if not f.exists():
        print(run, "no record"); continue
    for i, p in enumerate(json.loads(f.read_text())["passes"]):
        rows, s = p["rows"], p["summary"]
        pp = lambda k: med([r["profile_phases"].get(k) for r in rows])
        vp = lambda k: med([r["verify_phases"].get(k) for r in rows])
        print(f"{run} pass {i}: {s['per_minute']}/min ({s['judgments']} in {s['wall_s']} s), wrong {s['verdicts_wrong']}, "
              f"unscored {sum(1 for r in rows if r['speedup_vs_eager'] is None)}; medians: wall {med([r['wall_s'] for r in rows])} "
              f"build {med([r['build_s'] for r in rows])} verify {med([r['verify_s'] for r in rows])} "
              f"profile {med([r['profile_s'] for r in rows])} exclusive {med([r['exclusive_s'] for r in rows])} "
              f"profile queued {med([r['profile_queued_s'] for r in rows])} verify queued {vp('queued')} "
              f"verify ready {vp('ready')} trials {vp('trials')} comparisons {vp('comparisons')} (opening "
              f"{vp('comparisons_open')}) verify setup {vp('setup')} profile ready {pp('ready')} "
              f"setup {pp('setup')} setup_queued {pp('setup_queued')} spot {pp('spot_checks')} "
              f"audit_setup {med([r['profile_ends'].get('audit_setup_s') for r in rows])}")
PY
