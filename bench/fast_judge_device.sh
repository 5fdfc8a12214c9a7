#!/usr/bin/env bash
# The fast judge's numbers on one GPU, in one device call (docs/benchmarks.md, "Fast judge"): MCP tool calls
# 3 s apart, the API's verify and profile phases, the CLI's verify call after call (template daemon), and
# judgments per minute (a mix with fresh then cached baselines, then a stream of correct and of wrong ones).
#   OUT=/tmp/fj bash bench/fast_judge_device.sh        # logs and JSON under $OUT
set -u
OUT=${OUT:-/tmp/fast-judge}
mkdir -p "$OUT"
T=tests/fixtures/kernelbench/level1/19_ReLU.py
S=bench/solutions/relu
py=${PYTHON:-python3}
step() { echo "== $1 ($(date +%T))"; }

step mcp_latency
timeout 170 $py bench/mcp_latency.py --task $T --solution $S --pause 3 --repeats 3 --worker-start fork \
    --out "$OUT/mcp_latency.json" > "$OUT/mcp_latency.log" 2>&1; echo "rc=$?"; tail -n 12 "$OUT/mcp_latency.log"

step worker_start
timeout 120 $py bench/worker_start.py --modes fork --calls 3 --pause 3 --backend cuda --task $T --solution $S \
    --out "$OUT/worker_start.json" > "$OUT/worker_start.log" 2>&1; echo "rc=$?"; tail -n 8 "$OUT/worker_start.log"

step cli_verify
ws=/tmp/fj-ws; rm -rf $ws
$py -m cuda_agent init $T $ws --backend cuda > /dev/null && cp -r $S/. $ws/ && $py -m cuda_agent compile $ws | tail -n 1
timeout 120 $py bench/cli_daemon.py $ws --rounds 1 --calls 4 --out "$OUT/cli_daemon.json" > "$OUT/cli_daemon.log" 2>&1
echo "rc=$?"; tail -n 8 "$OUT/cli_daemon.log"

step judge_throughput
jt=/tmp/fj-jt
timeout 200 $py bench/judge_throughput.py --out $jt --workers 8 --copies 2 --passes 2 > "$OUT/throughput_mix.log" 2>&1
echo "rc=$?"; cat "$OUT/throughput_mix.log" | cut -c1-600
# the same judge cache (baselines cached): a stream of correct solutions, then of wrong ones
timeout 90 $py bench/judge_throughput.py --out $jt-c --cache $jt/cache --workers 8 --copies 3 --passes 1 --only correct \
    > "$OUT/throughput_correct.log" 2>&1; echo "rc=$?"; cut -c1-600 "$OUT/throughput_correct.log"
timeout 60 $py bench/judge_throughput.py --out $jt-w --cache $jt/cache --workers 8 --copies 4 --passes 1 --only wrong \
    > "$OUT/throughput_wrong.log" 2>&1; echo "rc=$?"; cut -c1-600 "$OUT/throughput_wrong.log"
step done
