#!/usr/bin/env bash
# Judge VI's speed items (issue 33: 3, 5, 6, 7) on the GPU in one device call of about 9.5 minutes: the judge's
# GPU example test, the binding's compile by flags and header (bench/build_flags.py), judging throughput for a
# correct and a wrong stream with distinct sources (bench/judge_throughput.py; pass 1 fresh baselines, pass 2
# cached), and the agent's loop as MCP tool calls (bench/mcp_latency.py --pause 3). Logs under $OUT.
#   OUT=/tmp/j6s bash bench/judge_vi_speed.sh
#   PARTS="build throughput" OUT=/tmp/j6s bash bench/judge_vi_speed.sh      # some of them
#   SUITE_K="cuda_build or example": which tests of tests/test_gpu.py the suite part runs
set -u
OUT=${OUT:-/tmp/judge-vi-speed}
PARTS=${PARTS:-"suite build throughput wrong mcp"}
mkdir -p "$OUT"
py=${PYTHON:-python3}
export CUDA_AGENT_EAGER_FAILURES=1
step() { echo "== $1 ($(date +%T))"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
if want suite; then
  step gpu_suite
  timeout "${SUITE_S:-100}" $py -u -m pytest -v -p no:cacheprovider --timeout 90 -m gpu tests/test_gpu.py -k "${SUITE_K:-example}" \
    > "$OUT/gpu_suite.log" 2>&1
  echo "rc=$?"; grep -E "PASSED|FAILED|ERROR|^E  " "$OUT/gpu_suite.log" | cut -c1-200 | head -n 20
fi
if want build; then
  step build_flags
  timeout "${BUILD_S:-130}" $py -u bench/build_flags.py --repeats 2 --parallel 8 --out "$OUT/build_flags.json" \
    --variants "${BUILD_VARIANTS:-O3-pch,O3-pch-bare,O2-pch,O1-pch}" 2>&1 | tee "$OUT/build_flags.log" | cut -c1-400
fi
if want throughput; then
  step throughput_correct
  timeout "${TP_S:-170}" $py -u bench/judge_throughput.py --out /tmp/jt-correct --only correct --passes 2 \
    --copies "${TP_COPIES:-2}" \
    --distinct-sources --workers 8 > "$OUT/throughput_correct.log" 2>&1
  echo "rc=$?"; grep -E "^\{|Error|Traceback" "$OUT/throughput_correct.log" | cut -c1-900
  tail -n 3 "$OUT/throughput_correct.log" | cut -c1-300
  cp /tmp/jt-correct/throughput.json "$OUT/throughput_correct.json" 2>/dev/null
  # the last pass's phases, median over its judgments: where a verify and a profile spend their time under load
  $py - "$OUT/throughput_correct.json" <<'PY' 2>&1 | tail -n 4
import json, statistics, sys
rows = json.load(open(sys.argv[1]))["passes"][-1]["rows"]
for part in ("verify_phases", "profile_phases"):
    keys = sorted({k for r in rows for k in r.get(part, {})})
    med = {k: round(statistics.median(r[part][k] for r in rows if k in r.get(part, {})), 2) for k in keys}
    print(part, json.dumps(med))
PY
fi
if want wrong; then
  step throughput_wrong
  timeout "${WRONG_S:-70}" $py -u bench/judge_throughput.py --out /tmp/jt-wrong --cache /tmp/jt-correct/cache \
    --only wrong --passes 1 --copies 4 --distinct-sources --workers 8 > "$OUT/throughput_wrong.log" 2>&1
  echo "rc=$?"; grep -E "^\{|Error|Traceback" "$OUT/throughput_wrong.log" | cut -c1-900
  tail -n 2 "$OUT/throughput_wrong.log" | cut -c1-300
fi
if want mcp; then
  step mcp_latency
  # KernelBench's 19_ReLU (its source as the default --task holds it; a bare device has no suite installed)
  task=(); [ -n "${MCP_TASK_FILE:-}" ] && task=(--task-file "$MCP_TASK_FILE")
  timeout "${MCP_S:-140}" $py -u bench/mcp_latency.py --pause 3 --repeats 3 --worker-start fork "${task[@]}" \
    --out "$OUT/mcp_latency.json" > "$OUT/mcp_latency.log" 2>&1
  echo "rc=$?"; grep -vE "^\s*\|" "$OUT/mcp_latency.log" | cut -c1-260 | head -n 30
fi
step done
