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
PYTHONPATH=$site:$here $py bench/throughput_summary.py "$OUT"
if [ "${GPU_TESTS:-}" != none ]; then
  echo "== gpu tests"
  timeout "$(( $(left) > 60 ? $(left) : 60 ))" $py -m pytest -m gpu tests/test_gpu.py tests/test_template.py \
    tests/exploits/test_gpu_forgery.py -q -p no:cacheprovider -k "${GPU_TESTS:-gated_pool or ready_cuda_worker or \
forked_worker_initialises or example_solution or honest_kernel or cached_baseline}" --tb=short 2>&1 | grep -v "^USDT" | tail -n 40
fi
echo "== done in $(( $(date +%s) - start )) s"
