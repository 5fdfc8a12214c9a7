#!/usr/bin/env bash
# Judge VI's GPU checks in one device call: honest small kernels profiled alone (bench/small_kernels.py), then the
# GPU suites that time kernels (the example, a cached baseline, side-stream work, forged event times, confinement).
# Logs under $OUT as they are written; a failure's traceback is printed the moment it happens.
#   OUT=/tmp/j6 bash bench/judge_vi_device.sh
set -u
OUT=${OUT:-/tmp/judge-vi}
mkdir -p "$OUT"
py=${PYTHON:-python3}
export CUDA_AGENT_EAGER_FAILURES=1
step() { echo "== $1 ($(date +%T))"; }
t() {  # t SECONDS NAME pytest-args...
  local s=$1 name=$2; shift 2
  step "$name"
  timeout "$s" $py -u -m pytest -v -p no:cacheprovider --timeout 200 "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/$name.log" | sed -E 's/^tests\///' | cut -c1-160 | tail -n 30
  grep -E "^E  |^!! " "$OUT/$name.log" | cut -c1-300 | head -n 16
}
t ${SUITE_S:-100} gpu_suite -m gpu tests/test_gpu.py -k "example or cached_baseline"
step small_kernels
timeout "${SMALL_S:-240}" $py -u bench/small_kernels.py --out "$OUT/sk" --deadline-s "${SMALL_DEADLINE:-200}" \
  ${SMALL_ARGS:-} > "$OUT/small_kernels.log" 2>&1
echo "rc=$?"; grep -E "^==|ordered right|ok=False" "$OUT/small_kernels.log" | cut -c1-400
cp "$OUT/sk/small_kernels.json" "$OUT/" 2>/dev/null
rm -rf "$OUT/sk"
t ${EXPLOITS_S:-100} gpu_exploits -m gpu tests/exploits/test_gpu_exploits.py -k "honest or side_stream or unwatched"
t ${FORGERY_S:-110} gpu_forgery -m gpu tests/exploits/test_gpu_forgery.py -k "honest or forged_event"
t ${CONFINE_S:-70} gpu_confinement -m gpu tests/exploits/test_gpu_confinement.py -k "confined_cuda_candidate"
step done
