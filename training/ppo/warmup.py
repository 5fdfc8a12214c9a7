"""`cuda-agent train warmup`: single-turn PPO. The prompt is SKILL.md and the task; the response is the
whole solution in one message, as files:

    <file path="model_new.py">
    ...python...
    </file>
    <file path="kernels/relu.cu">
    ...CUDA C++...
    </file>

Each response is written into a fresh workspace of the task (the workspace's own rules apply:
protected files and paths outside it are refused) and judged by the sandbox (compile, verify,
profile); the reward is the milestone reward. A response without files is judged too (the
placeholder model_new.py fails to compile), so every reward comes from the judge."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from training.ppo.config import PPOConfig
from training.ppo.stage import StageRun, episode_metrics, open_learner

# verdicts about the judge's own trouble, not the files: timing_noisy is the reward's reason when the machine
# was too noisy to time a speedup (the milestone stopped at correct)
NOT_CACHED = frozenset({"internal_error", "reference_error", "reference_oom", "timing_noisy"})

FILE_BLOCK = re.compile(r'<file path="([^"\n]+)">\n?(.*?)</file>', re.S)

FORMAT = """\
You answer in a single message, with no tools: write every file of your solution in full, each as

<file path="model_new.py">
...the file's content...
</file>

with model_new.py (ModelNew) and your kernel sources under kernels/. Nothing else you write is read. \
The files are then compiled, verified and timed by the judge, and only that result counts."""


@dataclass
class WarmupConfig:
    ppo: PPOConfig
    tasks: list[str]
    out: Path
    steps: int = 100
    prompts_per_step: int = 8  # tasks per step (cycling through the task list)
    samples: int = 4  # responses per task
    max_new_tokens: int = 4096
    temperature: float = 1.0  # also the learner's (PPOConfig.temperature): it scores what was sampled
    top_p: float = 1.0
    system_prompt: str | None = None  # None: SKILL.md
    backend: str | None = None  # cuda or cpu (None: cuda when visible)
    judge_workers: int = 4  # at once, over all the judge's GPUs
    # the GPUs judgments run on, round-robin (CUDA_VISIBLE_DEVICES names; None: every visible GPU)
    judge_gpus: list[str] | None = None
    judge_cache: bool = False  # reuse the judgment of byte-identical files of the same task (see docs)
    # identical files are built and verified once, and their workspace kept (OUT/built/), but every response is
    # profiled again in a paired timing of its own: a speed reward never reuses one draw of the machine's noise
    # (with judge_cache, a cached verdict is reused only when it failed before the profile)
    reprofile: bool = False
    profile: dict[str, Any] | None = None  # ProfileConfig fields of the judge's profiles (None: its defaults)
    save_every: int = 10
    keep_checkpoints: int = 2
    resume: bool = True
    tensorboard: bool = True
    time_limit_s: float | None = None  # stop (with a checkpoint) after the step that passes it
    # judge on a Ray cluster's judge actors (local, auto, HOST:PORT; harness.cluster) instead of this host's GPUs;
    # judge_workers is then the judgments in flight over the whole pool
    ray: str | None = None


def parse_solution(text: str) -> dict[str, str]:
    """The files of a response, in order; a path named twice keeps its last content."""
    return {path.strip(): body for path, body in FILE_BLOCK.findall(text)}


def render_solution(files: dict[str, str]) -> str:
    """The response format for given files (expert demonstrations)."""
    return "".join(f'<file path="{p}">\n{body}{"" if body.endswith(chr(10)) else chr(10)}</file>\n'
                   for p, body in files.items())


def prompt_messages(task: Any, backend: str, system: str | None = None) -> list[dict[str, str]]:
    from harness.prompts import CPU_NOTE
    from skills import skill_text

    user = [f"Task: {task.id}", f"Target: {'an NVIDIA GPU (cuda backend)' if backend == 'cuda' else 'the CPU backend'}.",
            "", "model.py:", "```python", task.source.rstrip(), "```", "", FORMAT]
    if backend == "cpu":
        user.append(CPU_NOTE)
    return [{"role": "system", "content": skill_text() if system is None else system},
            {"role": "user", "content": "\n".join(user)}]


def prompt_ids(tokenizer: Any, task: Any, backend: str, system: str | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template(prompt_messages(task, backend, system), add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def _verdict(c: Any, v: Any, r: Any, refused: list[str], t0: float) -> dict[str, Any]:
    return {"reward": r.reward, "milestone": r.milestone, "reason": str(r.reason) if r.reason else None,
            "compile_ok": c.ok, "verify_ok": bool(v and v.ok), "refused": refused,
            "speedup_vs_eager": r.speedup_vs_eager, "speedup_vs_compile": r.speedup_vs_compile,
            "judge_s": time.perf_counter() - t0}


def _profile_config(profile: dict[str, Any] | None) -> Any:
    from sandbox.config import ProfileConfig

    return ProfileConfig(**profile) if profile else None


def judge_files(task: Any, files: dict[str, str], root: Path, backend: str, profile: dict[str, Any] | None = None,
                keep: bool = False) -> dict[str, Any]:
    """Writes the files into a new workspace at `root` and runs the sandbox's evaluate on it. With `keep`, a
    workspace whose files verified stays, with its build and verify results (profile_again times it again)."""
    from sandbox.api import evaluate, init_workspace
    from sandbox.workspace import WorkspaceError

    t0 = time.perf_counter()
    ws, _ = init_workspace(task, root, backend=backend, check=False)
    refused = []
    for path, body in files.items():
        try:
            ws.write_text(path, body)
        except WorkspaceError as e:
            refused.append(f"{path}: {e}")
    c, v, p, r = evaluate(ws, profile=_profile_config(profile))
    if keep and v is not None and v.ok:
        (root / KEPT).write_text(json.dumps({"compile": c.model_dump(mode="json"), "verify": v.model_dump(mode="json"),
                                             "refused": refused}))
    return _verdict(c, v, r, refused, t0)


KEPT = "verified.json"  # in a kept workspace: its build and verify results


def judge_files_anywhere(task: Any, files: dict[str, str], backend: str,
                         profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """judge_files in a temporary workspace of the machine it runs on (a Ray judge actor's node)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cuda-agent-warmup-") as d:
        return judge_files(task, files, Path(d) / "ws", backend, profile)


def profile_again(root: Path, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdict on a workspace that judge_files kept, from a new profile and the kept build and verify."""
    from sandbox.api import Workspace, milestone_reward, profile_workspace
    from sandbox.results import CompileResult, VerifyResult

    t0 = time.perf_counter()
    kept = json.loads((root / KEPT).read_text())
    c, v = CompileResult.model_validate(kept["compile"]), VerifyResult.model_validate(kept["verify"])
    p = profile_workspace(Workspace(root), _profile_config(profile))
    return _verdict(c, v, milestone_reward(c, v, p), kept["refused"], t0)


class Judge:
    """Judges a step's responses in parallel (compiles and workers are subprocesses)."""

    def __init__(self, cfg: WarmupConfig, backend: str):
        from sandbox.backend import GpuRing

        self.cfg, self.backend = cfg, backend
        self.ring = GpuRing(backend, cfg.judge_gpus)
        self.remote: Any = None
        if cfg.ray:
            if cfg.reprofile:
                raise ValueError("--ray judges on the actors' nodes and keeps no builds here: reprofile needs them")
            from harness.cluster.executor import RayExecutor

            self.remote = RayExecutor(cfg.ray, backend, per_actor=max(1, cfg.judge_workers))
        self._expected = False  # the pool told how many judge at once: at the first judging, not at construction
        self.cache: dict[str, dict[str, Any]] = {}
        cache_file = cfg.out / "judge_cache.jsonl"
        if cfg.judge_cache and cache_file.is_file():
            for ln in cache_file.read_text().splitlines():
                row = json.loads(ln)
                self.cache[row["key"]] = row["result"]

    def key(self, task: Any, files: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps([task.sha256, self.backend, sorted(files.items())]).encode()).hexdigest()

    def built(self, key: str) -> Path:
        return self.cfg.out / "built" / key[:32]

    def _reusable(self, k: str) -> bool:
        """A cached verdict stands in for a judgment (under reprofile only one that failed before the profile)."""
        return self.cfg.judge_cache and k in self.cache and not (self.cfg.reprofile and self.cache[k]["verify_ok"])

    def __call__(self, jobs: list[tuple[Any, dict[str, str]]], root: Path) -> list[dict[str, Any]]:
        cfg = self.cfg
        if self.remote is None and not self._expected:  # ready workers for the first step's judgments too
            from sandbox.api import expect_judgments

            expect_judgments(cfg.judge_workers, self.backend, self.ring.gpus or None)
            self._expected = True
        results: list[dict[str, Any] | None] = [None] * len(jobs)
        keys = [self.key(task, files) for task, files in jobs]
        todo: dict[str, list[int]] = {}
        again: list[int] = []  # reprofile: responses whose files are built and verified already
        for i, k in enumerate(keys):
            if cfg.reprofile and (self.built(k) / KEPT).is_file():
                again.append(i)
            elif self._reusable(k):
                results[i] = {**self.cache[k], "key": k, "cached": True, "judged": "cached"}
            else:
                todo.setdefault(k if cfg.judge_cache or cfg.reprofile else f"{k}-{i}", []).append(i)

        def one(idx: list[int]) -> tuple[list[int], dict[str, Any]]:
            if self.remote is not None:  # on the least busy judge actor; one that dies is replaced by another
                task, files = jobs[idx[0]]
                return idx, self.remote.submit(judge_files_anywhere, task, files, self.backend, cfg.profile).result()
            with self.ring.next():
                return judged(idx)

        def again_one(i: int) -> dict[str, Any]:
            with self.ring.next():
                return profile_again(self.built(keys[i]), cfg.profile)

        def judged(idx: list[int]) -> tuple[list[int], dict[str, Any]]:
            task, files = jobs[idx[0]]
            if not cfg.reprofile:
                return idx, judge_files(task, files, root / f"ws{idx[0]:04d}", self.backend, cfg.profile)
            where = self.built(keys[idx[0]])
            shutil.rmtree(where, ignore_errors=True)  # what an interrupted judgment left
            res = judge_files(task, files, where, self.backend, cfg.profile, keep=True)
            if not (where / KEPT).is_file():
                shutil.rmtree(where, ignore_errors=True)
            return idx, res

        with ThreadPoolExecutor(max(1, cfg.judge_workers)) as pool:
            for idx, res in pool.map(one, list(todo.values())):
                k = keys[idx[0]]
                results[idx[0]] = {**res, "key": k, "judged": "full"}
                for i in idx[1:]:  # identical files in the step: judged again (reprofile), or given this verdict
                    if cfg.reprofile and (self.built(k) / KEPT).is_file():
                        again.append(i)
                    else:
                        results[i] = {**res, "key": k, "judged": "shared"}
                # a verdict about the judge's own trouble (not the files) is not reused: the next sample retries
                if cfg.judge_cache and res["reason"] not in NOT_CACHED:
                    self.cache[k] = res
                    with open(cfg.out / "judge_cache.jsonl", "a") as fh:
                        fh.write(json.dumps({"key": k, "result": res}) + "\n")
            for i, res in zip(again, pool.map(again_one, again),
                              strict=True):
                results[i] = {**res, "key": keys[i], "judged": "reprofiled"}
        shutil.rmtree(root, ignore_errors=True)
        return [r for r in results if r is not None]


def run_warmup(cfg: WarmupConfig, on_step: Any = None) -> StageRun:
    from harness.specs import select_tasks
    from sandbox.backend import resolve_backend
    from training.ppo.generate import sample
    from training.ppo.samples import from_completion

    tasks = select_tasks(cfg.tasks)
    backend = resolve_backend(cfg.backend)
    # the learner scores the tempered distribution the responses are sampled from (greedy: raw logits)
    ppo = replace(cfg.ppo, temperature=cfg.temperature) if cfg.temperature > 0 else cfg.ppo
    run = StageRun(cfg.out, "warmup", {**asdict(cfg), "ppo": ppo.to_dict()}, resume=cfg.resume,
                   tensorboard=cfg.tensorboard, keep=cfg.keep_checkpoints)
    learner, tok, first = open_learner(ppo, run)
    judge = Judge(cfg, backend)
    prompts = {t.id: prompt_ids(tok, t, backend, cfg.system_prompt) for t in tasks}
    started = time.perf_counter()
    try:
        for step in range(first, cfg.steps + 1):
            rng = random.Random(cfg.ppo.seed * 7919 + step)
            start = (step - 1) * cfg.prompts_per_step
            chosen = [tasks[(start + k) % len(tasks)] for k in range(min(cfg.prompts_per_step, len(tasks)))]
            jobs = [t for t in chosen for _ in range(cfg.samples)]
            import torch

            torch.manual_seed(rng.randrange(1 << 31))
            t0 = time.perf_counter()
            outs = sample(learner.actor, tok, [prompts[t.id] for t in jobs], cfg.max_new_tokens, cfg.temperature,
                          cfg.top_p, batch_size=max(1, cfg.ppo.micro_batch_size * 4))
            gen_s = time.perf_counter() - t0
            texts = [tok.decode(ids, skip_special_tokens=True) for ids, _, _ in outs]
            t1 = time.perf_counter()
            results = judge([(t, parse_solution(x)) for t, x in zip(jobs, texts, strict=True)],
                            cfg.out / "workspaces" / f"step-{step:06d}")
            judge_wall = time.perf_counter() - t1
            samples = [from_completion(prompts[t.id], ids, lps, res["reward"], {"task_id": t.id})
                       for t, (ids, lps, _), res in zip(jobs, outs, results, strict=True)]
            t2 = time.perf_counter()
            items = learner.prepare(samples)
            metrics: dict[str, Any] = episode_metrics([r["reward"] for r in results], [r["milestone"] for r in results],
                                                      [r["judge_s"] for r in results if not r.get("cached")], [])
            metrics.update(learner.batch_stats(items))
            metrics.update(learner.train_step(items, step))
            n_tokens = sum(len(ids) for ids, _, _ in outs)
            metrics.update({"generate_s": gen_s, "judge_wall_s": judge_wall, "learn_s": time.perf_counter() - t2,
                            "rollout/tokens_per_s": n_tokens / gen_s if gen_s > 0 else 0.0,
                            "response/tokens_mean": n_tokens / len(outs),
                            "response/with_files": sum(bool(parse_solution(x)) for x in texts) / len(texts),
                            "response/truncated": sum(f == "length" for _, _, f in outs) / len(outs),
                            "compile_ok": sum(r["compile_ok"] for r in results) / len(results),
                            "judge_cache_hits": sum(bool(r.get("cached")) for r in results),
                            "judge_reprofiled": sum(r["judged"] == "reprofiled" for r in results),
                            "judge_timing_noisy": sum(r["reason"] == "timing_noisy" for r in results),
                            **(judge.remote.metrics() if judge.remote is not None else {})})
            run.log(step, metrics)
            with open(cfg.out / "responses.jsonl", "a") as fh:
                for t, x, r in zip(jobs, texts, results, strict=True):
                    fh.write(json.dumps({"step": step, "task_id": t.id, "reward": r["reward"],
                                         "milestone": r["milestone"], "reason": r["reason"], "key": r["key"],
                                         "judged": r["judged"],
                                         "speedup_vs_eager": r.get("speedup_vs_eager"), "response": x[:4000]}) + "\n")
            over = cfg.time_limit_s is not None and time.perf_counter() - started > cfg.time_limit_s
            if step % cfg.save_every == 0 or step == cfg.steps or over:
                run.save(step, learner, {}, cfg.ppo.model)
            if on_step is not None:
                on_step(step, metrics)
            if over:
                break
        run.save_final(learner, cfg.ppo.model)
    finally:
        run.close()
        if judge.remote is not None:
            judge.remote.shutdown()
    return run
