"""bench.proofs.repair's pieces that need no model and no sandbox: the scripted expert's decisions from the tool
results it reads, and the weights that make the demonstrations' mix of first tries, repairs and give-ups."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import anyio
import pytest

pytest.importorskip("transformers", reason="the train extra is not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "training"))

from episodes import episode  # noqa: E402

from bench.proofs.family import OPS  # noqa: E402
from bench.proofs.repair_family import DONE, RepairExpert, make_family, plans  # noqa: E402
from bench.proofs.repair_sft import demo_sequences  # noqa: E402
from harness.policy import EpisodeContext  # noqa: E402

FAILED = "verify FAILED [value_mismatch] (0.5 s): input set 1 of 6: out: 130132 of 262144 elements differ"


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("fam"), 3, 64, "cpu", "cpu")


def _turn(expert, fam, name: str, sample: int, history: list[dict]) -> dict:
    ctx = EpisodeContext(task=fam.tasks[name], sample=sample, backend="cpu", workspace_id="ws")
    return anyio.run(expert.complete, ctx, history, [], None).message


@pytest.mark.parametrize("how", ["rewrite", "edit"])
def test_the_expert_repairs_from_the_verify_it_read_or_stops(fam, how):
    from bench.proofs.family import expert_files

    plan = plans(fam)
    name = fam.names[0]
    confuser = fam.confusers[name][0]
    assert plan[name] == [(name, True), *((c, True) for c in fam.confusers[name]),
                          *((c, False) for c in fam.confusers[name])]
    expert = RepairExpert(plan, {t.id: n for n, t in fam.tasks.items()}, how)
    first = _turn(expert, fam, name, 1, [])
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]]
    assert [n for n, _ in calls] == ["write_file", "write_file", "compile", "verify"] and first["content"] == ""
    assert f"= {OPS[confuser][1]};" in calls[1][1]["content"]
    failed = [first, {"role": "tool", "content": FAILED}]
    turn = _turn(expert, fam, name, 1, failed)
    repair = turn["tool_calls"][0]["function"]
    assert [c["function"]["name"] for c in turn["tool_calls"][1:]] == ["compile", "verify"]
    if how == "edit":  # the bare edit of the runs before the rewrite
        assert turn["content"] == "" and repair["name"] == "edit_file" and json.loads(repair["arguments"]) == {
            "path": "kernels/op.cpp", "old_text": f"= {OPS[confuser][1]};", "new_text": f"= {OPS[name][1]};"}
    else:  # says what the reference returns and what that means for the kernel, then writes the file anew
        assert turn["content"] == (f"verify failed. The reference returns {OPS[name][0]}, so the kernel must "
                                   f"compute {OPS[name][1]}.")
        assert OPS[name][0] in fam.tasks[name].path.read_text()  # the text it names is in the task it was shown
        args = json.loads(repair["arguments"])
        assert repair["name"] == "write_file" and args["path"] == "kernels/op.cpp"
        assert args["content"] == expert_files(OPS[name][1], "cpu")["kernels/op.cpp"] != calls[1][1]["content"]
    # a passing verify ends the episode; so does a failed one in a give-up plan
    assert _turn(expert, fam, name, 1, [first, {"role": "tool", "content": "verify OK (cpu)"}])["content"] == DONE
    give_up = 1 + len(fam.confusers[name])
    assert _turn(expert, fam, name, give_up, failed) == {"role": "assistant", "content": DONE}
    with pytest.raises(ValueError, match="repair by one of"):
        RepairExpert(plan, {}, "patch")


def test_demonstration_weights_follow_noise_and_give_up(fam, tmp_path):
    from training.models import load_tokenizer, make_tiny_model

    tok = load_tokenizer(str(make_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, vocab=1024)))
    name = fam.names[0]
    k = len(fam.confusers[name])
    records = []
    for sample in range(1 + 2 * k):  # tell the episodes apart by their final answer
        rec = episode([], task=fam.tasks[name].id, final=f"plan {sample}", sample=sample, milestone="correct")
        records.append(rec)
    seqs = demo_sequences(records, tok, fam, per_task=10, noise=0.6, give_up=0.5)
    counts = {}
    for ids, _ in seqs:
        text = tok.decode(ids)
        plan = next(s for s in range(1 + 2 * k) if f"plan {s}<" in text)
        counts[plan] = counts.get(plan, 0) + 1
    # 10 demonstrations: 4 start right; of the 6 that start wrong, 3 are repaired and 3 given up, spread over
    # the two confusers
    assert len(seqs) == 10 and counts[0] == 4
    assert k == 2 and [counts.get(s, 0) for s in range(1, 5)] == [2, 1, 2, 1]


def test_demonstration_copies_vary_the_numbers_of_tool_results_only():
    import random

    from episodes import call

    from bench.proofs.repair_sft import vary_numbers

    rec = episode([(None, [call("verify", result=FAILED)]), ("Editing 2 lines.", [call("compile")])],
                  final="Done.")
    copies = [vary_numbers(rec, random.Random(s)) for s in range(40)]
    tool_texts = {c.messages[3]["content"] for c in copies}
    assert len(tool_texts) == 40 and FAILED not in tool_texts  # other numbers each time
    # the digit counts vary too: the build seconds' "0" (one digit) and "130132" (six) take other widths
    widths = [[len(x) for x in re.findall(r"\d+", c.messages[3]["content"])] for c in copies]
    assert {w[0] for w in widths} == {1, 2, 3} and len({w[4] for w in widths}) > 3
    for c in copies:
        text = c.messages[3]["content"]
        assert re.sub(r"\d+", "N", text) == re.sub(r"\d+", "N", FAILED)  # the words stay
        # what the model wrote is untouched, digits included
        assert [m for m in c.messages if m["role"] == "assistant"] == [m for m in rec.messages if m["role"] == "assistant"]
    assert rec.messages[3]["content"] == FAILED  # the record itself is not changed


# ---- the SFT stage (bench.proofs.repair_sft): what a repair demonstration trains, fresh numbers, the diagnostic ------
def _repair_record(fam, name: str, sample: int, first: str, repairs: bool):
    """A demonstration as the expert writes it: write (first expression) + compile + verify; then the edit and
    `Done.` after a failed verify (repairs), or `Done.` alone."""
    from episodes import call

    from bench.proofs.family import expert_files
    from bench.proofs.repair_family import repair_reason

    files = expert_files(OPS[first][1], "cpu")
    writes = [call("write_file", {"path": p, "content": b}, result=f"wrote {p} ({len(b)} bytes)") for p, b in files.items()]
    ok = first == name
    turns = [(None, [*writes, call("compile", result="compile OK (cpu, 9.9 s)"),
                     call("verify", result="verify OK (cpu, 1.2 s)" if ok else FAILED)])]
    if not ok and repairs:
        write = {"path": "kernels/op.cpp", "content": expert_files(OPS[name][1], "cpu")["kernels/op.cpp"]}
        turns.append((repair_reason(name), [call("write_file", write, result="wrote kernels/op.cpp (624 bytes)"),
                             call("compile", result="compile OK (cpu, 0.4 s)"),
                             call("verify", result="verify OK (cpu, 0.9 s)")]))
    return episode(turns, task=fam.tasks[name].id, final=DONE, sample=sample, milestone="correct")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from training.models import load_tokenizer, make_tiny_model

    return load_tokenizer(str(make_tiny_model(tmp_path_factory.mktemp("m"), layers=1, hidden=32, heads=2, kv_heads=1,
                                              vocab=1024)))


@pytest.fixture(scope="module")
def demos(fam):
    return [_repair_record(fam, n, s, first, rep) for n in fam.names for s, (first, rep) in enumerate(plans(fam)[n])]


def test_a_repair_demonstration_trains_every_assistant_turn_and_no_tool_result(fam, tok, demos):
    from bench.proofs.repair_sft import encode
    from training.records import masked_spans

    name = fam.names[0]
    rec = next(r for r in demos if r.task.id == fam.tasks[name].id and len(r.turns) == 3)
    ids, mask = encode(tok, rec)
    spans = [tok.decode(s) for s in masked_spans(ids, mask)]
    assert len(spans) == 3  # the failed first try, the repair, the answer
    assert '"write_file"' in spans[0] and f'= {OPS[fam.confusers[name][0]][1]};' in spans[0]
    assert spans[1].startswith(f"verify failed. The reference returns {OPS[name][0]}")
    assert '<tool_call>\n{"name": "write_file"' in spans[1] and f"= {OPS[name][1]};" in spans[1]
    assert spans[2] == "Done.<|im_end|>"
    # the verify the repair reads is context, never a target
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "FAILED" not in trained and "compile OK" not in trained and FAILED.split(":")[0] in tok.decode(ids)


def test_fresh_draws_give_new_numbers_each_time_and_the_same_targets(fam, tok, demos):
    import random

    from bench.proofs.repair_sft import demo_sequences
    from training.records import masked_spans

    fixed = demo_sequences(demos, tok, fam, per_task=10, noise=0.6, give_up=0.5)
    fresh = demo_sequences(demos, tok, fam, per_task=10, noise=0.6, give_up=0.5, fresh=True)
    assert len(fixed) == len(fresh) == 10 * len(fam.names) and all(callable(d) for d in fresh)
    rng = random.Random(0)
    repair = next(i for i, (ids, m) in enumerate(fixed) if len(masked_spans(ids, m)) == 3)
    draws = [fresh[repair](rng) for _ in range(4)]
    assert len({tuple(ids) for ids, _ in draws}) == 4  # four different tool-result texts
    assert all(masked_spans(*d) == masked_spans(*fixed[repair]) for d in draws)  # the same assistant turns


def test_the_diagnostic_follows_the_models_own_failed_first_turns_and_counts_what_it_does_next(fam, tok, demos,
                                                                                            tmp_path, monkeypatch):
    """A scripted sampler in place of the model: first turns cycle right, wrong (confuser 1), wrong (confuser 2),
    broken; after a failed verify it cycles the demonstrated edit, `Done.`, and a broken edit."""
    import training.ppo.generate
    from bench.proofs.repair_sft import sft_diagnostic, turn_ids
    from training.models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, vocab=1024)
    by = {(r.task.id, r.sample): r for r in demos}
    seen: list[list[int]] = []

    def scripted(model, tokenizer, prompts, max_new_tokens, temperature=1.0, top_p=1.0, batch_size=8):
        out = []
        for i, p in enumerate(prompts):
            seen.append(p)
            name = next(n for n in fam.names if turn_ids(tok, by[(fam.tasks[n].id, 0)], 0)[0] == p) \
                if any(turn_ids(tok, by[(fam.tasks[n].id, 0)], 0)[0] == p for n in fam.names) else None
            if name is not None:  # a first turn
                k = [0, 1, 2, None][i % 4]
                ids = turn_ids(tok, by[(fam.tasks[name].id, k)], 0)[1] if k is not None else [5, 6, 7]
            else:  # a second turn: which repair demonstration's context is it?
                rec = next(r for r in demos if len(r.turns) == 3
                           and turn_ids(tok, r, 1)[0][:40] == p[:40] and turn_ids(tok, r, 0)[1] == p[len(
                               turn_ids(tok, r, 0)[0]): len(turn_ids(tok, r, 0)[0]) + len(turn_ids(tok, r, 0)[1])])
                want = turn_ids(tok, rec, 1)[1]
                ids = [want, turn_ids(tok, rec, 2)[1], want[:-3] + [9, 9, 9]][i % 3]
            out.append((ids, [0.0] * len(ids), "stop"))
        return out

    monkeypatch.setattr(training.ppo.generate, "sample", scripted)
    d = sft_diagnostic(model, demos, fam, per_task=4)
    n = len(fam.names)
    assert d["first_turns"] == 4 * n
    assert (d["right"], d["wrong_expr"], d["malformed"]) == (0.25, 0.5, 0.25)
    assert d["failed_first_turns"] == 2 * n  # only the wrong expressions are followed by a failed verify
    assert d["after_failure/repaired"] + d["after_failure/gave_up"] + d["after_failure/malformed"] == pytest.approx(1)
    assert d["after_failure/repaired"] == pytest.approx(sum(i % 3 == 0 for i in range(2 * n)) / (2 * n))
    assert d["after_failure/gave_up"] == pytest.approx(sum(i % 3 == 1 for i in range(2 * n)) / (2 * n))
    # each second turn read a failed verify with numbers of its own after the first turn the model wrote
    assert len(seen) == 6 * n and all("verify FAILED" in tok.decode(p[-120:]) for p in seen[4 * n:])


def test_the_repair_run_rewards_correctness_only_unless_asked_for_speed(fam, tmp_path):
    """Every correct episode of the family writes one kernel, so a speed milestone between two of them is timing
    noise: the repair proof's judge gives them `correct`'s reward, and --speed-rewards restores the paper's scale."""
    from bench.proofs.pipeline import CORRECTNESS_ONLY, ppo_config
    from bench.proofs.repair import parser
    from training.ppo.agentic import reward_config

    for flags, want in (([], CORRECTNESS_ONLY), (["--speed-rewards"], None)):
        args = parser().parse_args(["--out", str(tmp_path), *flags])
        assert (args.repair, args.demo_noise) == ("rewrite", 0.8)
        cfg = ppo_config(fam, tmp_path / "ppo", tmp_path / "sft", args)
        assert cfg.reward == want
        r = reward_config(cfg.reward)
        assert r.failed == -1.0 and r.correct == 1.0
        assert (r.faster_than_eager, r.faster_than_compile) == ((1.0, 1.0) if want else (2.0, 3.0))
    with pytest.raises(ValueError, match="unknown reward setting"):
        reward_config({"faster": 1.0})
