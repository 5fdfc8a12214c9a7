# As ../repair_h200_2026-11-28/device_call.sh (its SFT state carried back), with the estimators chosen by EST (default grpo),
# on the tree whose engine takes turns with the judge's timings (training/engine/device_turns.py).
# Issue 36 on one GPU, in two calls that share one SFT model (the demonstrations, SFT and diagnostic took ~240 s of a
# 455 s call, so a call that reuses them holds about twice the PPO steps). Call A: everything, then the SFT state is
# sent back in 15 MB parts ($OUT/state.tgz.part-*). Call B: the parts carried back (in .carry_state/, ignored via
# .git/info/exclude), so ppo_repair finds the demonstrations, the SFT model and the diagnostic and runs PPO only.
#   A: carry .whl;                 MIN=8.3 TMO=545 SAVE_STATE=1 bash bench/results/repair_turns_h200_2026-11-28/device_call.sh
#   B: carry .whl .carry_state;    MIN=8.4 TMO=550 bash bench/results/repair_turns_h200_2026-11-28/device_call.sh
set -o pipefail
R=${R:-/tmp/repair}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error CUDA_AGENT_EAGER_FAILURES=1 PYTHONUNBUFFERED=1
mkdir -p "$R"
if ls .carry_state/state.tgz.part-* >/dev/null 2>&1; then
  cat .carry_state/state.tgz.part-* | tar xzf - -C "$R" && echo "state restored: $(ls "$R")"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${TMO:-545}" python3 bench/ppo_repair.py --out "$R" --minutes "${MIN:-8.3}" --estimators "${EST:-grpo}" 2>&1 \
  | grep -v "Loading weights\|Writing model shards" | tee "$OUT/repair.log"
echo "rc=$?" | tee -a "$OUT/repair.log"
python3 bench/judge_share.py $(ls -d "$R"/ppo-*) 2>&1 | tee "$OUT/judge_share.jsonl"
(cd "$R" && tar czf "$OUT/run.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pth' \
  --exclude='./tiny' --exclude='./tasks' --exclude='./sft' --exclude='./demos' --exclude='checkpoints' \
  --exclude='final' --exclude='rollouts' .)
if [ -n "${SAVE_STATE:-}" ]; then
  (cd "$R" && tar czf - sft demos diagnostic_sft.json) | split -b 15m - "$OUT/state.tgz.part-"
fi
ls -la "$OUT"; du -sh "$R"/*
