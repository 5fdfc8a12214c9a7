"""How far one PPO update moves a policy's decisions, offline, at several actor learning rates.

Takes a model and episodes it sampled itself (a PPO run's `rollouts/step-000001`, whose engine served that
model), makes one learner step per learning rate from the same start, and measures on the same tokens:

- decision tokens: those the model sampled with probability under --decision-p (the first turn's expression,
  repairing or giving up after a failed verify); the mean change of their logprob where the episode's
  advantage was positive and where it was negative, which is what PPO is for;
- the rest: the mean absolute change of their logprob (what the update does to text it should leave alone);
- the token-mean KL to the old policy, as `train ppo` logs it (actor/approx_kl_old).

    python -m bench.proofs.update_size --model OUT/3-rft/final --episodes OUT/5-ppo/rollouts/step-000001 \\
        --lrs 3e-5,1e-4,3e-4 --out update_size.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measure(model: str, samples: list, lr: float, args: argparse.Namespace) -> dict:
    import torch

    from training.models import load_tokenizer
    from training.ppo.config import PPOConfig
    from training.ppo.learner import PPOLearner
    from training.ppo.samples import collate

    torch.manual_seed(0)
    cfg = PPOConfig(model=model, device=args.device, actor_lr=lr, gamma=1.0, lam=1.0, ppo_epochs=args.ppo_epochs,
                    minibatches=args.minibatches, micro_batch_size=args.micro_batch, whiten_advantages=False,
                    advantage_estimator=args.estimator)
    learner = PPOLearner(cfg, pad_id=load_tokenizer(model).pad_token_id)
    items = learner.prepare(samples)
    t0 = time.perf_counter()
    stats = learner.train_step(items, 1)
    learn_s = time.perf_counter() - t0
    learner.actor.eval()
    up, down, rest, n_dec, n_rest = [], [], [], 0, 0
    with torch.no_grad():
        for i in range(0, len(items), args.micro_batch):
            chunk = items[i: i + args.micro_batch]
            new = learner.actor_forward(learner.actor, learner._to(collate(chunk, learner.pad_id)))[0].cpu()
            for j, it in enumerate(chunk):
                n = it["mask"].numel()
                m = it["mask"] > 0
                old, d = it["old_logp"][m], (new[j, :n] - it["old_logp"])[m]
                adv = float(it["advantages"][m].mean()) if m.any() else 0.0
                dec = old < math.log(args.decision_p)
                n_dec, n_rest = n_dec + int(dec.sum()), n_rest + int((~dec).sum())
                if adv > 0:
                    up += d[dec].tolist()
                elif adv < 0:
                    down += d[dec].tolist()
                rest += d[~dec].abs().tolist()
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"lr": lr, "decision_tokens": n_dec, "other_tokens": n_rest,
            "decision_dlogp_positive_advantage": mean(up), "decision_dlogp_negative_advantage": mean(down),
            "other_abs_dlogp": mean(rest), "approx_kl_old": stats.get("actor/approx_kl_old"),
            "clip_frac": stats.get("actor/clip_frac"), "learn_s": learn_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--episodes", type=Path, required=True, help="a run folder whose episodes the model sampled")
    ap.add_argument("--lrs", default="3e-5,1e-4,3e-4")
    ap.add_argument("--estimator", default="grpo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ppo-epochs", type=int, default=2)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--decision-p", type=float, default=0.9,
                    help="a token sampled with a probability under this is a decision")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from training.ppo.critic import load_samples

    samples = load_samples([args.episodes])
    rows = [measure(args.model, samples, float(lr), args) for lr in args.lrs.split(",")]
    for r in rows:
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "episodes": str(args.episodes), "samples": len(samples),
                                        "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
