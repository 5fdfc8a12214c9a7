#!/usr/bin/env bash
# Issue 33's rates (item 6) and the agent's loop (item 7) in one device call, each run a new process:
#   infra   the build infrastructure and the [4096, 4096] baselines (8 correct judgments; not a target)
#   mix     the mix (correct, wrong, compile error, crash, timeout) from fresh baselines: [2048, 4096] tasks,
#           whose baselines no earlier run measured, on the warm build cache (target: 30 a minute)
#   correct the correct stream, cached baselines (target: 60 a minute)
#   wrong   the wrong stream, cached baselines, WORKERS_WRONG at a time for each (target: 200 a minute)
#   one/two the correct stream on GPU 0 with 8 workers, then on GPUs 0 and 1 with 16 (a two-GPU host; target 1.9x)
#   loop    bench/mcp_latency.py --pause 3 on 19_ReLU, workers forked (targets: verify 1.5 s, cached profile 2 s,
#           rebuild 2.5 s); its whole log in OUT/loop.log
#   build   bench/build_time.py: a new workspace's build, bindings thin, against the pybind11 header, without the
#           precompiled header (BUILD_REPEATS each; target: 4 s)
#   ctx     a CUDA context's creation in fresh processes, one at a time, by CUDA_DEVICE_MAX_CONNECTIONS (CTX_CONNECTIONS)
#   pe*     bench/profile_exclusive.py: a level-1 task's solution (TASK_<part>, 19_ReLU by default; one of
#           tests/fixtures/harness/solutions/level1) profiled PE_CALLS times alone, cached baseline, with
#           SET_<part>'s ProfileConfig fields ("target_ms=250"); rows in OUT/<part>.json
#   tests   pytest -m gpu -k "$GPU_TESTS" over the GPU test files
# Every judge_throughput run has --distinct-sources and ends by its own --deadline-s, keeping what finished.
#   carry .whl;  OUT=$OUT DEADLINE=520 bash bench/judge_vi_targets.sh
# PARTS picks and orders the parts (default "infra mix correct wrong loop"); VARS_<part> sets environment variables
# for one part ("CUDA_AGENT_EARLY_RUNTIME=1 X=Y"), by its whole name or by the name without its trailing digits; COPIES_CORRECT, COPIES_WRONG size those streams.
set -u
OUT=${OUT:-/tmp/judge-vi-targets}
mkdir -p "$OUT"
py=${PYTHON:-python3}
site=/tmp/site
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | tail -n 3
fi
export PYTHONPATH=$site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
left() { echo $(( ${DEADLINE:-520} - ($(date +%s) - start) )); }
cache="$OUT/infra/cache"

throughput() {  # name limit_s [judge_throughput args...]
  local name=$1 base=$1 limit=$2 budget vars n=2
  shift 2
  # a part run again in one call (PARTS="wrong wrongoff wrong wrongoff") gets its own folder: wrong16_r2, ...
  while [ -e "$OUT/$name" ]; do name="${base}_r$n"; n=$((n + 1)); done
  budget=$(( $(left) - 15 ))
  if [ "$budget" -lt 30 ]; then echo "== $name: skipped, ${budget}s left"; return; fi
  [ "$budget" -gt "$limit" ] && budget=$limit
  vars=$(eval echo "\${VARS_${name}:-\${VARS_${name%%[0-9]*}:-}}")
  echo "== $name (deadline ${budget}s; ${vars:-default settings}): $*"
  env $vars timeout $(( budget + 40 )) $py bench/judge_throughput.py --passes 1 --distinct-sources --cache "$cache" \
    --deadline-s "$budget" --out "$OUT/$name" "$@" 2>&1 | grep -v "^USDT" | grep -E "^\{|Error|error:" | tail -n 3
  cp "$OUT/$name/throughput.json" "$OUT/throughput_$name.json" 2>/dev/null
}

