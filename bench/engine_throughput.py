"""Rollout engine throughput: generated tokens per second and (engine-only) episodes per minute.

    python bench/engine_throughput.py --backend transformers --out engine_tf.json
    python bench/engine_throughput.py --backend vllm --out engine_vllm.json

Builds a ~0.5B-parameter Qwen3 model with random weights (28 layers, hidden 1024, MLP 4096, a
tokenizer trained here) unless --model is given, serves it over real HTTP on loopback, and runs
--concurrency clients at once through the OpenAI chat API with return_token_ids and logprobs, as
the harness does. Each episode is --turns requests whose history grows by the completion and a
tool result of --tool-chars characters; no sandbox, so this measures the engine alone. Random
weights rarely emit the end-of-turn token, so most responses run to --max-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def episode(url: str, turns: int, max_tokens: int, tool_chars: int, seed: int, stats: dict[str, Any],
            lock: threading.Lock) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You write fast CUDA kernels."},
                                      {"role": "user", "content": "Make this model fast: a matmul, then a ReLU."}]
    for t in range(turns):
        t0 = time.perf_counter()
        out = post(f"{url}/chat/completions", {"model": "m", "messages": messages, "max_tokens": max_tokens,
                                               "temperature": 1.0, "seed": seed * 1000 + t, "logprobs": True,
                                               "return_token_ids": True})
        dt = time.perf_counter() - t0
        n = len(out["choices"][0]["token_ids"])
        with lock:
            stats["tokens"] += n
            stats["requests"] += 1
            stats["latency_s"].append(dt)
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
        messages.append({"role": "user", "content": "x" * tool_chars})
    with lock:
        stats["episodes"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--model", help="model folder (default: build the 0.5B random-weight config)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tool-chars", type=int, default=2000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from training.engine.server import serve_in_thread
    from training.models import count_parameters, make_tiny_model

    model = a.model
    if model is None:
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "half-b", layers=28, hidden=1024, heads=16,
                                    kv_heads=8, intermediate=4096, vocab=32768))
    if a.backend == "transformers":
        from training.engine.hf import TransformersBackend

        be: Any = TransformersBackend(model, dtype=a.dtype)
        params = count_parameters(be.model)
    else:
        from training.engine.vllm_backend import VLLMBackend

        be = VLLMBackend(model, dtype=a.dtype)
        params = None
    stats: dict[str, Any] = {"tokens": 0, "requests": 0, "episodes": 0, "latency_s": []}
    lock = threading.Lock()
    with serve_in_thread(be) as url:
        post(f"{url}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "warm up"}],
                                         "max_tokens": 8})
        t0 = time.perf_counter()
        pending = list(range(a.episodes))
        threads = []

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    i = pending.pop()
                episode(url, a.turns, a.max_tokens, a.tool_chars, i, stats, lock)

        for _ in range(a.concurrency):
            th = threading.Thread(target=worker)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    import torch

    lat = sorted(stats["latency_s"])
    result = {"backend": a.backend, "model": model, "parameters": params,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "episodes": stats["episodes"], "turns": a.turns, "concurrency": a.concurrency,
              "max_tokens": a.max_tokens, "wall_s": round(wall, 2), "generated_tokens": stats["tokens"],
              "tokens_per_s": round(stats["tokens"] / wall, 1), "episodes_per_min": round(60 * stats["episodes"] / wall, 2),
              "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_max_s": round(lat[-1], 3)}
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
