"""Honest kernels at KernelBench's published sizes, judged alone and several at a time (issue 65, Judge VIII).

KernelBench's level-1 activations hold 6.4 GB an input (4096 x 393216 float32). Each gets an honest float4 CUDA
kernel written here (the kind a new user writes: a grid-stride loop, one expression per element); they are then
judged three ways, each from fresh baselines unless `--cache` is kept between runs:

  alone   one judgment at a time through sandbox.api.evaluate: verdict, reward, seconds and the phases of each
  eval    `cuda-agent eval --solutions ... -k K -n N`: what a user scoring a solution set reads
  mcp     N MCP clients over streamable HTTP, each opening a task and calling compile, verify, profile

Every honest kernel should score (a correct verdict, reward >= 1); any failure is printed with its reason and
message. Raw results go to OUT as JSON lines; a summary line per mode is printed.

    python -m bench.large_load --kb ../shared/kernelbench --out /tmp/ll --modes alone,eval --n 8 --k 2
    python -m bench.large_load --kb ../shared/kernelbench --out /tmp/ll --modes mcp --n 8 --k 2

`--backend cpu --solutions DIR --tasks NAME` judges DIR/NAME/ (files of a CPU solution) on --kb/level1/NAME.py
instead: a smoke test of a mode on a machine without a GPU (bench/large_load_mcp.py holds the mcp mode).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from bench.large_load_mcp import run_mcp

# task file stem -> (the CUDA expression of one float `v`, the name of its function)
ACTIVATIONS: dict[str, str] = {
    "19_ReLU": "fmaxf(v, 0.f)",
    "20_LeakyReLU": "v > 0.f ? v : 0.01f * v",
    "21_Sigmoid": "1.f / (1.f + expf(-v))",
    "22_Tanh": "tanhf(v)",
    "25_Swish": "v / (1.f + expf(-v))",
    "28_HardSigmoid": "fminf(fmaxf(v / 6.f + 0.5f, 0.f), 1.f)",
    "29_Softplus": "v > 20.f ? v : log1pf(expf(v))",
    "30_Softsign": "v / (1.f + fabsf(v))",
}

KERNEL = """#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

__device__ __forceinline__ float act(float v) {{ return {expr}; }}

__global__ void act4(const float4* __restrict__ x, float4* __restrict__ y, int64_t n4) {{
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {{
    float4 v = x[i];
    v.x = act(v.x); v.y = act(v.y); v.z = act(v.z); v.w = act(v.w);
    y[i] = v;
  }}
}}

__global__ void act1(const float* __restrict__ x, float* __restrict__ y, int64_t start, int64_t n) {{
  int64_t i = start + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = act(x[i]);
}}

void launch_act(const float* x, float* y, int64_t n, cudaStream_t s) {{
  const int t = 256;
  int64_t n4 = n / 4;
  if (n4) {{
    int blocks = (int)std::min<int64_t>((n4 + t - 1) / t, 132 * 32);
    act4<<<blocks, t, 0, s>>>(reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), n4);
  }}
  if (n % 4) act1<<<1, 4, 0, s>>>(x, y, n4 * 4, n);
}}
"""

BINDING = """#include "binding_registry.h"

#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

void launch_act(const float* x, float* y, int64_t n, cudaStream_t s);

static at::Tensor act_forward(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "act_forward: expected a contiguous float32 CUDA tensor");
  at::Tensor y = at::empty_like(x);
  launch_act(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), c10::cuda::getCurrentCUDAStream());
  return y;
}

static void register_act(pybind11::module& m) { m.def("act_forward", &act_forward, "activation (CUDA)"); }

