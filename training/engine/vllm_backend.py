"""The vLLM backend (extra `vllm`; vllm 0.26.0 pins torch 2.11.0): vLLM's in-process `LLM` engine.

Requests from the HTTP server's threads are gathered by one batching thread and handed to
`LLM.generate` together (one SamplingParams each), so concurrent episodes share vLLM's
continuous batching. Logprobs are vLLM's default `raw_logprobs` mode: the model's own
distribution before temperature and top-p, the same quantity the transformers backend reports.

Weight sync: `load_weights` reads a checkpoint's safetensors and calls each worker's
`model_runner.model.load_weights` through `LLM.collective_rpc` (a function sent to the workers,
which vLLM only accepts with VLLM_ALLOW_INSECURE_SERIALIZATION=1, set here), then resets the
prefix cache so no cached KV from the old weights is reused. `sleep`/`wake_up` free and restore
GPU memory for a learner colocated on the same GPU (needs enable_sleep_mode).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from training.engine.chat import Generation, RequestError, Sampling


def _load_on_worker(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker process."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    count = 0
    model = worker.model_runner.model
    for f in files:
        state = load_file(str(f))
        model.load_weights(weights=iter(state.items()))
        count += len(state)
    return count


class VLLMBackend:
    def __init__(self, model: str, *, dtype: str = "auto", name: str | None = None, max_context: int | None = None,
                 gpu_memory_utilization: float = 0.85, enable_sleep_mode: bool = False, batch_wait_s: float = 0.005,
                 seed: int = 0):
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        self.llm = LLM(model=model, dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype),
                       max_model_len=max_context, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=enable_sleep_mode, seed=seed, enable_prefix_caching=True)
        self.tokenizer = self.llm.get_tokenizer()
        self.model_name = name or Path(model).name
        self.version = 0
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.batch_wait_s = batch_wait_s
        self.lock = threading.Lock()  # generate batches and weight loads never overlap
        self.pending: queue.Queue[tuple[list[int], Sampling, Future]] = queue.Queue()
        threading.Thread(target=self._batcher, daemon=True).start()

    def _params(self, s: Sampling) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k or -1, seed=s.seed, logprobs=0,
                              stop_token_ids=[self.tokenizer.eos_token_id], skip_special_tokens=False)

    def _batcher(self) -> None:
        import time

        from vllm.inputs import TokensPrompt

        while True:
            batch = [self.pending.get()]
            time.sleep(self.batch_wait_s)  # let requests arriving together go together
            while not self.pending.empty():
                batch.append(self.pending.get_nowait())
            try:
                with self.lock:
                    outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p, _, _ in batch],
                                             [self._params(s) for _, s, _ in batch], use_tqdm=False)
                for (_, _, fut), out in zip(batch, outs, strict=True):
                    c = out.outputs[0]
                    ids = list(c.token_ids)
                    lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=False)]
                    fut.set_result(Generation(token_ids=ids, logprobs=lps,
                                              finish_reason="length" if c.finish_reason == "length" else "stop"))
            except Exception as e:  # fail the batch's requests, keep serving
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        fut: Future = Future()
        self.pending.put((prompt_ids, sampling, fut))
        return fut.result()

    def load_weights(self, path: str, version: int | None = None) -> int:
        if not Path(path).exists():
            raise RequestError(f"no such checkpoint: {path}")
        with self.lock:
            self.llm.collective_rpc(_load_on_worker, args=(str(Path(path).resolve()),))
            self.llm.reset_prefix_cache()
            self.version = version if version is not None else self.version + 1
            return self.version

    def sleep(self, level: int = 1) -> None:
        with self.lock:
            self.llm.sleep(level=level)

    def wake_up(self) -> None:
        with self.lock:
            self.llm.wake_up()
