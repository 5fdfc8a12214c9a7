"""Rollout engine throughput: generated tokens per second and (engine-only) episodes per minute.

    python -m bench.engine_throughput --backend transformers --out engine_tf.json
    python -m bench.engine_throughput --backend vllm --attention-backend TRITON_ATTN --out engine_vllm.json

Builds a ~0.5B-parameter Qwen3 model with random weights (28 layers, hidden 1024, MLP 4096, a
tokenizer trained here) unless --model is given, serves it over real HTTP on loopback, and runs
--concurrency clients at once (each level in turn: 1, 8, 32 by default) through the OpenAI chat API with return_token_ids and logprobs, as
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
            lock: threading.Lock, temperature: float = 1.0) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You write fast CUDA kernels."},
                                      {"role": "user", "content": f"Episode {seed}: make this model fast: a matmul, then a ReLU."}]
    for _ in range(turns):
        t0 = time.perf_counter()
        out = post(f"{url}/chat/completions", {"model": "m", "messages": messages, "max_tokens": max_tokens,
                                               "temperature": temperature, "logprobs": True,
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


def run_level(url: str, episodes: int, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    stats: dict[str, Any] = {"tokens": 0, "requests": 0, "episodes": 0, "latency_s": []}
    lock = threading.Lock()
    pending = list(range(episodes))

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop()
            episode(url, a.turns, a.max_tokens, a.tool_chars, i, stats, lock, a.temperature)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    lat = sorted(stats["latency_s"])
    return {"concurrency": concurrency, "episodes": stats["episodes"], "requests": stats["requests"],
            "wall_s": round(wall, 2), "generated_tokens": stats["tokens"],
            "tokens_per_s": round(stats["tokens"] / wall, 1), "episodes_per_min": round(60 * stats["episodes"] / wall, 2),
            "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_max_s": round(lat[-1], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--model", help="model folder (default: build the 0.5B random-weight config)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels, each run in turn")
    ap.add_argument("--episodes", type=int, default=0, help="episodes per level (default: the concurrency, >= 4)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tool-chars", type=int, default=2000)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="1.0: the transformers backend's continuous batching; other values: batched generate")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-continuous", action="store_true", help="transformers: batched generate for everything")
    ap.add_argument("--attention-backend", default="", help="vllm: e.g. TRITON_ATTN (default: vLLM's choice)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm")
    ap.add_argument("--enforce-eager", action="store_true", help="vllm: no CUDA graphs")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    from training.engine.server import serve_in_thread
    from training.models import count_parameters, make_tiny_model

    model = a.model
    if model is None:
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "half-b", layers=28, hidden=1024, heads=16,
                                    kv_heads=8, intermediate=4096, vocab=32768))
    t = time.perf_counter()
    if a.backend == "transformers":
        from training.engine.hf import TransformersBackend

        be: Any = TransformersBackend(model, dtype=a.dtype, continuous=not a.no_continuous)
        params = count_parameters(be.model)
    else:
        from training.engine.vllm_backend import VLLMBackend

        be = VLLMBackend(model, dtype=a.dtype, gpu_memory_utilization=a.gpu_memory_utilization,
                         enforce_eager=a.enforce_eager, attention_backend=a.attention_backend or None)
        params = None
    start_s = time.perf_counter() - t
    levels = []
    with serve_in_thread(be) as url:
        post(f"{url}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "warm up"}],
                                         "max_tokens": 8, "temperature": a.temperature})
        for c in [int(x) for x in a.concurrency.split(",") if x]:
            be.batch_sizes.clear()
            level = run_level(url, a.episodes or max(4, c), c, a)
            sizes = ([n for (_, n), k in be.batch_sizes.items() for _ in range(k)] if isinstance(be.batch_sizes, dict)
                     else list(be.batch_sizes))
            level["mean_batch"] = round(sum(sizes) / len(sizes), 2) if sizes else None
            level["max_batch"] = max(sizes) if sizes else None
            print(json.dumps(level), flush=True)
            levels.append(level)
    import torch

    result = {"backend": a.backend, "model": model, "parameters": params, "start_s": round(start_s, 1),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "turns": a.turns, "max_tokens": a.max_tokens, "temperature": a.temperature, "levels": levels}
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