REGISTER_BINDING(act, register_act);
"""

MODEL_NEW = """import cuda_extension
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return cuda_extension.act_forward(x.contiguous())
"""


def write_solutions(root: Path, names: list[str]) -> None:
    for name in names:
        d = root / name
        (d / "kernels").mkdir(parents=True, exist_ok=True)
        (d / "kernels" / "act.cu").write_text(KERNEL.format(expr=ACTIVATIONS[name]))
        (d / "kernels" / "act_binding.cpp").write_text(BINDING)
        (d / "model_new.py").write_text(MODEL_NEW)


def _row(out: Path, mode: str, row: dict) -> None:
    with open(out / f"{mode}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


class RequestTrace:
    """Every request the judge's process sends a worker, with the worker's role, the op and its seconds, appended to
    OUT/requests.jsonl: where a judgment's time goes inside its phases (the phases alone left 3.9 s of a 4.3 s
    timing at these sizes unexplained, H200, 2026-12-02). Wraps Worker.send/recv and the judge clock's request."""

    def __init__(self, out: Path):
        from sandbox.confinement import worker_process
        from sandbox.timing import judge_clock

        self.task, self.rows, self._lock = "", [], threading.Lock()
        self._file = open(out / "requests.jsonl", "a")  # noqa: SIM115  (open for the bench's life)
        pending: dict[int, list] = defaultdict(list)
        send, recv, clocked = worker_process.Worker.send, worker_process.Worker.recv, judge_clock.Clock.request
        trace = self

        def t_send(w, op, **args):
            pending[id(w)].append((op, time.perf_counter(), args.get("calls")))
            return send(w, op, **args)

        def t_recv(w, timeout, what, until_ready=False):
            msg = recv(w, timeout, what, until_ready)
            if not until_ready and pending[id(w)]:
                op, t0, calls = pending[id(w)].pop(0)
                trace.log(w.role, op, time.perf_counter() - t0, calls, False)
            return msg

        def t_clocked(clock, w, op, timeout, what, **args):
            t0 = time.perf_counter()
            try:
                return clocked(clock, w, op, timeout, what, **args)
            finally:
                trace.log(w.role, op, time.perf_counter() - t0, args.get("calls"), True)

        worker_process.Worker.send, worker_process.Worker.recv, judge_clock.Clock.request = t_send, t_recv, t_clocked

    def log(self, role: str, op: str, seconds: float, calls, clocked: bool) -> None:
        row = {"task": self.task, "role": role, "op": op, "s": round(seconds, 4), "calls": calls, "clocked": clocked}
        with self._lock:
            self.rows.append(row)
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def summary(self, task: str) -> str:
        """The task's requests by (role, op): count and seconds, the largest first."""
        agg: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
        for r in self.rows:
            if r["task"] == task:
                a = agg[(r["role"], r["op"])]
                a[0] += 1
                a[1] += r["s"]
        top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:12]
        return "; ".join(f"{role}.{op} x{n} {s:.2f}s" for (role, op), (n, s) in top)


def run_alone(kb: Path, out: Path, names: list[str], trace: RequestTrace | None = None, backend: str = "cuda") -> None:
    from sandbox import api
    from sandbox.workspace import Workspace  # noqa: F401  (the type api returns)

    scored = 0
    t_all = time.perf_counter()
    for name in names:
        ws_dir = out / "ws" / name
        shutil.rmtree(ws_dir, ignore_errors=True)
        t0 = time.perf_counter()
        if trace:
            trace.task = name
        ws, _ = api.init_workspace(str(kb / "level1" / f"{name}.py"), ws_dir, backend=backend, check=False)
        for src in (out / "solutions" / name).rglob("*"):
            if src.is_file():
                rel = src.relative_to(out / "solutions" / name)
                (ws.root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, ws.root / rel)
        try:
            c, v, p, r = api.evaluate(ws)
        except Exception as e:  # a judge that raises is a finding, not a crash of the bench
            _row(out, "alone", {"task": name, "error": repr(e)[:2000], "wall_s": time.perf_counter() - t0})
            print(f"alone {name}: judge raised {e!r}"[:400], flush=True)
            continue
        wall = time.perf_counter() - t0
        row = {"task": name, "wall_s": round(wall, 2), "compile_ok": c.ok, "compile_s": getattr(c, "seconds", None),
               "verify_ok": bool(v and v.ok), "verify_reason": v and v.reason, "verify_phases": v and v.phases,
               "verify_message": (v.message or "")[:600] if v and not v.ok else None,
               "profile_ok": bool(p and p.ok), "profile_reason": p and p.reason,
               "profile_phases": p and p.phases, "queued_s": p and p.queued_s,
               "speedup_eager": p and p.speedup_vs_eager, "speedup_compile": p and p.speedup_vs_compile,
               "profile_message": (p.message or "")[:600] if p and not p.ok else None,
               "reward": r.reward, "milestone": r.milestone}
        scored += bool(v and v.ok and r.reward >= 1)
        _row(out, "alone", row)
        print(f"alone {name}: reward {r.reward} {r.milestone} in {wall:.1f} s; verify {row['verify_reason']} "
              f"{row['verify_phases']}; profile {row['profile_reason']} {row['profile_phases']}", flush=True)
        if trace:
            print(f"  requests {name}: {trace.summary(name)}", flush=True)
    total = time.perf_counter() - t_all
    print(f"SUMMARY alone: {scored}/{len(names)} scored, {len(names) / total * 60:.1f} judgments a minute "
          f"({total:.0f} s)", flush=True)


