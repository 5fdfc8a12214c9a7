# The device command of issue 36's H100 run (paper_stages_h100), as it ran: from bench/results/.carry/ (git-ignored, carried
# with .whl/). Call 1: bash .../call1.sh. paper_stages: STAGES=warmup,rollouts,rft,critic EXTRA="--warmup-steps 3" bash
# .../stages.sh, then EXTRA="--warmup-steps 3" MIN=8.5 TMO=565 bash .../stages.sh. Kept as the record of what ran.
# device calls 2 and 3: bench/paper_stages.py (issue 36 item 4); STAGES limits the stages of this call
set -o pipefail
PY=${PY:-python3}; S=${S:-/tmp/stages}; C=${C:-bench/results/.carry}
if [ -z "$NOPIP" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error CUDA_AGENT_EAGER_FAILURES=1 PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 || echo no-gpu) | tee $OUT/stages.log
if [ ! -f $S/stages.json ] && ls $C/stages-state.tgz.* >/dev/null 2>&1; then
  mkdir -p $S && cat $C/stages-state.tgz.* | tar xzf - -C $S && echo "restored $S from $C" | tee -a $OUT/stages.log; fi
# the family's demonstrations are the scripted expert's episodes of call 1 (bench/ppo_repair.py, same tasks)
if [ ! -f $S/demos/summary.json ] && [ -f $C/demos/summary.json ]; then mkdir -p $S && cp -r $C/demos $S/ && echo "demos from $C/demos" | tee -a $OUT/stages.log; fi
timeout ${TMO:-555} $PY bench/paper_stages.py --out $S --minutes ${MIN:-8.3} ${STAGES:+--stages $STAGES} $EXTRA 2>&1 | tee -a $OUT/stages.log
echo "rc=$?" | tee -a $OUT/stages.log
for r in 5-ppo 5-ppo-fresh-critic; do [ -d $S/$r ] && $PY bench/judge_share.py $S/$r 2>&1 | tee -a $OUT/stages.log; done
cp $S/summary.json $S/paper_stages.png $OUT/ 2>/dev/null
cd $S && tar czf $OUT/stages-results.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pth' \
  --exclude='./tiny' --exclude='./tasks' --exclude='checkpoints' .
# for the next call: everything but weights, and the weights of the finals the remaining stages read
w=(3-rft/final 4-critic/final-critic); [ -f 3-rft/final/config.json ] || w+=(1-warmup/final)
[ -f 1-warmup/final/config.json ] || w+=(sft)
{ find . -type f ! -name '*.safetensors' ! -name '*.pt' ! -name '*.bin' ! -path '*/checkpoints/*' ! -path './tiny/*'
  for d in "${w[@]}"; do [ -d $d ] && find $d -maxdepth 1 -name '*.safetensors'; done; } > /tmp/state.list
tar czf - -T /tmp/state.list | split -b 15m - $OUT/stages-state.tgz.
ls -la $OUT; du -sh $S
