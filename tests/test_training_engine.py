"""The rollout engine with the transformers backend, over real HTTP on loopback, on a tiny model made here.

A random tiny model cannot write a tool call. For the full episode the test forces the completions
through transformers' own constrained decoding (`prefix_allowed_tokens_fn`, the engine's test-only
`force` hook): the tokens are fixed by the script, but they are generated, decoded, parsed into tool
calls, recorded with their ids and the model's logprobs and served by the same code as any completion.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("trl", reason="the train extra is not installed")
pytest.importorskip("openai", reason="the harness extra is not installed")

from harness.config import AgentConfig, JudgeConfig, ModelConfig, RolloutConfig, SamplingConfig  # noqa: E402
from harness.export import rl_rows  # noqa: E402
from harness.rollout import run_rollout  # noqa: E402
from harness.trajectory import iter_records  # noqa: E402
from training.engine.chat import parse_tool_calls  # noqa: E402
from training.engine.hf import TransformersBackend  # noqa: E402
from training.engine.server import serve_in_thread  # noqa: E402
from training.records import training_rows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SOLUTION = REPO / "tasks" / "examples" / "solutions" / "swish_bias" / "cpu"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A model this small gains nothing from intra-op threads, and when the sandbox's compilers (or other
    tests) hold the cores, two threads spin against each other: 200 tokens take 15 s instead of 1.4 s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from training.models import make_tiny_model

    # a 4096-token vocabulary writes the episode's prompts and kernels in ~30% fewer tokens than 1024
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2, hidden=64, vocab=4096)


@dataclass
class Reply:
    status_code: int
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.text)


def http(url: str, body: Any = None, raw: bytes | None = None) -> Reply:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return Reply(r.status, r.read().decode(), {k.lower(): v for k, v in r.headers.items()})
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode(), {})


def chat(url: str, body: dict[str, Any]) -> Reply:
    return http(f"{url}/chat/completions", {"model": "m", **body})


def forward_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_logprobs_match_a_forward_pass_and_weight_sync_changes_output(tiny, tmp_path):
    import torch

    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32")
    body = {"messages": [{"role": "system", "content": "You write kernels."},
                         {"role": "user", "content": "Write a fused swish + bias kernel."}],
            "max_tokens": 24, "temperature": 0, "logprobs": True, "return_token_ids": True}
    with serve_in_thread(backend) as url:
        r = chat(url, body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        ids = choice["token_ids"]
        lps = [t["logprob"] for t in choice["logprobs"]["content"]]
        assert len(ids) == len(lps) == out["usage"]["completion_tokens"] > 0
        ref = forward_logprobs(backend.model, out["prompt_token_ids"], ids)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 1e-3
        assert out["policy_version"] == 0 and r.headers["x-policy-version"] == "0"
        # the prompt is the chat template's rendering
        assert out["prompt_token_ids"] == backend.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

        # sampling uses the library's sampler; a seed makes it repeatable; logprobs stay the model's own
        sampled = [chat(url, {**body, "temperature": 1.0, "seed": 7}).json()["choices"][0] for _ in range(2)]
        assert sampled[0]["token_ids"] == sampled[1]["token_ids"]
        s_ref = forward_logprobs(backend.model, out["prompt_token_ids"], sampled[0]["token_ids"])
        assert max(abs(t["logprob"] - b) for t, b in zip(sampled[0]["logprobs"]["content"], s_ref, strict=True)) < 1e-3

        # new weights: another random initialization, wide enough that greedy decoding changes
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_pretrained(str(tiny))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in other.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen))
        other.save_pretrained(tmp_path / "ckpt")
        w = http(f"{url}/weights", {"path": str(tmp_path / "ckpt")})
        assert w.status_code == 200 and w.json() == {"policy_version": 1}
        after = chat(url, body).json()
        assert after["policy_version"] == 1 and http(f"{url}/version").json() == {"policy_version": 1}
        assert after["choices"][0]["token_ids"] != ids
        new_ref = forward_logprobs(other, after["prompt_token_ids"], after["choices"][0]["token_ids"])
        got = [t["logprob"] for t in after["choices"][0]["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(got, new_ref, strict=True)) < 1e-3
        # an explicit version is kept
        w = http(f"{url}/weights", {"path": str(tmp_path / "ckpt"), "version": 41})
        assert w.json() == {"policy_version": 41}

        # bad requests get a structured 400 and the server keeps serving
        assert http(f"{url}/weights", {"path": str(tmp_path / "nope")}).status_code == 400
        bad = http(f"{url}/chat/completions", raw=b"{not json")
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
        assert chat(url, {"messages": []}).status_code == 400
        assert chat(url, {**body, "max_tokens": 0}).status_code == 400
        hist = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "compile", "arguments": "{oops"}}]}]
        assert chat(url, {**body, "messages": hist}).status_code == 400
        assert http(f"{url}/models").json()["data"][0]["id"] == backend.model_name
        assert chat(url, body).status_code == 200


def test_tool_calls_are_parsed_as_written():
    content, calls = parse_tool_calls('Plan.<tool_call>\n{"name": "write_file", "arguments": {"path": "a", '
                                      '"content": "x}"}}\n</tool_call><tool_call>\n{"name": "compile", '
                                      '"arguments": {}}\n</tool_call>')
    assert content == "Plan."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("write_file", '{"path": "a", "content": "x}"}'), ("compile", "{}")]
    # broken JSON is still a call, with the raw arguments, so the harness charges it as malformed
    _, calls = parse_tool_calls('<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "#incl')
    assert calls[0]["function"]["name"] == "write_file"
    assert calls[0]["function"]["arguments"].startswith('{"path": "a"')
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def args(**kw: Any) -> str:
    return json.dumps(kw)


SCRIPT = [("Reading the reference first.", [("read_file", {"path": "model.py"})]),
          ("Writing the kernel and ModelNew.", [
              ("write_file", {"path": "kernels/swish_bias.cpp", "content": (SOLUTION / "kernels" /
                                                                            "swish_bias.cpp").read_text()}),
              ("write_file", {"path": "model_new.py", "content": (SOLUTION / "model_new.py").read_text()})]),
          (None, [("compile", {})]),
          (None, [("verify", {"trials": 2})]),
          ("Done.", [])]


def scripted_force(tok: Any) -> Any:
    """The completion for the turn the prompt is at, as token ids (the test-only force hook)."""
    def force(prompt_ids: list[int]) -> list[int]:
        turn = tok.decode(prompt_ids).count("<|im_start|>assistant") - 1
        content, calls = SCRIPT[min(turn, len(SCRIPT) - 1)]
        text = (content or "") + "".join(
            '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(a) + "}\n</tool_call>"
            for name, a in calls)
        return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return force


SHORT_SYSTEM = "You write fast kernels in your workspace with the tools given, verify them, then stop."


@pytest.mark.full  # builds the CPU extension and judges it with torch.compile; the judge's verdicts: test_verify.py, test_profile_reward.py
@pytest.mark.slow  # builds the CPU extension and judges it (compile, verify, profile with torch.compile)
def test_engine_serves_a_whole_harness_episode_on_the_cpu_sandbox(tiny, tmp_path, small_task_path):
    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32")
    backend.force = scripted_force(backend.tokenizer)
    out = tmp_path / "run"
    with serve_in_thread(backend) as url:
        cfg = RolloutConfig(
            tasks=[str(small_task_path)], out=out, concurrency=1, progress=False,
            model=ModelConfig(model="m", base_url=[url], api_key="none", return_token_ids=True, max_retries=0),
            sampling=SamplingConfig(temperature=0.0, max_tokens=4096, logprobs=True),
            # the manual (SKILL.md) is ~7k tokens to a tiny vocabulary, and every forced token attends to it
            agent=AgentConfig(backend="cpu", max_turns=8, system_prompt=SHORT_SYSTEM),
            judge=JudgeConfig(verify_trials=2))
        summary = anyio.run(run_rollout, cfg)
    assert summary.ran == 1
    rec = list(iter_records(out / "episodes.jsonl"))[0]
    print("turns (model_s, tools_s, prompt, completion):", [(round(t.model_s, 1), round(t.tools_s, 1),
          len(t.prompt_token_ids or []), len(t.completion_token_ids or [])) for t in rec.turns],
          "judge_s", rec.judgment.duration_s if rec.judgment else None, "total_s", rec.duration_s)
    assert rec.ended == "model_stopped", rec.end_detail
    assert SHORT_SYSTEM in backend.tokenizer.decode(rec.turns[0].prompt_token_ids)
    assert [[c.name for c in t.tool_calls] for t in rec.turns] == [
        ["read_file"], ["write_file", "write_file"], ["compile"], ["verify"], []]
    assert all(not c.is_error for t in rec.turns for c in t.tool_calls), [
        (c.name, c.result_text[:300]) for t in rec.turns for c in t.tool_calls if c.is_error]
    assert rec.turns[2].tool_calls[0].structured["ok"] and rec.turns[3].tool_calls[0].structured["ok"]
    assert rec.judgment.reward.correct
    for t in rec.turns:
        assert t.prompt_token_ids and t.completion_token_ids
        assert len(t.completion_logprobs) == len(t.completion_token_ids)
        assert t.completion_token_ids[-1] == backend.tokenizer.eos_token_id
        assert t.policy_version == 0
    # the recorded logprobs are the model's: check one turn against a forward pass
    t = rec.turns[2]
    ref = forward_logprobs(backend.model, t.prompt_token_ids, t.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(t.completion_logprobs, ref, strict=True)) < 1e-3
    # the history re-renders token for token, so the episode is one RL row with tool results masked out
    rows = rl_rows([rec])
    assert len(rows) == 1 and rows[0]["turns"] == 5 and rows[0]["policy_versions"] == [0] * 5
    assert sum(rows[0]["response_mask"]) == sum(len(t.completion_token_ids) for t in rec.turns)
    assert training_rows([rec])[0]["turns"][0]["completion_logprobs"] == rec.turns[0].completion_logprobs


def _concurrently(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: chat(url, b), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


def _prompts(n: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"Kernel {i}: fuse {'a matmul and ' * (i % 3)}a ReLU."}],
             "logprobs": True, "return_token_ids": True} for i in range(n)]


def _check_logprobs(model: Any, out: dict[str, Any]) -> None:
    choice = out["choices"][0]
    ref = forward_logprobs(model, out["prompt_token_ids"], choice["token_ids"])
    got = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert len(got) == len(choice["token_ids"]) > 0
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3


def test_concurrent_requests_are_batched_and_answer_as_alone(tiny):
    from transformers import AutoModelForCausalLM

    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32")
    ref = AutoModelForCausalLM.from_pretrained(str(tiny))  # the engine's own model is busy (and may be paged)
    greedy = [{**b, "temperature": 0, "max_tokens": 12} for b in _prompts(6)]
    with serve_in_thread(backend) as url:
        alone = [chat(url, b).json() for b in greedy]  # one at a time: batches of one
        assert set(backend.batch_sizes) == {("generate", 1)}
        together = _concurrently(url, greedy)
        # greedy requests go through batched generate (left-padded); each answer is the one it gets alone
        assert max(n for kind, n in backend.batch_sizes if kind == "generate") > 1, backend.batch_sizes
        assert [o["choices"][0]["token_ids"] for o in together] == [o["choices"][0]["token_ids"] for o in alone]
        for o in together:
            _check_logprobs(ref, o)

        # sampling from the model's own distribution goes through continuous batching, logprobs still the model's
        sampled = _concurrently(url, [{**b, "temperature": 1.0, "max_tokens": 16} for b in _prompts(6)])
        assert max(n for kind, n in backend.batch_sizes if kind == "continuous") > 1, backend.batch_sizes
        for o in sampled:
            _check_logprobs(ref, o)
            assert o["choices"][0]["finish_reason"] in ("stop", "length")
            assert len(o["choices"][0]["token_ids"]) <= 16
        # a colocated learner frees the KV cache between rollouts; the next request builds it again
        backend.release()
        assert backend._manager is None
        _check_logprobs(ref, chat(url, {**_prompts(1)[0], "temperature": 1.0, "max_tokens": 8}).json())


def test_weight_sync_under_load_reports_the_version_that_generated_each_answer(tiny, tmp_path):
    import threading
    import time

    import torch
    from transformers import AutoModelForCausalLM

    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32")
    old = AutoModelForCausalLM.from_pretrained(str(tiny))
    new = AutoModelForCausalLM.from_pretrained(str(tiny))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in new.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen))
    new.save_pretrained(tmp_path / "new")
    bodies = [{**b, "temperature": 1.0, "max_tokens": 100} for b in _prompts(8)]
    with serve_in_thread(backend) as url:
        results: list[dict[str, Any]] = []
        first = threading.Thread(target=lambda: results.extend(_concurrently(url, bodies[:4])))
        first.start()
        while not backend._inflight:  # the first wave is being generated by version 0
            time.sleep(0.001)
        w = http(f"{url}/weights", {"path": str(tmp_path / "new")})
        results.extend(_concurrently(url, bodies[4:]))
        first.join()
    assert w.json() == {"policy_version": 1}
    versions = sorted(o["policy_version"] for o in results)
    assert versions == [0] * 4 + [1] * 4
    for o in results:  # each answer's logprobs are those of the weights it says made it
        _check_logprobs(old if o["policy_version"] == 0 else new, o)


def test_the_engines_passes_wait_for_a_judge_timing_on_the_same_device(tiny, tmp_path, monkeypatch):
    """A timing holds the device's lock exclusively (sandbox/timing/device_lock.py); the served model's forward
    passes hold it shared, so none runs while a timing on its device does, and generation goes on once the
    timing ends. Only the device the engine runs on is waited for."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from sandbox.timing.device_lock import LOCK_DIR_ENV, timing_hold
    from training.engine.chat import Sampling

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32", continuous=False)
    sampling = Sampling(max_tokens=8, temperature=0.0)
    t0 = time.perf_counter()
    backend.generate([1, 2, 3, 4], sampling)  # unheld: how long one generation takes here
    alone = time.perf_counter() - t0
    passes = backend.turns.passes
    assert passes >= 1 and backend.turns.waited_s < alone

    with ThreadPoolExecutor(1) as pool:
        with timing_hold("cuda:0"):  # another device's timing: nothing waits for it
            assert len(pool.submit(backend.generate, [1, 2, 3, 4], sampling).result(timeout=60).token_ids) > 0
        passes = backend.turns.passes
        with timing_hold("cpu"):
            pending = pool.submit(backend.generate, [5, 6, 7, 8], sampling)
            time.sleep(3 * alone + 0.5)
            assert not pending.done() and backend.turns.passes == passes  # no pass while the timing holds
        out = pending.result(timeout=60)
    assert len(out.token_ids) > 0 and backend.turns.passes > passes
    assert backend.turns.waited_s >= 3 * alone  # the pass that waited counts its wait


def test_an_engine_without_judge_turns_takes_no_lock(tiny, tmp_path, monkeypatch):
    from sandbox.timing.device_lock import LOCK_DIR_ENV, timing_hold
    from training.engine.chat import Sampling

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    backend = TransformersBackend(str(tiny), device="cpu", dtype="fp32", continuous=False, judge_turns=False)
    assert backend.turns is None
    with timing_hold("cpu"):
        assert len(backend.generate([1, 2, 3, 4], Sampling(max_tokens=4, temperature=0.0)).token_ids) > 0
