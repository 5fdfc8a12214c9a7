#!/usr/bin/env bash
# Issues 35 (Ray) and 37 (synthesis) on a two-GPU host in one device call of about 9 minutes: the filter with a
# fresh probe process per task against one serving eight (bench/synth_filter_reuse.py), a synth build slice's
# filter rate over both GPUs (`synth build --jobs 16 --gpus 0,1`; the build folder comes back in $OUT to resume),
# then bench/ray_eval_scaling.py (eval --solutions over 24 elementwise tasks: the single-host path, Ray on one GPU,
# Ray on two, each run's timeline).
#
# Ray's wheel (79 MB) is more than a call carries (64 MiB). Unpacked, without its Java jars and RLlib (neither is
# used here), it packs into 32 MB with xz, so it travels in one call:
#   here:   mkdir x && cd x && unzip -q ../.whl-ray/ray-*.whl && tar cf - --exclude=ray/jars --exclude=ray/rllib . \
#             | xz -6 > ../.ray-slim/ray-slim.tar.xz
#   device: OUT=$OUT bash bench/two_gpu_device.sh                        (carry .ray-slim and .whl)
# or in two parts of the wheel (`split -b 40m`), the first copied to /tmp by an earlier call to the same machine.
set -u
OUT=${OUT:-/tmp/two-gpu}
PARTS=${PARTS:-"reuse synth ray"}
mkdir -p "$OUT"
py=${PYTHON:-python3}
step() { echo "== $1 ($(date +%T))"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
step install
mkdir -p /tmp/rw
if [ -f /tmp/raypart.aa ] && [ -f .raypart-b/raypart.ab ]; then
  cat /tmp/raypart.aa .raypart-b/raypart.ab > /tmp/rw/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
fi
$py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls /tmp/rw/*.whl 2>/dev/null) \
  2>&1 | tail -n 3
if [ -f .ray-slim/ray-slim.tar.xz ]; then tar xJf .ray-slim/ray-slim.tar.xz -C /tmp/site; fi
export PYTHONPATH=/tmp/site:$PWD
$py -c "import ray; print('ray', ray.__version__)" 2>&1 | tail -n 1
nvidia-smi -L
if want reuse; then
  step synth_filter_reuse
  timeout "${REUSE_S:-150}" $py -u bench/synth_filter_reuse.py --backend cuda --count "${REUSE_COUNT:-64}" \
    --jobs "${SYNTH_JOBS:-16}" --gpus 0,1 --per-worker 1,8 --out /tmp/sfr > "$OUT/synth_filter_reuse.log" 2>&1
  echo "rc=$?"; grep -E "^\{" "$OUT/synth_filter_reuse.log" | cut -c1-600
fi
if want synth; then
  step synth_filter
  # SYNTH_OUT: a build folder carried in from an earlier call (the set's build: --count 2400 --seed 0, in
  # bench/results/synth_build_state.tgz) is resumed; decontamination needs KernelBench on the device: carry a copy
  # of its levels and set CUDA_AGENT_KERNELBENCH. SYNTH_GPUS=0 SYNTH_JOBS=8: the same on a one-GPU machine
  # SYNTH_TGZ: the folder as an archive instead (bench/results/synth_build_state.tgz: its sources compress ~20x
  # under a call's 64 MiB), unpacked beside SYNTH_OUT first. A call returns at most 8 files from $OUT: this part
  # writes three (synth_build.log, synth_filter_reuse.log only with PARTS=reuse, synth-build.tgz)
  sb=${SYNTH_OUT:-/tmp/sb}
  if [ -n "${SYNTH_TGZ:-}" ] && [ -f "$SYNTH_TGZ" ]; then
    mkdir -p "$(dirname "$sb")"; rm -rf "$sb"; tar xzf "$SYNTH_TGZ" -C "$(dirname "$sb")"
  fi
  resume=(); [ -f "$sb/build.json" ] && resume=(--resume)
  timeout "${SYNTH_S:-170}" $py -u -m cuda_agent synth build --out "$sb" --count "${SYNTH_COUNT:-800}" --seed "${SYNTH_SEED:-0}" \
    --backend cuda --jobs "${SYNTH_JOBS:-16}" --gpus "${SYNTH_GPUS:-0,1}" --time-limit "${SYNTH_LIMIT:-140}" "${resume[@]}" \
    > "$OUT/synth_build.log" 2>&1
  echo "rc=$?"
  grep -vE "^(filter|selfcheck): [0-9]+/" "$OUT/synth_build.log" | cut -c1-300 | tail -n 12
  grep -E "^(filter|selfcheck): [0-9]+/" "$OUT/synth_build.log" | tail -n 2
  # per-probe seconds and worker waits (synth.filter.probe_one's metrics) of the tasks the filter saw
  $py - "$sb" <<'PY' 2>&1 | tail -n 5
import json, statistics, glob
import sys
rows = [json.loads(l) for f in glob.glob(sys.argv[1] + "/**/*.jsonl", recursive=True) for l in open(f) if '"probe_s"' in l]
for key in ("probe_s", "worker_wait_s", "compile_s", "eager_ms"):
    xs = sorted(r["metrics"][key] for r in rows if key in r.get("metrics", {}))
    if xs:
        print(f"{key}: n={len(xs)} median={statistics.median(xs):.3f} p90={xs[int(0.9 * (len(xs) - 1))]:.3f}")
PY
  tar czf "$OUT/synth-build.tgz" -C "$(dirname "$sb")" "$(basename "$sb")" 2>/dev/null; ls -la "$OUT/synth-build.tgz"
fi
if want ray; then
  step ray_scaling
  # RAY_ARGS: more of the bench's options, e.g. RAY_ARGS="--tasks 12 --configs host:0;1,ray:0,ray:0;1"
  timeout "${RAY_S:-420}" $py -u bench/ray_eval_scaling.py --out /tmp/rs --timeout "${RAY_CONFIG_S:-150}" \
    ${RAY_ARGS:-} > "$OUT/ray_scaling.log" 2>&1
  echo "rc=$?"; grep -E "^\{" "$OUT/ray_scaling.log" | cut -c1-700
  tail -n 5 "$OUT/ray_scaling.log" | cut -c1-300
  cp /tmp/rs/summary.json "$OUT/ray_summary.json" 2>/dev/null
  # each run's stderr, episodes and report (why a judgment failed), one archive: a call returns at most 8 files
  tar czf "$OUT/ray_runs.tgz" -C /tmp/rs --exclude='*.so' --exclude='*.o' --exclude='*.gch' . 2>/dev/null
  ls -la "$OUT/ray_runs.tgz"
fi
step done
