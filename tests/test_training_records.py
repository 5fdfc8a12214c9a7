"""Training records and RFT selection on episodes built in the test, with a tiny model made here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the train extra is not installed")

from harness.export import rl_rows, sft_rows  # noqa: E402
from training.records import masked_spans, tokenize_conversation, tokenize_row, training_rows  # noqa: E402
from training.rft_select import SelectConfig, select  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "training"))
from episodes import call, episode, good  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from training.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, hidden=64, vocab=1024)


@pytest.fixture(scope="module")
def tok(tiny):
    from training.models import load_tokenizer

    return load_tokenizer(str(tiny))


def test_loss_mask_is_exactly_the_assistant_turns(tok):
    rec = good()
    row = sft_rows([rec])[0]
    out = tokenize_row(tok, row)
    spans = [tok.decode(s) for s in masked_spans(out["input_ids"], out["loss_mask"])]
    expected = []
    for m in row["messages"]:
        if m["role"] != "assistant":
            continue
        text = m["content"] or ""
        for c in m.get("tool_calls") or []:
            text += ('<tool_call>\n{"name": "' + c["function"]["name"] + '", "arguments": '
                     + json.dumps(c["function"]["arguments"]) + "}\n</tool_call>")
        expected.append(text + "<|im_end|>")
    assert spans == expected
    # nothing else is masked in: tool results, prompts and the assistant header stay out
    masked_text = "".join(spans)
    assert "Make task_a fast" not in masked_text and "<tool_response>" not in masked_text
    assert "<|im_start|>" not in masked_text
    # and the whole rendering is the same text the template makes
    full = tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    assert tok.decode(out["input_ids"]) == full


def test_tokenize_refuses_a_template_without_generation_marks(tok):
    from training.records import MaskError

    plain = tok.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = plain
    with pytest.raises(MaskError):
        tokenize_conversation(tok2, sft_rows([good()])[0]["messages"], None)


def test_training_rows_carry_the_contract():
    rec = good()
    row = training_rows([rec])[0]
    assert row["task_id"] == "task_a" and row["milestone"] == "faster_than_eager" and row["reward"] == 2.0
    assert row["ended"] == "model_stopped" and row["tools"] == rec.tools
    assert row["policy_versions"] == [t.policy_version for t in rec.turns] == [0, 1, 0, 1, None]
    assert [t["message_index"] for t in row["turns"]] == [t.message_index for t in rec.turns]
    assert all(row["messages"][t["message_index"]]["role"] == "assistant" for t in row["turns"])
    # arguments are objects for chat templates; the harness-only is_error key is gone
    assert row["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"path": "model.py"}
    assert all("is_error" not in m for m in row["messages"])


def test_rl_rows_carry_policy_versions():
    rec = good()
    for i, t in enumerate(rec.turns):
        t.prompt_token_ids = list(range(10 + 3 * i)) if i == 0 else None
    rec.turns = rec.turns[:1]
    rec.turns[0].completion_token_ids = [1, 2, 3]
    rows = rl_rows([rec])
    assert rows[0]["policy_versions"] == [0]


def names(sel):
    return sorted(r.episode_id for r in sel.kept)


def test_each_filter_drops_what_it_names_and_keeps_the_rest():
    ok = good(sample=0)
    cases = {
        "outcome": episode([(None, [call("compile")])], milestone="correct", episode_id="slow"),
        "invalid_tool_call": [
            episode([(None, [call("make_it_fast")])], episode_id="unknown"),
            episode([(None, [call("read_file", {"offset": -1})])], episode_id="schema"),
            episode([(None, [call("write_file", raw='{"path": "k.cu", "content": "#incl')])], episode_id="unparse"),
            episode([(None, [call("verify", {"trials": 2}, ok=False, error_kind="invalid_arguments")])],
                    episode_id="harness_flagged")],
        "identical_consecutive_calls": episode(
            [(None, [call("read_file", {"path": "a"})]), (None, [call("read_file", {"path": "a"})]),
             (None, [call("read_file", {"path": "a"})])], episode_id="loop"),
        "compile_fail_loop": episode(
            [(None, [call("compile", ok=False)]), (None, [call("read_file", {"path": "a"})]),
             (None, [call("compile", ok=False)]), (None, [call("read_file", {"path": "b"})]),
             (None, [call("compile", ok=False)])], episode_id="cfail"),
        "truncated": [episode([(None, [call("compile")])], ended="truncated", episode_id="trunc"),
                      episode([("long text", []), (None, [call("compile")])], finish_reasons=["length", "tool_calls"],
                              episode_id="cut")],
    }
    # near misses each rule must keep: two identical calls, failing compiles with a write in between
    keep = [ok,
            episode([(None, [call("read_file", {"path": "a"})]), (None, [call("read_file", {"path": "a"})])],
                    episode_id="twice", sample=1),
            episode([(None, [call("compile", ok=False)]), (None, [call("write_file", {"path": "k", "content": "1"})]),
                     (None, [call("compile", ok=False)]), (None, [call("write_file", {"path": "k", "content": "2"})]),
                     (None, [call("compile", ok=False)]), (None, [call("compile")])], episode_id="fixes", sample=2)]
    dropped = [r for v in cases.values() for r in (v if isinstance(v, list) else [v])]
    sel = select(keep + dropped, SelectConfig(max_per_task=None))
    assert names(sel) == sorted(r.episode_id for r in keep)
    assert sel.dropped == {"outcome": 1, "invalid_tool_call": 4, "identical_consecutive_calls": 1,
                           "compile_fail_loop": 1, "truncated": 2}
    assert sel.summary()["total"] == len(keep) + len(dropped)
    # each rule can be turned off, and then keeps what it dropped
    loose = SelectConfig(min_milestone="correct", drop_invalid_tool_calls=False, max_identical_consecutive_calls=0,
                         max_failed_compiles_without_change=0, drop_truncated=False, dedupe=False, max_per_task=None)
    assert len(select(keep + dropped, loose).kept) == len(keep + dropped)


def test_dedupe_and_per_task_cap():
    same = [good(sample=i) for i in range(3)]  # identical conversations
    other = [good(task="task_b", sample=i, kernel=f"// v{i}") for i in range(5)]
    sel = select(same + other, SelectConfig(max_per_task=2))
    assert sel.dropped == {"duplicate": 2, "per_task_cap": 3}
    assert sorted(r.task.id for r in sel.kept) == ["task_a", "task_b", "task_b"]


def test_select_rejects_an_unknown_milestone():
    with pytest.raises(ValueError):
        select([good()], SelectConfig(min_milestone="fastest"))


def test_the_harness_records_the_engines_policy_version():
    from harness.openai_client import parse_response
    from harness.policy import EpisodeContext

    ctx = EpisodeContext(task=None, sample=0, backend="cpu", workspace_id=None)  # type: ignore[arg-type]
    data = {"id": "x", "policy_version": 7, "choices": [{"message": {"role": "assistant", "content": "hi"},
                                                         "finish_reason": "stop"}]}
    assert parse_response(data, 0.1, ctx).policy_version == 7
    del data["policy_version"]  # other servers: unknown, not zero
    assert parse_response(data, 0.1, ctx).policy_version is None