for part in ${PARTS:-infra mix correct wrong loop}; do
  case $part in
    infra*) throughput "$part" "${INFRA_S:-130}" --only correct --copies 1 --workers 8 ;;
    mix) throughput mix "${MIX_S:-100}" --rows 2048 --copies 2 --workers 8 ;;
    correct*) throughput "$part" "${CORRECT_S:-80}" --only correct --copies "${COPIES_CORRECT:-8}" --workers 8 ;;
    wrong*)
      for w in ${WORKERS_WRONG:-8 16}; do
        throughput "$part$w" "${WRONG_S:-45}" --only wrong --copies "${COPIES_WRONG:-8}" --workers "$w"
      done ;;
    one) throughput one "${CORRECT_S:-80}" --only correct --copies "${COPIES_CORRECT:-8}" --workers 8 --gpus 0 ;;
    two) throughput two "${CORRECT_S:-80}" --only correct --copies "${COPIES_TWO:-16}" --workers 16 --gpus 0,1 ;;
    build)
      echo "== build: bench/build_time.py"
      timeout "$(( $(left) > 60 ? $(left) : 60 ))" $py bench/build_time.py --repeats "${BUILD_REPEATS:-3}" \
        --out "$OUT/build_time.json" 2>&1 | grep -v "^USDT" | grep -E "^  |backend|Error" ;;
    ctx)
      echo "== ctx: a context's creation, one process at a time"
      for c in ${CTX_CONNECTIONS:-8 2 1}; do
        for i in 1 2 3; do
          CUDA_DEVICE_MAX_CONNECTIONS=$c $py -c "import time, torch; t = time.perf_counter(); torch.cuda.init(); \
t1 = time.perf_counter(); torch.empty(0, device='cuda'); t2 = time.perf_counter(); \
print(f'connections $c: runtime {t1 - t:.3f} s context {t2 - t1:.3f} s')" 2>&1 | grep -v "^USDT"
        done
      done ;;
    tests)
      echo "== gpu tests: ${GPU_TESTS:-one_judgment}"
      timeout "$(( $(left) > 60 ? $(left) : 60 ))" $py -m pytest -m gpu tests/test_gpu.py tests/exploits/test_gpu_exploits.py \
        -q -p no:cacheprovider -k "${GPU_TESTS:-one_judgment}" --tb=short 2>&1 | grep -v "^USDT" | tail -n 30 ;;
    loop)
      budget=$(( $(left) - 10 ))
      [ "$budget" -gt "${LOOP_S:-130}" ] && budget=${LOOP_S:-130}
      if [ "$budget" -lt 60 ]; then echo "== loop: skipped, ${budget}s left"; continue; fi
      echo "== loop: bench/mcp_latency.py --pause 3 (limit ${budget}s)"
      timeout "$budget" $py bench/mcp_latency.py --task-file tests/fixtures/kernelbench/level1/19_ReLU.py --pause 3 \
        --repeats "${LOOP_REPEATS:-2}" --worker-start fork --out "$OUT/mcp_latency.json" > "$OUT/loop.log" 2>&1
      grep -v "^USDT" "$OUT/loop.log" | grep -E "^[a-z|]|Error" | grep -vE "^\s*\|\s+(File|\^)" | cut -c1-600 | tail -n 24 ;;
    pe*)  # SET_<part>="target_ms=250 ..." : ProfileConfig fields for this part's profiles
      sets=""; for kv in $(eval echo "\${SET_${part}:-}"); do sets="$sets --set $kv"; done
      pe_task=$(eval echo "\${TASK_${part}:-19_ReLU}")
      echo "== $part: bench/profile_exclusive.py on $pe_task (${sets:-default settings})"
      timeout "$(( $(left) > 60 ? $(left) : 60 ))" $py bench/profile_exclusive.py \
        --task "tests/fixtures/kernelbench/level1/$pe_task.py" --solution "tests/fixtures/harness/solutions/level1/$pe_task" \
        --backend cuda --workspace "$OUT/pe-ws-$pe_task" --calls "${PE_CALLS:-5}" --pause 1 $sets --out "$OUT/$part.json" 2>&1 \
        | grep -v "^USDT" | cut -c1-900 | tail -n 12 ;;
    *) echo "== unknown part $part" ;;
  esac
done
$py bench/throughput_summary.py "$OUT"
echo "== done in $(( $(date +%s) - start )) s"
