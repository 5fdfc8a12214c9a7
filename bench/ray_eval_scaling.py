"""`eval --solutions` over the Ray judge pool (`--ray local`), one GPU against two, beside the single-host path.

24 elementwise tasks (the eight operators of bench.proofs.family at three input sizes), each with its correct
solution in workspace form. Each configuration is one `cuda-agent eval` in a fresh output folder, timed end to
end (cluster start, actors, every judgment, the report); CUDA_VISIBLE_DEVICES picks the GPUs, so `--ray local`
places one judge actor per GPU it sees. Reports wall seconds, correct problems and the speedup of two GPUs over
one (issue 35 asks for >= 1.9x). JSON to --out/summary.json.

    python -m bench.ray_eval_scaling --out /tmp/ray-scaling                   # a host with two GPUs
    python -m bench.ray_eval_scaling --out /tmp/rs --backend cpu --tasks 2 --configs ray:0   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.proofs.family import OPS, TASK, expert_files  # noqa: E402

SIZES = (4096, 8192, 16384)  # rows of 1024 floats


def write_suite(root: Path, n: int, backend: str) -> tuple[Path, Path]:
    tasks, sols = root / "tasks", root / "solutions"
    for d in (tasks, sols):  # an earlier run's suite in the same folder may have had more tasks
        shutil.rmtree(d, ignore_errors=True)
    names = [(op, rows) for rows in SIZES for op in OPS][:n]
    for op, rows in names:
        name = f"{op}_{rows}"
        tasks.mkdir(parents=True, exist_ok=True)
        (tasks / f"{name}.py").write_text(TASK.format(name=op, torch_expr=OPS[op][0], rows=rows))
        for path, body in expert_files(OPS[op][1], backend).items():
            dest = sols / name / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(body)
    return tasks, sols


def run_eval(tasks: Path, sols: Path, out: Path, backend: str, gpus: str, ray: bool, concurrency: int,
             timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "cuda_agent", "eval", "--solutions", str(sols), "--tasks", str(tasks), "--out",
           str(out), "--backend", backend, "--concurrency", str(concurrency), "--no-plots", "-q"]
    env = dict(os.environ)
    if backend == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if ray:
        cmd += ["--ray", "local"]
    elif backend == "cuda":
        cmd += ["--gpus", ",".join(str(i) for i in range(len(gpus.split(","))))]
    shutil.rmtree(out, ignore_errors=True)  # a run of an earlier call in the same folder would be refused
    t0 = time.perf_counter()
    # its own session: a run cut by the timeout takes its judges and its Ray cluster with it, and the next
    # configuration starts on idle GPUs; what it finished still counts (the timeline's episodes a minute)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout_s)
        rc: int | str = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        rc = "timeout"
    r = types.SimpleNamespace(returncode=rc, stdout=stdout, stderr=stderr)
    wall = time.perf_counter() - t0
    (out.parent / f"{out.name}.log").write_text(r.stderr)
    row = {"ray": ray, "gpus": gpus, "rc": r.returncode, "wall_s": round(wall, 1)}
    if r.returncode == 0:
        overall = json.loads(r.stdout)
        row.update(problems=overall["problems"], correct=overall["correct"],
                   failure_reasons=overall.get("failure_reasons") or {})
        summary = json.loads((out / "summary.json").read_text())
        if summary.get("cluster"):
            row["actors"] = [{k: a[k] for k in ("actor", "node", "gpu", "judgments")}
                             for a in summary["cluster"]["actors"]]
    else:
        row["stderr"] = r.stderr[-2000:]
    row["timeline"] = timeline(out)
    row["outcomes"] = outcomes(out)
    row["episodes_per_min"] = row["timeline"].get("episodes_per_min")
    return row


def outcomes(run_dir: Path) -> dict:
    """Each episode's end as `stage:reason` (the first step of compile, verify, profile that did not pass, or
    `correct` / `untimed:REASON`), counted, with one message of each: a run whose rate rests on failed
    judgments is no measure of scaling."""
    path = run_dir / "episodes.jsonl"
    if not path.is_file():
        return {}
    counts: dict[str, int] = {}
    messages: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        j = json.loads(line).get("judgment") or {}
        key, msg = "correct", ""
        if j.get("error"):
            key, msg = "judge_error", j["error"]
        for op in ("compile", "verify", "profile"):
            r = j.get(op)
            if key == "correct" and r is not None and not r.get("ok"):
                key = f"{'untimed' if op == 'profile' else op}:{r.get('reason')}"
                msg = r.get("message") or ""
        counts[key] = counts.get(key, 0) + 1
        messages.setdefault(key, msg[:300])
    return {"counts": counts, "messages": {k: v for k, v in messages.items() if v}}


def timeline(run_dir: Path) -> dict:
    """Where a run's time went, from its episodes.jsonl: per tool server (a Ray actor, or the host's GPUs), the
    episodes, the summed seconds of the judge's compile, verify and profile, and the judgments' time outside
    them (queued in the server, transport), the profile's and verify's phases summed (device lock waits against
    timing, worker set-up); the run's mean concurrency (episode seconds over the episodes'
    span). Two GPUs that do not beat one show here as a sum that did not halve, or as time outside the judge."""
    path = run_dir / "episodes.jsonl"
    if not path.is_file():
        return {}
    eps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not eps:
        return {}
    servers: dict[str, dict] = {}
    for e in eps:
        srv = e.get("tool_server") or {}
        name = f"{srv.get('alias', '?')}" + (f"/gpu{srv['gpu']}" if srv.get("gpu") is not None else "")
        s = servers.setdefault(name, {"episodes": 0, "compile_s": 0.0, "verify_s": 0.0, "profile_s": 0.0,
                                      "outside_judge_s": 0.0})
        s["episodes"] += 1
        j = e.get("judgment") or {}
        inside = 0.0
        for op in ("compile", "verify", "profile"):
            d = (j.get(op) or {}).get("duration_s") or 0.0
            s[f"{op}_s"] += d
            inside += d
        s["outside_judge_s"] += max(0.0, (j.get("duration_s") or 0.0) - inside)
        # inside the profile and the verify: waiting for the device lock against holding it, and worker set-up
        for op, keys in (("profile", ("queued", "setup_queued", "setup", "timing", "spot_checks", "worker_wait")),
                         ("verify", ("queued", "setup", "worker_wait"))):
            phases = (j.get(op) or {}).get("phases") or {}
            for k in keys:
                if isinstance(phases.get(k), (int, float)):
                    s[f"{op}_{k}_s"] = s.get(f"{op}_{k}_s", 0.0) + phases[k]
    start = min(e["started_at"] for e in eps)
    span = max(e["started_at"] + e["duration_s"] for e in eps) - start
    return {"span_s": round(span, 1), "episodes": len(eps),
            "episodes_per_min": round(60 * len(eps) / span, 2) if span > 0 else None, "mean_concurrency": round(sum(e["duration_s"] for e in eps) / span, 2)
            if span > 0 else None,
            "servers": {k: {f: round(v, 1) if isinstance(v, float) else v for f, v in s.items()}
                        for k, s in sorted(servers.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16, help="episodes at once (each config)")
    ap.add_argument("--configs", default="host:0;1,ray:0,ray:0;1,host:0;1",
                    help="comma-separated ray:GPUS or host:GPUS, GPUs separated by ';'. Every run shares the judge's "
                         "cache: the first one measures the 24 baselines (torch.compile's too), so it warms the cache "
                         "and the runs compared after it all judge against cached baselines")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per configuration")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tasks, sols = write_suite(args.out, args.tasks, args.backend)
    rows = []
    for i, conf in enumerate(args.configs.split(",")):
        kind, _, gpus = conf.partition(":")
        row = run_eval(tasks, sols, args.out / f"run{i}-{kind}-{gpus.replace(';', '_')}", args.backend,
                       gpus.replace(";", ","), kind == "ray", args.concurrency, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows_after = rows[1:] if len(rows) > 1 else rows  # the first run warmed the baseline cache
    ray1 = next((r for r in rows_after if r["ray"] and "," not in r["gpus"] and r["episodes_per_min"]), None)
    ray2 = next((r for r in rows_after if r["ray"] and "," in r["gpus"] and r["episodes_per_min"]), None)
    host = next((r for r in rows_after if not r["ray"] and "," in r["gpus"] and r["rc"] == 0), None)
    # by episodes a minute, so that a run the timeout cut still compares (its finished episodes over their span)
    summary = {"tasks": args.tasks, "backend": args.backend, "runs": rows,
               "ray_two_over_one": round(ray2["episodes_per_min"] / ray1["episodes_per_min"], 2) if ray1 and ray2
               else None,
               "host_two_gpus_wall_s": host["wall_s"] if host else None}
    # the solutions are all correct: a run with failed judgments ran shorter ones, and its rate measures nothing
    summary["every_judgment_correct"] = all(r.get("correct") == r.get("problems") for r in (ray1, ray2) if r)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("ray_two_over_one", "every_judgment_correct", "host_two_gpus_wall_s")}))


if __name__ == "__main__":
    main()
