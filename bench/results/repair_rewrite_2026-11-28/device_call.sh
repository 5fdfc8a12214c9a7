# Issue 36 item 2 after the repair rewrite (ppo_repair --repair rewrite, correctness-only rewards): one grpo run on
# one GPU, over two calls that share one SFT model. Call A runs the demonstrations, SFT, the diagnostic and PPO steps,
# then sends the SFT state back in 15 MB parts; call B carries them (.carry_state/, ignored via .git/info/exclude), and
# continues the PPO run if the machine kept its disk, else starts it anew from the same SFT model.
#   A: carry .whl;                 MIN=8.3 TMO=545 SAVE_STATE=1 bash bench/results/repair_rewrite_2026-11-28/device_call.sh
#   B: carry .whl .carry_state;    MIN=8.4 TMO=550 bash bench/results/repair_rewrite_2026-11-28/device_call.sh
#   as run for call B (call A's demonstrations, a harder first try: 80% of demonstrations start wrong):
#      carry .whl .carry_state;    R=/tmp/repair8 NEW_SFT=1 EXTRA="--demo-noise 0.8" MIN=8.4 TMO=550 bash ...
#   call C, the same with trloo (item 3):
#      carry .whl .carry_state;    EST=trloo R=/tmp/repair8 NEW_SFT=1 EXTRA="--demo-noise 0.8" MIN=7.8 TMO=510 bash ...
set -o pipefail
R=${R:-/tmp/repair}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error CUDA_AGENT_EAGER_FAILURES=1 PYTHONUNBUFFERED=1
mkdir -p "$R"
if [ ! -f "$R/sft/config.json" ] && ls .carry_state/state.tgz.part-* >/dev/null 2>&1; then
  cat .carry_state/state.tgz.part-* | tar xzf - -C "$R" && echo "state restored: $(ls "$R")"
fi
if [ -n "${NEW_SFT:-}" ]; then  # reuse the carried demonstrations only: a new mix (EXTRA) needs its own SFT
  rm -rf "$R/sft" "$R/diagnostic_sft.json" "$R/ppo-${EST:-grpo}" && echo "new SFT: $EXTRA"
fi
echo "ppo steps on disk already: $(ls "$R/ppo-${EST:-grpo}/rollouts" 2>/dev/null | wc -l)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${TMO:-545}" python3 bench/ppo_repair.py --out "$R" --minutes "${MIN:-8.3}" --estimators "${EST:-grpo}" ${EXTRA:-} 2>&1 \
  | grep -v "Loading weights\|Writing model shards" | tee "$OUT/repair.log"
echo "rc=$?" | tee -a "$OUT/repair.log"
python3 bench/judge_share.py "$R/ppo-${EST:-grpo}" 2>&1 | tee "$OUT/judge_share.jsonl"
(cd "$R" && tar czf "$OUT/run.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pth' \
  --exclude='./tiny' --exclude='./tasks' --exclude='./sft' --exclude='checkpoints' --exclude='final' \
  --exclude='logs' --exclude='*.log' .)
if [ -n "${SAVE_STATE:-}" ]; then
  (cd "$R" && tar czf - sft demos diagnostic_sft.json) | split -b 15m - "$OUT/state.tgz.part-"
fi
ls -la "$OUT"; du -sh "$R"/*
