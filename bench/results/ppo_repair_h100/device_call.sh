# The device command of issue 36's H100 run (ppo_repair_h100), as it ran: from bench/results/.carry/ (git-ignored, carried
# with .whl/). Call 1: bash .../call1.sh. paper_stages: STAGES=warmup,rollouts,rft,critic EXTRA="--warmup-steps 3" bash
# .../stages.sh, then EXTRA="--warmup-steps 3" MIN=8.5 TMO=565 bash .../stages.sh. Kept as the record of what ran.
# device call 1: ppo_repair, grpo then trloo from one SFT model (issue 36 items 1-3, 5)
set -o pipefail
PY=${PY:-python3}; R=${R:-/tmp/repair}
if [ -z "$NOPIP" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error CUDA_AGENT_EAGER_FAILURES=1 PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 || echo no-gpu) | tee $OUT/gpu.txt
timeout ${TMO:-555} $PY bench/ppo_repair.py --out $R --minutes ${MIN:-8.3} --estimators grpo,trloo $EXTRA 2>&1 | tee $OUT/repair.log
echo "rc=$?" | tee -a $OUT/repair.log
$PY bench/judge_share.py $R/ppo-grpo $R/ppo-trloo 2>&1 | tee $OUT/judge_share.jsonl
cp $R/summary.json $R/ppo_repair.png $R/diagnostic_sft.json $OUT/ 2>/dev/null
cd $R && tar czf $OUT/repair.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pth' \
  --exclude='./tiny' --exclude='./tasks' --exclude='checkpoints' --exclude='final' --exclude='rollouts' . 
tar czf $OUT/rollouts.tgz ppo-*/rollouts; ls -la $OUT; du -sh $R
