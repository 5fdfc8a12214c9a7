"""bench.proofs.repair's supervised stage: the demonstrations as training sequences, the fine-tuning, and the
offline diagnostic of what the fine-tuned model does on its first turn and after a failed verify.

Why the tool results' numbers are drawn afresh on every draw (issue 36, item 1). A demonstration that repairs
and one that gives up read the same conversation up to the numbers in their tool results (build seconds,
element counts, expected and actual values): the plan that picks repair or give-up is not in the context, so
the decision after a failed verify is label noise at the `--give-up` rate. With a fixed set of copies, each
seen ~160 times in 800 SFT steps, a tiny model drives its loss to the floor by keying each copy's decision on
that copy's numbers instead of on `verify OK` / `verify FAILED`; on numbers it has not seen (every episode of
its own) the memorized keys are gone and it answers as most turns after a verify did in training ("Done.", 10
of 13 turns after a verify at the default mix), which is what the H100 diagnostic measured: 75% gave up,
0% repaired. Drawing new numbers for every sequence the SFT draws leaves the verify's verdict as the only
feature that predicts the next turn, so the model learns P(repair | failed verify) = 1 - give_up and
P(answer | passed verify) = 1."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"\d+")

# a demonstration sequence, or a maker that draws one with new numbers in its tool results from the rng it gets
Sequence = tuple[list[int], list[int]]
Draw = Callable[[random.Random], Sequence]


def vary_numbers(rec: Any, rng: random.Random) -> Any:
    """A copy of the episode whose tool results carry other numbers: build seconds, element counts, errors and
    expected/actual values differ from one real episode to the next. Each number's digit count is drawn too
    (1 to 3 digits for a number of one or two, up to one more than it had for a longer one): the demonstrations'
    digit counts are not a feature the model may key on. They were kept until the H100 run of issue 36, and
    there the first build time's told the plans apart: the repair demonstrations ran first on a cold build
    cache (`compile OK (cuda, 30.5 s)`), half the give-up ones last on a warm one (`0.8 s`), so a one-digit
    build time meant giving up, and every live episode builds warm. The assistant turns are left as they are."""
    out = rec.model_copy(deep=True)

    def other(m: re.Match) -> str:
        width = rng.randint(1, max(3, len(m.group()) + 1))
        return str(rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width))

    for m in out.messages:
        if m["role"] == "tool" and isinstance(m.get("content"), str):
            m["content"] = NUMBER.sub(other, m["content"])
    return out


def demo_weights(records: list[Any], fam: Any, per_task: int, noise: float, give_up: float) -> list[tuple[Any, int]]:
    """(episode, copies) so that round(per_task * noise) of each task's demonstrations start wrong (spread over
    its confusers), and of those a share `give_up` answers after the failed verify without repairing."""
    from bench.proofs.repair_family import plans

    def spread(total: int, j: int, k: int) -> int:
        return total // k + (j < total % k)

    name_of = {t.id: n for n, t in fam.tasks.items()}
    out = []
    for rec in records:
        name = name_of[rec.task.id]
        wrong = round(per_task * noise)
        gave_up = round(wrong * give_up)
        k = len(fam.confusers[name])
        _, repairs = plans(fam)[name][rec.sample]
        if rec.sample == 0:
            weight = per_task - wrong
        elif repairs:
            weight = spread(wrong - gave_up, rec.sample - 1, k)
        else:
            weight = spread(gave_up, rec.sample - 1 - k, k)
        out.append((rec, weight))
    return out


def encode(tok: Any, rec: Any) -> Sequence:
    from harness.export import sft_rows
    from training.records import tokenize_row

    enc = tokenize_row(tok, sft_rows([rec])[0])
    return enc["input_ids"], enc["loss_mask"]


def demo_sequences(records: list[Any], tok: Any, fam: Any, per_task: int, noise: float, give_up: float,
                   seed: int = 0, fresh: bool = False) -> list[Sequence | Draw]:
    """One item per demonstration copy (demo_weights). fresh=False: (input_ids, loss_mask), the first copy with
    the episode's own numbers and every other with numbers of its own, fixed once; fresh=True: a Draw that
    tokenizes the episode with new numbers each time fit_sequences draws it (see the module's docstring)."""
    rng = random.Random(seed)
    out: list[Sequence | Draw] = []
    for rec, weight in demo_weights(records, fam, per_task, noise, give_up):
        for copy in range(weight):
            if fresh:
                out.append(lambda r, rec=rec: encode(tok, vary_numbers(rec, r)))
            else:
                out.append(encode(tok, vary_numbers(rec, rng) if copy else rec))
    return out


def longest(seqs: list[Sequence | Draw]) -> int:
    rng = random.Random(0)
    return max(len((s(rng) if callable(s) else s)[0]) for s in seqs)


def fit_sequences(model_dir: Path, out: Path, seqs: list[Sequence | Draw], steps: int, lr: float, device: str,
                  batch: int) -> Path:
    """Supervised fine-tuning on (input_ids, loss_mask) pairs (a Draw is drawn anew each time it is picked):
    loss on the masked-in tokens only, AdamW with a linear decay to zero (as bench.proofs.family.supervised)."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.models import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(1, steps))
    rng, numbers = random.Random(0), random.Random(1)
    losses = []
    for step in range(steps):
        chosen = [s(numbers) if callable(s) else s for s in rng.sample(seqs, min(batch, len(seqs)))]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((len(chosen), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        attn = torch.zeros((len(chosen), width), dtype=torch.long)
        for j, (seq, mask) in enumerate(chosen):
            t = torch.tensor(seq)
            ids[j, : len(seq)] = t
            labels[j, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, torch.tensor(-100))
            attn[j, : len(seq)] = 1
        opt.zero_grad()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == steps - 1:
            print(f"sft step {step}: loss {losses[-1]:.4f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "sft_losses.json").write_text(json.dumps(losses))
    return out


def turn_ids(tok: Any, rec: Any, index: int) -> Sequence:
    """(prompt, completion) token ids of a demonstration's turn `index`, as the engine would see them."""
    from harness.export import sft_rows
    from training.records import tokenize_conversation

    row = sft_rows([rec])[0]
    at = rec.turns[index].message_index
    p = list(tok.apply_chat_template(row["messages"][:at], tools=row["tools"], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"])
    full = tokenize_conversation(tok, row["messages"][: at + 1], row["tools"])
    return p, [i for i, m in zip(full["input_ids"][len(p):], full["loss_mask"][len(p):], strict=True) if m]


def kind_of_second_turn(ids: list[int], repair: list[int], give_up: list[int]) -> str:
    """repaired: the demonstrated repair (a rewrite or an edit), token for token; gave_up: the answer that ends
    the episode; anything else is malformed (a tiny model's repair is either the demonstrated one or broken)."""
    return "repaired" if ids == repair else "gave_up" if ids == give_up else "malformed"


def shares(kinds: list[str], names: tuple[str, ...], prefix: str = "") -> dict[str, float]:
    return {f"{prefix}{k}": kinds.count(k) / max(1, len(kinds)) for k in names}


def sft_diagnostic(model_dir: Path, demos: list[Any], fam: Any, per_task: int, top_p: float = 1.0,
                   seed: int = 1234) -> dict[str, Any]:
    """No judge, temperature 1 and `top_p` (what `train ppo` samples), counted token for token against the
    demonstrations. First turns, `per_task` per task: the task's own expression (right), a confuser's
    (wrong_expr: the verify will fail) or neither (malformed). Then each of the model's own wrong_expr first
    turns (token for token a demonstration's) is followed by that demonstration's tool results, numbers drawn
    anew (no demonstration had them, as none of its own episodes will), ending in the failed verify, and the
    second turn is sampled: the demonstrated repair (after_failure/repaired), the answer that gives up
    (after_failure/gave_up) or neither (after_failure/malformed), over `failed_first_turns`. The first
    turns' expression is a sample, so `after_failure` is over however many failed."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.models import load_tokenizer
    from training.ppo.generate import sample

    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(fam.device)
    name_of = {t.id: n for n, t in fam.tasks.items()}
    prompts, firsts, repair_demo = {}, {}, {}
    give_up = turn_ids(tok, demos[0], len(demos[0].turns) - 1)[1]  # "Done." and the end of the turn
    for rec in demos:
        name = name_of[rec.task.id]
        prompts[name], firsts[(name, rec.sample)] = turn_ids(tok, rec, 0)
        if len(rec.turns) == 3:  # write and fail, repair and pass, answer
            repair_demo[(name, rec.sample)] = rec
    torch.manual_seed(seed)
    rng = random.Random(seed)
    batch = 32 if fam.device != "cpu" else 4

    def draw(pairs: list[Sequence]) -> list[list[int]]:
        if not pairs:
            return []
        width = max(len(c) for _, c in pairs) + 16
        return [ids for ids, _, _ in sample(model, tok, [p for p, _ in pairs], width, 1.0, top_p, batch_size=batch)]

    names = [n for n in fam.names for _ in range(per_task)]
    kinds, failed = [], []
    for n, ids in zip(names, draw([(prompts[n], firsts[(n, 0)]) for n in names]), strict=True):
        match = [k for (t, k), c in firsts.items() if t == n and c == ids]
        kinds.append("right" if match == [0] else "wrong_expr" if match else "malformed")
        # the repair demonstration that starts with the same first turn (sample k repairs, k + confusers gives up)
        fix = next((repair_demo[(n, k)] for k in match if (n, k) in repair_demo), None)
        if kinds[-1] == "wrong_expr" and fix is not None:
            failed.append(turn_ids(tok, vary_numbers(fix, rng), 1))
    second = [kind_of_second_turn(ids, want, give_up) for (_, want), ids in zip(failed, draw(failed), strict=True)]
    return {"top_p": top_p, "first_turns": len(kinds), **shares(kinds, ("right", "wrong_expr", "malformed")),
            "failed_first_turns": len(second),
            **shares(second, ("repaired", "gave_up", "malformed"), "after_failure/")}
