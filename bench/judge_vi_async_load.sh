#!/usr/bin/env bash
# Issue 33 on the device: honest small kernels profiled beside bursts of GPU work that take no device lock (a
# policy generating between judgments), with the judge before the async-work probe's paired empty calls and with
# this tree's; then the GPU tests of the side-stream exploit and of honest kernels.
#   git archive -o old_judge.tar 1ed316b   # ignored locally (.git/info/exclude), carried
#   carry .whl old_judge.tar;  OUT=$OUT bash bench/judge_vi_async_load.sh
#   BEFORE_TAR=none AFTER_LOADS="turns free none" ...   # this judge only: loads taking turns, free, and none
set -u
OUT=${OUT:-/tmp/judge-vi-async}
mkdir -p "$OUT"
py=${PYTHON:-python3}
site=/tmp/site
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | tail -n 3
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sk=(--shapes "${SHAPES:-4096,4096}" --repeats "${REPEATS:-2}" --speed-tasks 0 --deadline-s "${DEADLINE:-150}")
summ() { grep -E "^== |ok=False" "$1" | grep -v "^USDT" | tail -n 12; }
BEFORE_TAR=${BEFORE_TAR:-old_judge.tar}
if [ -f "$BEFORE_TAR" ]; then
  echo "== small kernels beside a GPU load, the judge before ($BEFORE_TAR)"
  rm -rf /tmp/old-judge && mkdir -p /tmp/old-judge && tar -xf "$BEFORE_TAR" -C /tmp/old-judge
  cp bench/small_kernels.py /tmp/old-judge/bench/
  (cd /tmp/old-judge && CUDA_AGENT_CACHE=/tmp/cache-before PYTHONPATH=$site:/tmp/old-judge timeout 260 \
    $py bench/small_kernels.py "${sk[@]}" --gpu-load free --out "$OUT/before" > "$OUT/before.log" 2>&1)
  summ "$OUT/before.log"
fi
for load in ${AFTER_LOADS:-free}; do
  echo "== small kernels beside a GPU load ($load), this judge"
  CUDA_AGENT_CACHE=/tmp/cache-after PYTHONPATH=$site:$PWD timeout 260 $py bench/small_kernels.py "${sk[@]}" \
    $([ "$load" = none ] || echo "--gpu-load $load") --out "$OUT/after-$load" > "$OUT/after-$load.log" 2>&1
  summ "$OUT/after-$load.log"
done
for run in before after-free after-turns after-none; do
  cp "$OUT/$run/small_kernels.json" "$OUT/small_kernels_$run.json" 2>/dev/null
done
if [ "${GPU_TESTS:-}" != none ]; then
  echo "== gpu tests"
  PYTHONPATH=$site:$PWD timeout 240 $py -m pytest -m gpu tests/exploits/test_gpu_exploits.py tests/test_gpu.py -q \
    -p no:cacheprovider -k "${GPU_TESTS:-side_stream or honest_kernel or example_solution}" 2>&1 \
    | grep -v "^USDT" | tail -n 8
fi
