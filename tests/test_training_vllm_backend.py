"""The vLLM backend's own logic on the CPU: routing by request id, weight sync only after a drain, and the
version each response reports.

vLLM cannot run here (a CUDA wheel, ~700 MB), so this test stands a small stand-in for the parts of
vllm 0.26.0's API the backend calls (LLM.enqueue, llm_engine.step, collective_rpc("reload_weights"),
reset_prefix_cache; SamplingParams; vllm.inputs.TokensPrompt), shaped as in its source. The stand-in
generates one token per step for every request in flight, a token that says which weights made it,
and refuses a weight reload while a request is in flight, as a real reload mid-request would mix
weights. The real engine runs in bench.vllm_smoke and tests/test_training_gpu.py on the device.
"""

from __future__ import annotations

import sys
import threading
import time
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")


@dataclass
class _Logprob:
    logprob: float


class _Engine:
    def __init__(self, llm: FakeLLM):
        self.llm = llm
        self.model_config = types.SimpleNamespace(max_model_len=4096)

    def has_unfinished_requests(self) -> bool:
        return bool(self.llm.running)

    def step(self) -> list[Any]:
        time.sleep(0.002)  # a forward pass
        with self.llm.lock:
            self.llm.steps.append(len(self.llm.running))
            done = []
            for rid, req in list(self.llm.running.items()):
                req["tokens"].append(100 + self.llm.weights)
                if len(req["tokens"]) >= req["params"].max_tokens:
                    del self.llm.running[rid]
                    toks = req["tokens"]
                    out = types.SimpleNamespace(token_ids=toks, logprobs=[{t: _Logprob(-0.5)} for t in toks],
                                                finish_reason="length")
                    # vLLM 0.26 reports the external id; enqueue returned the internal one (id + "-" + 8 chars)
                    done.append(types.SimpleNamespace(request_id=rid.rsplit("-", 1)[0], finished=True,
                                                      outputs=[out]))
            return done


class FakeLLM:
    def __init__(self, model: str, **kwargs: Any):
        self.kwargs = kwargs
        self.lock = threading.Lock()
        self.running: dict[str, dict[str, Any]] = {}
        self.counter = 0
        self.weights = 0
        self.steps: list[int] = []
        self.reloads: list[dict[str, Any]] = []
        self.llm_engine = _Engine(self)

    def enqueue(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool = True) -> list[str]:
        with self.lock:
            ids = []
            for p, sp in zip(prompts, params, strict=True):
                # as vLLM's InputProcessor.assign_request_id: the internal id gets a random suffix
                rid = f"{self.counter}-{uuid.uuid4().hex[:8]}"
                self.counter += 1
                self.running[rid] = {"prompt": p["prompt_token_ids"], "params": sp, "tokens": []}
                ids.append(rid)
            return ids

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        assert method == "reload_weights"
        if self.running:
            raise RuntimeError("reload with requests in flight")
        self.reloads.append(dict(kwargs or {}, files=sorted(p.name for p in Path(kwargs["weights_path"]).iterdir())))
        self.weights += 1
        return [None]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return not self.running


class SamplingParams:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


@pytest.fixture
def backend(monkeypatch, tmp_path):
    from training.models import make_tiny_model

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    from training.engine.vllm_backend import VLLMBackend

    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, vocab=512)
    return VLLMBackend(str(model), dtype="bf16", attention_backend="TRITON_ATTN", enforce_eager=True)


def test_requests_are_batched_and_weights_wait_for_a_drain(backend, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from training.engine.chat import RequestError, Sampling

    llm = backend.llm
    assert llm.kwargs["attention_config"] == {"backend": "TRITON_ATTN"} and llm.kwargs["dtype"] == "bfloat16"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(backend.generate, [1, 2, 3], Sampling(max_tokens=200)) for _ in range(4)]
        while not llm.running:
            time.sleep(0.001)
        sync = pool.submit(backend.load_weights, str(ckpt))  # queued behind 200 steps of the first four
        time.sleep(0.05)
        assert not sync.done()
        later = [pool.submit(backend.generate, [4, 5], Sampling(max_tokens=5)) for _ in range(4)]
        gens = [f.result(timeout=60) for f in first + later]
    assert sync.result() == 1
    assert max(llm.steps) > 1  # requests shared engine steps
    for g in gens:  # each answer came from one version of the weights, and says which
        assert set(g.token_ids) == {100 + g.policy_version}
        assert g.logprobs == [-0.5] * len(g.token_ids)
    assert [g.policy_version for g in gens[:4]] == [0] * 4 and [g.policy_version for g in gens[4:]] == [1] * 4
    assert llm.reloads == [{"weights_path": str(ckpt.resolve()), "is_checkpoint_format": True,
                            "files": ["model.safetensors"]}]
    # one .safetensors file is shown to vLLM's folder loader as a folder; anything else is refused
    assert backend.load_weights(str(ckpt / "model.safetensors"), version=7) == 7
    assert llm.reloads[-1]["files"] == ["model.safetensors"]
    with pytest.raises(RequestError):
        backend.load_weights(str(tmp_path / "missing"))
    (tmp_path / "w.pt").write_bytes(b"")
    with pytest.raises(RequestError):
        backend.load_weights(str(tmp_path / "w.pt"))
