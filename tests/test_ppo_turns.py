"""Multi-turn episodes in training: per-turn metrics (turns used, tool calls by kind, reward by turns, the
turn by which verify first passed), the viewer's charts of them, and the tool-output tokens of a repair
episode staying out of the learner's action mask."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the train extra is not installed")

from harness.export import rl_rows, sft_rows  # noqa: E402
from harness.viewer.data import training_charts  # noqa: E402
from training.ppo.turns import first_verified_turn, turn_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "training"))
from episodes import call, episode  # noqa: E402

FAILED = "verify FAILED [value_mismatch] (0.4 s): output 0: max abs error 2 (atol 1e-05)"


def _verify(ok: bool, turn_calls: list[dict]) -> list[dict]:
    return turn_calls + [call("verify", result="verify OK (cpu, 0.4 s): 5 trials" if ok else FAILED)]


def repair(sample: int = 0):
    """Write a wrong kernel and verify (fails), fix it with an edit and verify (passes), stop: 3 turns."""
    rec = episode([(None, _verify(False, [call("write_file", {"path": "kernels/op.cpp", "content": "y = -v;"}),
                                          call("compile")])),
                   (None, _verify(True, [call("edit_file", {"path": "kernels/op.cpp", "old_text": "-v",
                                                            "new_text": "v * v"}), call("compile")]))],
                  milestone="correct", final="Fixed.", sample=sample)
    return _structured(rec, [False, True])


def first_try(sample: int = 1, milestone: str = "correct"):
    rec = episode([(None, _verify(True, [call("write_file", {"path": "kernels/op.cpp", "content": "y = v * v;"}),
                                         call("compile")]))], milestone=milestone, final="Done.", sample=sample)
    return _structured(rec, [True])


def _structured(rec, verdicts: list[bool]):
    """The sandbox's structured verify result, as the harness records it from the tool server."""
    verifies = [c for t in rec.turns for c in t.tool_calls if c.name == "verify"]
    for c, ok in zip(verifies, verdicts, strict=True):
        c.structured = {"ok": ok, "reason": None if ok else "value_mismatch"}
    return rec


def test_turn_metrics_count_turns_tools_and_the_turn_of_the_first_passing_verify():
    recs = [repair(0), first_try(1), first_try(2, milestone="failed")]
    recs[2].turns[0].tool_calls.append(recs[2].turns[0].tool_calls[0].model_copy(update={"name": "rm_rf"}))
    assert [first_verified_turn(r) for r in recs] == [2, 1, 1]
    m = turn_metrics(recs)
    # repair: write, compile, verify | edit, compile, verify | stop; the first tries: write, compile, verify | stop
    assert m["tool_calls/write_file"] == pytest.approx(3 / 3) and m["tool_calls/verify"] == pytest.approx(4 / 3)
    assert m["tool_calls/compile"] == pytest.approx(4 / 3)
    # edit_file is not in the fixture's tool list, and neither is rm_rf: both count as unknown, never as a key
    assert m["tool_calls/unknown"] == pytest.approx(2 / 3) and "tool_calls/rm_rf" not in m
    assert m["tool_calls/per_turn"] == pytest.approx(13 / 7)  # 12 calls and rm_rf over 7 turns
    assert m["turns_used/3"] == pytest.approx(1 / 3) and m["turns_used/2"] == pytest.approx(2 / 3)
    # the judge's reward, by how many turns the episode used: 3 turns -> 1.0; 2 turns -> (1 + -1) / 2
    assert m["reward_by_turns/3"] == 1.0 and m["reward_by_turns/2"] == 0.0
    assert m["verified_by_turn/1"] == pytest.approx(2 / 3) == m["solved_first_turn"]
    assert m["verified_by_turn/2"] == 1.0 == m["verified_by_turn/3"]


def test_training_charts_put_each_family_on_one_chart_in_turn_order():
    rows = [{"step": 1.0, "reward/mean": 0.1, "verified_by_turn/10": 0.9, "verified_by_turn/2": 0.5,
             "verified_by_turn/1": 0.2, "tool_calls/verify": 1.0, "tool_calls/compile": 1.0, "pass_rate": 0.5}]
    charts = training_charts(rows)
    assert [c["title"] for c in charts] == ["reward/mean", "verified_by_turn", "tool_calls", "pass_rate"]
    assert charts[1]["series"] == ["verified_by_turn/1", "verified_by_turn/2", "verified_by_turn/10"]
    assert charts[2]["series"] == ["tool_calls/compile", "tool_calls/verify"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from training.models import load_tokenizer, make_tiny_model

    return load_tokenizer(str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=1, hidden=32, heads=2,
                                              kv_heads=1, vocab=1024)))


def engine_turns(tok, rec) -> None:
    """Gives each assistant turn the token ids an engine serving this tokenizer returns: the prompt rendered
    with the generation prompt, the completion the model's own tokens up to its end-of-turn token."""
    from training.records import tokenize_conversation

    row = sft_rows([rec])[0]
    for t in rec.turns:
        prompt = list(tok.apply_chat_template(row["messages"][: t.message_index], tools=row["tools"],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        full = tokenize_conversation(tok, row["messages"][: t.message_index + 1], row["tools"])
        assert full["input_ids"][: len(prompt)] == prompt
        t.prompt_token_ids = prompt
        t.completion_token_ids = [i for i, m in zip(full["input_ids"][len(prompt):], full["loss_mask"][len(prompt):],
                                                    strict=True) if m]
        t.completion_logprobs = [-0.5] * len(t.completion_token_ids)


def test_tool_output_tokens_of_a_repair_episode_are_masked_out_of_the_actions(tok):
    import torch

    from training.ppo.samples import collate, from_rl_row

    rec = repair()
    engine_turns(tok, rec)
    rows = rl_rows([rec])
    assert len(rows) == 1 and rows[0]["turns"] == 3  # one sequence: every prompt extends the previous one
    s = from_rl_row(rows[0])
    acted = tok.decode([i for i, m in zip(s.input_ids, s.action_mask, strict=True) if m])
    # exactly the model's three completions are actions, in order
    assert acted == tok.decode([i for t in rec.turns for i in t.completion_token_ids])
    assert "edit_file" in acted and "Fixed." in acted
    # the tool results (the failing verify the repair reads, the compile and write replies) are not
    assert FAILED not in acted and "verify OK" not in acted and "<tool_response>" not in acted
    first = len(rec.turns[0].prompt_token_ids) + len(rec.turns[0].completion_token_ids)
    between = tok.decode(s.input_ids[first: len(rec.turns[1].prompt_token_ids)])
    assert FAILED in between and not any(s.action_mask[first: len(rec.turns[1].prompt_token_ids)])
    # the behaviour logprobs sit on the actions only, and the learner's target-aligned mask is the same mask
    assert all((lp != 0) == bool(m) for lp, m in zip(s.behaviour_logprobs, s.action_mask, strict=True))
    item = {"input_ids": torch.tensor(s.input_ids), "mask": torch.tensor(s.action_mask[1:], dtype=torch.float32)}
    assert collate([item], tok.pad_token_id)["mask"][0].tolist() == [float(m) for m in s.action_mask[1:]]
