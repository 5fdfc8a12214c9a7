#!/usr/bin/env bash
# Issue 33 (items 2 and 6) on the device: where a timing's end goes. The profiler's end alone and under N
# copies (bench/profiler_end.py), the GPU tests of the audit's table and of the example, then the correct stream
# of bench/judge_throughput.py under eight judgments with each profile's end_*_s parts recorded.
#   carry .whl;  OUT=$OUT THROUGHPUT_S=240 bash bench/judge_vi_ends.sh
set -u
OUT=${OUT:-/tmp/judge-vi-ends}
mkdir -p "$OUT"
py=${PYTHON:-python3}
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -n 3
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== profiler end"
[ "${PROFILER_END:-1}" = 1 ] && timeout 150 $py bench/profiler_end.py --calls 1000 4000 --copies 1 8 --json "$OUT/profiler_end.json" 2>&1 \
  | grep -v "^USDT\|SyncActivityProfilerHandler"
if [ "${SMALL_S:-0}" != 0 ]; then
  echo "== small kernels alone"
  timeout $((SMALL_S + 60)) $py bench/small_kernels.py --out "$OUT/small" --repeats 5 --speed-tasks 0 \
    --deadline-s "$SMALL_S" 2>&1 | grep -v "^USDT" | tail -n 12
fi
echo "== gpu tests"
timeout 300 $py -m pytest -m gpu tests/test_gpu.py tests/exploits/test_gpu_forgery.py -q -s -p no:cacheprovider \
  -k "${GPU_TESTS:-raw_device_table or example_solution or cached_baseline or wrong_kernel or honest_kernel or forged or slowed or patched_kernel_audit or delegation}" 2>&1 | grep -v "^USDT" | tail -n 15
echo "== throughput"
timeout "${THROUGHPUT_S:-240}" $py bench/judge_throughput.py --only correct --passes 2 --copies 2 \
  --distinct-sources --workers 8 --out "$OUT/throughput" 2>&1 | grep -v "^USDT" | tail -n 20
$py - "$OUT/throughput/throughput.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print("no throughput record:", e); raise SystemExit
for i, p in enumerate(d["passes"]):
    rows = p.get("rows", [])
    keys = sorted({k for r in rows for k in r.get("profile_ends", {})})
    tot = {k: round(sum(r.get("profile_ends", {}).get(k, 0) for r in rows), 2) for k in keys}
    ph = {k: round(sum(r["profile_phases"].get(k, 0) for r in rows), 2)
          for k in ("timing", "timing_begin", "timing_begin_profiler", "timing_batches", "timing_batches_clock",
                    "timing_end", "timing_pauses", "timing_recalibrate", "spot_checks", "audit")}
    ex = sorted(r["exclusive_s"] for r in rows if r.get("exclusive_s"))
    if ex:
        print(f"pass {i}: exclusive s median {ex[len(ex) // 2]:.2f} max {ex[-1]:.2f}; unscored",
              sum(1 for r in rows if r["speedup_vs_eager"] is None), "re-paired",
              sum(1 for r in rows if r["pairing"] and r["pairing"]["attempts"] > 1))
    print(f"pass {i}: {len(rows)} rows; summed ends {tot}; summed phases {ph}")
PY
