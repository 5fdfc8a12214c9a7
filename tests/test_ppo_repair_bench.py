"""bench/ppo_repair.py's pieces that need no model and no sandbox: the scripted expert's decisions from the tool
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

from bench.ppo_learns import OPS  # noqa: E402
from bench.ppo_repair import DONE, RepairExpert, demo_sequences, make_family, plans  # noqa: E402
from harness.policy import EpisodeContext  # noqa: E402

FAILED = "verify FAILED [value_mismatch] (0.5 s): input set 1 of 6: out: 130132 of 262144 elements differ"


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("fam"), 3, 64, "cpu", "cpu")


def _turn(expert, fam, name: str, sample: int, history: list[dict]) -> dict:
    ctx = EpisodeContext(task=fam.tasks[name], sample=sample, backend="cpu", workspace_id="ws")
    return anyio.run(expert.complete, ctx, history, [], None).message


def test_the_expert_repairs_from_the_verify_it_read_or_stops(fam):
    plan = plans(fam)
    name = fam.names[0]
    confuser = fam.confusers[name][0]
    assert plan[name] == [(name, True), *((c, True) for c in fam.confusers[name]),
                          *((c, False) for c in fam.confusers[name])]
    expert = RepairExpert(plan, {t.id: n for n, t in fam.tasks.items()})
    first = _turn(expert, fam, name, 1, [])
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]]
    assert [n for n, _ in calls] == ["write_file", "write_file", "compile", "verify"]
    assert f"= {OPS[confuser][1]};" in calls[1][1]["content"]
    failed = [first, {"role": "tool", "content": FAILED}]
    repair = _turn(expert, fam, name, 1, failed)["tool_calls"][0]["function"]
    assert repair["name"] == "edit_file" and json.loads(repair["arguments"]) == {
        "path": "kernels/op.cpp", "old_text": f"= {OPS[confuser][1]};", "new_text": f"= {OPS[name][1]};"}
    # a passing verify ends the episode; so does a failed one in a give-up plan
    assert _turn(expert, fam, name, 1, [first, {"role": "tool", "content": "verify OK (cpu)"}])["content"] == DONE
    give_up = 1 + len(fam.confusers[name])
    assert _turn(expert, fam, name, give_up, failed) == {"role": "assistant", "content": DONE}


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

    from bench.ppo_repair import vary_numbers

    rec = episode([(None, [call("verify", result=FAILED)]), ("Editing 2 lines.", [call("compile")])],
                  final="Done.")
    copies = [vary_numbers(rec, random.Random(s)) for s in range(3)]
    tool_texts = {c.messages[3]["content"] for c in copies}
    assert len(tool_texts) == 3 and FAILED not in tool_texts  # other numbers each time
    for c in copies:
        text = c.messages[3]["content"]
        assert [len(x) for x in re.findall(r"\d+", text)] == [len(x) for x in re.findall(r"\d+", FAILED)]
        assert text.split("(")[0] == FAILED.split("(")[0]  # the words stay
        # what the model wrote is untouched, digits included
        assert [m for m in c.messages if m["role"] == "assistant"] == [m for m in rec.messages if m["role"] == "assistant"]
    assert rec.messages[3]["content"] == FAILED  # the record itself is not changed
