#!/usr/bin/env bash
# The GPU checks of MCP server II and Judge VII in one device call: honest CUDA extensions against the symbol
# allow-list, a task's code confined in every GPU role, then the GPU suites of the changed layers (confinement,
# the build jail, spot checks drawn by the timer). Each step has its own time limit and logs under $OUT, written
# as it goes (pytest -v, unbuffered), so a step cut short still shows what passed.
#   OUT=/tmp/j7 bash bench/judge_vii_device.sh           # the core checks, about 5 minutes
#   FULL=1 OUT=/tmp/j7 bash bench/judge_vii_device.sh    # and the rest of those suites
set -u
OUT=${OUT:-/tmp/judge-vii}
mkdir -p "$OUT"
py=${PYTHON:-python3}
step() { echo "== $1 ($(date +%T))"; }
t() {  # t SECONDS NAME pytest-args...: one pytest run, its verdict lines and summary
  local s=$1 name=$2; shift 2
  step "$name"
  timeout "$s" $py -u -m pytest -v -p no:cacheprovider --timeout 150 -rfE "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/$name.log" | sed -E 's/^tests\///' | cut -c1-160 | tail -n 30
  grep -E "^E  " "$OUT/$name.log" | cut -c1-300 | head -n 12
}

if [ "${FULL:-0}" = 1 ]; then
  step extension_imports
  timeout 120 $py bench/extension_imports.py --backend cuda --out "$OUT/cuda_imports.json" \
    example/swish_bias=tasks/examples/solutions/swish_bias/cuda \
    tests/fixtures/kernelbench/level1/19_ReLU.py=bench/solutions/relu \
    tests/fixtures/cpu_multi/small_task.py=tests/fixtures/cuda_multi 2>&1 | tail -n 4
fi
t 70 task_confinement tests/exploits/test_task_confinement.py -k gpu
t 120 gpu_suite -m gpu tests/test_gpu.py -k "example"
t 100 gpu_exploits -m gpu tests/exploits/test_gpu_exploits.py -k "honest"
if [ "${FULL:-0}" = 1 ]; then
  t 200 gpu_suite_more -m gpu tests/test_gpu.py -k "wrong_kernel or cached_baseline or incremental"
  t 150 gpu_confinement -m gpu tests/exploits/test_gpu_confinement.py
fi
step done
