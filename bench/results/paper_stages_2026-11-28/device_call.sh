# Issue 36 item 4 on one GPU (the calls as run; docs/training.md says what each did): bench/paper_stages.py with 12 rollout episodes per task (48, 12 held out
# for the critic's explained variance), the engine taking turns with the judge's timings.
#   call 1: carry .whl;                 STAGES=warmup,rollouts,rft MIN=7.9 TMO=560 bash THIS
#   call 2: carry .whl .carry_state;    MIN=8.4 TMO=555 bash THIS   (the state of call 1, its $OUT/state.tgz.* parts
#                                        copied into .carry_state/, which .git/info/exclude keeps out of git)
#   call 3: the same as call 4 below, but carrying only .whl on a fresh machine: no state, it failed (call3/).
#   call 4: carry .whl .carry_state (call 2's parts); the first PPO run again from the RFT actor and the pretrained
#           critic, two steps (call 2 left it one, its checkpoint not sent back):
#           S=/tmp/stages3 RERUN=5-ppo STAGES=ppo EXTRA="--steps 2" MIN=4.5 TMO=305 bash THIS
# .whl: ../shared/tools/device-wheels -e . "mcp>=2.3" "anyio>=4" openai "jsonschema>=4" matplotlib trl datasets
#       (call 1 ran without trl and datasets)
set -o pipefail
S=${S:-/tmp/stages}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error CUDA_AGENT_EAGER_FAILURES=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/stages.log
if [ ! -f $S/stages.json ] && ls .carry_state/state.tgz.* >/dev/null 2>&1; then
  mkdir -p $S && cat .carry_state/state.tgz.* | tar xzf - -C $S && echo "restored $S: $(ls $S)" | tee -a $OUT/stages.log; fi
[ -n "$RERUN" ] && rm -rf $S/$RERUN && echo "removed $S/$RERUN" | tee -a $OUT/stages.log
timeout ${TMO:-560} python3 bench/paper_stages.py --out $S --minutes ${MIN:-7.9} --warmup-steps 3 --rollout-samples 12 \
  ${STAGES:+--stages $STAGES} $EXTRA 2>&1 | grep --line-buffered -v "Loading weights\|Writing model shards" | tee -a $OUT/stages.log
echo "rc=$?" | tee -a $OUT/stages.log
for r in 1-warmup 5-ppo 5-ppo-fresh-critic; do [ -d $S/$r ] && python3 bench/judge_share.py $S/$r 2>&1 | tee -a $OUT/stages.log; done
cp $S/summary.json $S/paper_stages.png $OUT/ 2>/dev/null
cd $S && tar czf $OUT/stages-results.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pth' \
  --exclude='./tiny' --exclude='./tasks' --exclude='checkpoints' .
# for the next call: everything but weights, and the weights of the finals the remaining stages read
w=(3-rft/final 4-critic/final-critic); [ -f 3-rft/final/config.json ] || w+=(1-warmup/final)
[ -f 1-warmup/final/config.json ] || w+=(sft)
{ find . -type f ! -name '*.safetensors' ! -name '*.pt' ! -name '*.bin' ! -path '*/checkpoints/*' ! -path './tiny/*'
  for d in "${w[@]}"; do [ -d $d ] && find $d -maxdepth 1 -name '*.safetensors'; done; } > /tmp/state.list
tar czf - -T /tmp/state.list | split -b 15m - $OUT/state.tgz.
ls -la $OUT; du -sh $S/*
