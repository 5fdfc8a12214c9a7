#!/usr/bin/env bash
# Judge VI's GPU checks, in one or two device calls: PART=suites runs the GPU suites that time kernels (the
# judge's suite, exploits, forgeries, confinement); PART=small profiles honest small kernels alone
# (bench/small_kernels.py, issue 33's evidence); PART=all (default) both, with shorter limits.
# Logs under $OUT as they are written; a failure's traceback is printed the moment it happens.
#   OUT=/tmp/j6 PART=suites bash bench/judge_vi_device.sh      # about 9 minutes
#   OUT=/tmp/j6 PART=small bash bench/judge_vi_device.sh       # about 6 minutes
set -u
OUT=${OUT:-/tmp/judge-vi}
PART=${PART:-all}
mkdir -p "$OUT"
py=${PYTHON:-python3}
export CUDA_AGENT_EAGER_FAILURES=1
step() { echo "== $1 ($(date +%T))"; }
t() {  # t SECONDS NAME pytest-args...
  local s=$1 name=$2; shift 2
  [ "$s" = 0 ] && return  # a limit of 0 skips the part
  step "$name"
  timeout "$s" $py -u -m pytest -v -p no:cacheprovider --timeout 200 "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/$name.log" | sed -E 's/^tests\///' | cut -c1-160 | tail -n 30
  grep -E "^E  |^!! " "$OUT/$name.log" | cut -c1-300 | head -n 16
}
if [ "$PART" != small ]; then
  t ${SUITE_S:-160} gpu_suite -m gpu tests/test_gpu.py -k "${SUITE_K:-example or cached_baseline or reduce_overhead or wrong_kernel or illegal}"
fi
if [ "$PART" != suites ]; then
  step small_kernels
  timeout "${SMALL_S:-240}" $py -u bench/small_kernels.py --out "$OUT/sk" --deadline-s "${SMALL_DEADLINE:-200}" \
    ${SMALL_ARGS:-} > "$OUT/small_kernels.log" 2>&1
  echo "rc=$?"; grep -E "^==|ordered right|ok=False" "$OUT/small_kernels.log" | cut -c1-400
  cp "$OUT/sk/small_kernels.json" "$OUT/" 2>/dev/null
  rm -rf "$OUT/sk"
fi
if [ "$PART" != small ]; then
  t ${EXPLOITS_S:-110} gpu_exploits -m gpu tests/exploits/test_gpu_exploits.py
  t ${FORGERY_S:-130} gpu_forgery -m gpu tests/exploits/test_gpu_forgery.py
  t ${CONFINE_S:-170} gpu_confinement -m gpu tests/exploits/test_gpu_confinement.py
fi
step done