def run_eval(kb: Path, out: Path, names: list[str], n: int, k: int, limit_s: float | None = None) -> None:
    """`limit_s`: the eval is stopped (SIGTERM, as a user's Ctrl-C or a job's timeout) after this long, and what
    finished by then is counted: a device call's part ends on time with its figures."""
    eval_out = out / f"eval_n{n}"
    shutil.rmtree(eval_out, ignore_errors=True)
    tasks = [a for name in names for a in ("--tasks", str(kb / "level1" / f"{name}.py"))]
    cmd = [sys.executable, "-m", "cuda_agent", "eval", *tasks, "--solutions", str(out / "solutions"),
           "-k", str(k), "-n", str(n), "--out", str(eval_out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        print(f"eval stopped at its limit of {limit_s:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    (out / f"eval_n{n}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    episodes = []
    path = eval_out / "episodes.jsonl"
    if path.is_file():
        episodes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    failed = []
    for e in episodes:
        j = e.get("judgment") or {}
        v, p, r = j.get("verify") or {}, j.get("profile") or {}, (j.get("reward") or {})
        ok = bool(v.get("ok")) and (r.get("reward") or e.get("reward") or 0) >= 1
        if not ok:
            failed.append({"task": (e.get("task") or {}).get("id"), "verify": v.get("reason"), "profile": p.get("reason"),
                           "message": ((v.get("message") or "") + " " + (p.get("message") or ""))[:500]})
    for f in failed:
        print(f"eval failed: {f}", flush=True)
    print(f"SUMMARY eval -n {n} -k {k}: rc {proc.returncode}, {len(episodes) - len(failed)}/{len(episodes)} scored, "
          f"{len(episodes) / wall * 60:.1f} judgments a minute ({wall:.0f} s)", flush=True)
    if proc.returncode:
        print(stderr[-3000:], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", type=Path, required=True, help="a KernelBench checkout (level1/ beneath it)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default=",".join(ACTIVATIONS), help="comma-separated level-1 task stems")
    ap.add_argument("--modes", default="alone,eval")
    ap.add_argument("--n", type=int, default=8, help="judgments at once (eval), clients (mcp)")
    ap.add_argument("--k", type=int, default=2, help="episodes per task (eval, mcp)")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"), help="the judge's backend (alone, mcp)")
    ap.add_argument("--solutions", type=Path, default=None, help="a folder per task (its files: the solution) "
                    "instead of the float4 kernels written here: a CPU smoke test's tasks under --kb/level1")
    ap.add_argument("--eval-limit", type=float, default=None, help="stop the eval after this many seconds")
    ap.add_argument("--trace", action="store_true", help="log every worker request (alone): OUT/requests.jsonl")
    ap.add_argument("--cache", type=Path, default=None, help="the judge's cache (default: a fresh one under OUT)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUDA_AGENT_CACHE", str(a.cache or a.out / "cache"))
    names = [t for t in a.tasks.split(",") if t]
    if a.solutions:
        for name in names:
            shutil.rmtree(a.out / "solutions" / name, ignore_errors=True)
            shutil.copytree(a.solutions / name, a.out / "solutions" / name)
    else:
        write_solutions(a.out / "solutions", names)
    for mode in a.modes.split(","):
        if mode == "alone":
            run_alone(a.kb, a.out, names, RequestTrace(a.out) if a.trace else None, a.backend)
        elif mode == "eval":
            run_eval(a.kb, a.out, names, a.n, a.k, a.eval_limit)
        elif mode == "mcp":
            run_mcp(a.kb, a.out, names, a.n, a.k, a.backend, record=lambda row: _row(a.out, "mcp", row))
        else:
            raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
