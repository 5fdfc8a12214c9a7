#!/usr/bin/env bash
# One device call of Judge VI's measurements (issue 33, items 3, 6, 7) on one GPU, everything packed into one
# archive (a call returns at most 8 files): the spot-copy GPU tests, KernelBench's 19_ReLU profiled three times
# with `cuda-agent profile --json` (the first fills the baseline) and its phases and spot-copy checks printed,
# the agent's loop as MCP tool calls (bench/mcp_latency.py --pause 3), and judging throughput for a correct
# stream with distinct sources (bench/judge_throughput.py, pass 1 fresh baselines, pass 2 cached).
#   carry .whl (device-wheels -e . 'mcp>=2.3' pytest-timeout) and runs/kernelbench (a copy of the levels)
#   OUT=$OUT bash bench/judge_vi_round.sh
#   PARTS="relu mcp" OUT=$OUT bash bench/judge_vi_round.sh
#   PARTS="build" ...: the binding's compile, plain header against pybind11-interface (item 5)
set -u
OUT=${OUT:-/tmp/judge-vi-round}
PARTS=${PARTS:-"tests relu mcp throughput"}
W=/tmp/jvr
rm -rf "$W"; mkdir -p "$W" "$OUT"
py=${PYTHON:-python3}
export CUDA_AGENT_EAGER_FAILURES=1
step() { echo "== $1 ($(date +%T))"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
# the archive is rewritten after every part: a call cut by its time limit still returns what finished
pack() { tar czf "$OUT/judge_vi_round.tgz" -C "$W" . 2>/dev/null; }
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -n 3
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L
relu=${RELU_TASK:-runs/kernelbench/level1/19_ReLU.py}
if want tests; then
  step gpu_tests
  s=$(date +%s%N)
  # TESTS_FILES: more GPU test files beside tests/test_gpu.py; TESTS_K picks tests across all of them
  timeout "${TESTS_S:-150}" $py -u -m pytest -v -p no:cacheprovider --timeout 120 -m gpu ${TESTS_FILES:-tests/test_gpu.py} \
    -k "${TESTS_K:-spot_copies}" > "$W/gpu_tests.log" 2>&1
  echo "rc=$? $(( ($(date +%s%N) - s) / 1000000 )) ms"
  grep -E "PASSED|FAILED|ERROR|^E  " "$W/gpu_tests.log" | cut -c1-220 | head -n 20
fi
pack
if want build; then  # item 5: the binding's compile against the plain and the pybind11-interface header
  step build_flags
  timeout "${BUILD_S:-200}" $py -u bench/build_flags.py --variants "${BUILD_VARIANTS:-O1-pch,O1-pch-iface}" \
    --repeats 2 --parallel 8 --out "$W/build_flags.json" > "$W/build_flags.log" 2>&1
  echo "rc=$?"; tail -n 4 "$W/build_flags.log" | cut -c1-400
fi
pack
if want relu; then
  step relu
  ws=/tmp/ws_relu; rm -rf "$ws"
  $py -m cuda_agent init "$relu" "$ws" --backend cuda --json > "$W/init.json" 2>"$W/init.err"; echo "init rc=$?"
  cp -r bench/solutions/relu/. "$ws/"
  for what in compile profile1 profile2 profile3; do
    cmd=${what%[0-9]}
    s=$(date +%s%N)
    timeout 120 $py -m cuda_agent "$cmd" "$ws" --json > "$W/$what.json" 2>"$W/$what.err"
    echo "$what rc=$? $(( ($(date +%s%N) - s) / 1000000 )) ms"
  done
  $py - "$W" <<'PY'
import json, sys
for n in (1, 2, 3):
    try:
        p = json.load(open(f"{sys.argv[1]}/profile{n}.json"))
    except Exception as e:  # noqa: BLE001
        print(f"profile{n}: unreadable ({e})"); continue
    print(f"profile{n} ok {p.get('ok')} {p.get('reason')} dur {p.get('duration_s', 0):.2f} speedup {p.get('speedup_vs_eager')}")
    print("  phases", {k: round(v, 2) for k, v in (p.get("phases") or {}).items()})
    c = p.get("checks") or {}
    print("  checks", {k: c[k] for k in c if k.startswith(("spot", "timed_calls"))})
PY
fi
pack
if want mcp; then
  step mcp_latency
  timeout "${MCP_S:-150}" $py -u bench/mcp_latency.py --pause 3 --repeats "${MCP_REPEATS:-2}" --worker-start fork \
    --task-file "$relu" --out "$W/mcp_latency.json" > "$W/mcp_latency.log" 2>&1
  echo "rc=$?"; grep -vE "^\s*\|" "$W/mcp_latency.log" | cut -c1-260 | tail -n 24; grep -E "^\s*\|" "$W/mcp_latency.log" | tail -n 14
fi
pack
if want throughput; then
  step throughput_correct
  timeout "${TP_S:-170}" $py -u bench/judge_throughput.py --out /tmp/jt-correct --only correct --passes 2 \
    --copies "${TP_COPIES:-2}" --distinct-sources --workers 8 > "$W/throughput_correct.log" 2>&1
  echo "rc=$?"; grep -E "^\{|Error|Traceback" "$W/throughput_correct.log" | cut -c1-900
  tail -n 3 "$W/throughput_correct.log" | cut -c1-300
  cp /tmp/jt-correct/throughput.json "$W/throughput_correct.json" 2>/dev/null
fi
pack
step done
