"""The vLLM backend (extra `vllm`; vllm 0.26.0 pins torch 2.11.0): vLLM's in-process `LLM` engine.

One engine thread owns the `LLM`. Request handlers queue their prompts; the thread adds each to
vLLM's engine as it arrives (`LLM.enqueue`, token-id prompts) and steps the engine
(`llm_engine.step()`), handing every finished output back to its request by id, so concurrent
episodes share vLLM's continuous batching and a request never waits for another's batch to end.
Logprobs are vLLM's default `logprobs_mode="raw_logprobs"` with `logprobs=0` (the sampled token's
logprob only): the model's own distribution before temperature and top-p, the quantity the
transformers backend reports. Prompts are rendered by the model's own Hugging Face tokenizer and
chat template (the same code as the transformers backend), and completions are parsed by the
shared Hermes/Qwen tool-call parser (the format vLLM's `hermes` parser reads).

Weight sync: when nothing is in flight, the thread calls the workers' own
`reload_weights(weights_path=...)` through `LLM.collective_rpc` (a method name, so no pickled
function crosses to the workers), which streams the folder's safetensors through the model's
`load_weights`, then resets the prefix cache so no KV computed by the old weights is reused.
Requests arriving meanwhile wait for the new weights; each response reports the version that
generated it. `sleep`/`wake_up` free and restore GPU memory for a learner on the same GPU (needs
enable_sleep_mode), also only between requests.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.engine.chat import Generation, RequestError, Sampling
from training.models import load_tokenizer

log = logging.getLogger(__name__)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class _Job:
    prompt: list[int]
    sampling: Sampling
    future: Future = field(default_factory=Future)


@dataclass
class _Call:
    """Work on the engine that must not overlap a request (weights, sleep, wake)."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


def _external_id(internal: str) -> str:
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


class VLLMBackend:
    def __init__(self, model: str, *, dtype: str = "auto", name: str | None = None, max_context: int | None = None,
                 gpu_memory_utilization: float = 0.85, enable_sleep_mode: bool = False, enforce_eager: bool = False,
                 attention_backend: str | None = None, seed: int = 0, **engine_args: Any):
        """attention_backend: e.g. TRITON_ATTN or FLASH_ATTN (default: vLLM's choice for the GPU).
        engine_args: any other vllm.EngineArgs field."""
        # FlashInfer's top-k/top-p sampler JIT-compiles its kernels at engine start (~140 s on an H100,
        # measured) and needs flashinfer installed; rollouts sample at temperature 1 without top-k/top-p,
        # where vLLM's own sampler is as fast. Set VLLM_USE_FLASHINFER_SAMPLER=1 to opt back in.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        if attention_backend:
            engine_args["attention_config"] = {"backend": attention_backend}
        self.llm = LLM(model=model, dtype=DTYPES.get(dtype, dtype), max_model_len=max_context,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                       enforce_eager=enforce_eager, seed=seed, enable_prefix_caching=True, **engine_args)
        self.tokenizer = load_tokenizer(model)
        self.model_name = name or Path(model).name
        self.version = 0
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.stop_ids = sorted(i for i in {self.tokenizer.eos_token_id} if i is not None)
        self.batch_sizes: list[int] = []  # requests in flight at each engine step (what vLLM batched)
        self._inbox: queue.Queue[_Job | _Call] = queue.Queue()
        self._inflight: dict[str, _Job] = {}
        threading.Thread(target=self._loop, name="vllm-engine", daemon=True).start()

    def _params(self, s: Sampling) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
                              seed=s.seed, logprobs=0, stop_token_ids=self.stop_ids, detokenize=False)

    # ------------------------------------------------------------------ the request side (any thread)

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        job = _Job(list(prompt_ids), sampling)
        self._inbox.put(job)
        return job.future.result()

    def _call(self, fn: Callable[[], Any]) -> Any:
        call = _Call(fn)
        self._inbox.put(call)
        return call.future.result()

    def load_weights(self, path: str, version: int | None = None) -> int:
        """A checkpoint folder of *.safetensors (save_pretrained) or one .safetensors file."""
        p = Path(path)
        if not p.exists():
            raise RequestError(f"no such checkpoint: {path}")
        if p.is_file() and p.suffix != ".safetensors":
            raise RequestError("the vllm backend loads *.safetensors (a folder or one file)")
        if p.is_dir() and not any(p.glob("*.safetensors")):
            raise RequestError(f"no *.safetensors in {path}")

        def reload() -> int:
            with tempfile.TemporaryDirectory() as tmp:
                folder = p.resolve()
                if p.is_file():  # vLLM's loader reads folders: show it this one file in one
                    (Path(tmp) / "model.safetensors").symlink_to(folder)
                    folder = Path(tmp)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder),
                                                                  "is_checkpoint_format": True})
            if not self.llm.reset_prefix_cache():
                log.warning("vLLM did not reset its prefix cache after the weight update")
            self.version = version if version is not None else self.version + 1
            return self.version

        return self._call(reload)

    def sleep(self, level: int = 1) -> None:
        self._call(lambda: self.llm.sleep(level=level))

    def wake_up(self) -> None:
        self._call(self.llm.wake_up)

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        waiting: list[_Job | _Call] = []
        while True:
            try:
                idle = not waiting and not self._inflight
                waiting.append(self._inbox.get(block=idle))
                while True:
                    waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            try:
                waiting = self._admit(waiting)
                if self._inflight:
                    self._step()
            except Exception as e:  # fail what was in flight, keep serving
                log.exception("vLLM engine step failed")
                for j in [*self._inflight.values(), *waiting]:
                    if not j.future.done():
                        j.future.set_exception(e)
                self._inflight.clear()
                waiting = []

    def _admit(self, waiting: list[_Job | _Call]) -> list[_Job | _Call]:
        """Adds requests to the engine in arrival order, up to the first call, which waits for a drain."""
        from vllm.inputs import TokensPrompt

        for i, job in enumerate(waiting):
            if isinstance(job, _Call):
                if self._inflight:
                    return waiting[i:]
                try:
                    job.future.set_result(job.fn())
                except Exception as e:
                    job.future.set_exception(e)
                continue
            try:
                (rid,) = self.llm.enqueue([TokensPrompt(prompt_token_ids=job.prompt)], [self._params(job.sampling)],
                                          use_tqdm=False)
            except Exception as e:  # e.g. vLLM's own validation of the request
                job.future.set_exception(RequestError(str(e)))
                continue
            # enqueue returns the engine's internal id (the external one plus "-" and 8 random characters,
            # vLLM 0.26's assign_request_id); the outputs of step() carry the external id
            self._inflight[_external_id(rid)] = job
        return []

    def _step(self) -> None:
        self.batch_sizes.append(len(self._inflight))
        del self.batch_sizes[:-10000]
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            job = self._inflight.pop(out.request_id, None)
            if job is None:
                continue
            c = out.outputs[0]
            if c.finish_reason == "abort":
                job.future.set_exception(RuntimeError("vLLM aborted the request"))
                continue
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True)]
            finish = "length" if c.finish_reason == "length" else "stop"
            job.future.set_result(Generation(token_ids=ids, logprobs=lps, finish_reason=finish,
                                             policy_version=self.version))
        if self._inflight and not self.llm.llm_engine.has_unfinished_requests():
            # an output we could not route would otherwise leave its caller waiting forever
            lost = RuntimeError("vLLM finished a request whose output did not reach its caller")
            for job in self._inflight.values():
                job.future.set_exception(lost)
            self._inflight.clear()
