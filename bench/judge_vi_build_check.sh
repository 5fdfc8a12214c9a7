#!/usr/bin/env bash
# Issue 33 item 5 on the device, through the CLI as a user's build runs: KernelBench's 19_ReLU with
# bench/solutions/relu built from an empty judge cache (the toolchain's infrastructure included), then after an
# edit of its binding alone and of its .cu alone (the "new source" a rebuild pays), each step's seconds printed.
#   carry .whl and runs/kernelbench;  OUT=$OUT bash bench/judge_vi_build_check.sh
set -u
OUT=${OUT:-/tmp/judge-vi-build}
mkdir -p "$OUT"
py=${PYTHON:-python3}
if [ -d .whl ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -n 3
  export PYTHONPATH=/tmp/site:$PWD
fi
export CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/jvb-cache}
rm -rf "$CUDA_AGENT_CACHE" /tmp/jvb-ws
relu=${RELU_TASK:-runs/kernelbench/level1/19_ReLU.py}
$py -m cuda_agent init "$relu" /tmp/jvb-ws --backend cuda --json > /dev/null || exit 1
cp -r bench/solutions/relu/. /tmp/jvb-ws/
for what in first binding_edit cu_edit both_edit; do
  case $what in
    binding_edit) echo "// $what" >> /tmp/jvb-ws/kernels/relu_binding.cpp ;;
    cu_edit) echo "// $what" >> /tmp/jvb-ws/kernels/relu.cu ;;
    both_edit) echo "// $what" >> /tmp/jvb-ws/kernels/relu_binding.cpp; echo "// $what" >> /tmp/jvb-ws/kernels/relu.cu ;;
  esac
  $py -m cuda_agent compile /tmp/jvb-ws --json > "$OUT/compile_$what.json" 2>&1
  $py - "$OUT/compile_$what.json" "$what" <<'PY'
import json, sys
try:
    c = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print(sys.argv[2], "unreadable", e); raise SystemExit
print(f"{sys.argv[2]:13s} ok {c['ok']} {c['duration_s']:.2f} s steps {c.get('steps')} rebuilt {c.get('rebuilt')}")
PY
done
ls "$CUDA_AGENT_CACHE"/infra/*/ 2>/dev/null | head -n 20
