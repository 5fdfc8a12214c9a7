"""Settings for each operation. Defaults follow the paper where it states them."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, Field

from tasks.kernelbench import cache_dir  # noqa: F401  (one cache for the whole project, re-exported)


class CompileConfig(BaseModel):
    timeout_s: float = Field(300.0, gt=0, description="whole build; the process tree is killed past it")
    jobs: int | None = Field(None, ge=1, description="parallel compile jobs (default: CPU count)")
    max_diagnostics: int = Field(50, ge=1)
    log_tail_chars: int = Field(4000, ge=200)
    precompiled_header: bool = Field(True, description="compile bindings against binding_registry.h precompiled "
                                     "once per toolchain, where the judge's cache is trusted (docs/judge.md)")
    pybind_interface: bool = Field(True, description="with GCC, precompile that header with pybind11's headers "
                                   "interface-only, so that bindings leave pybind11's members to the shared "
                                   "infrastructure object (sandbox/build/pybind_interface.py); a build that needs one "
                                   "it does not hold is done again against the plain header")
    thin_bindings: bool = Field(default_factory=lambda: os.environ.get("CUDA_AGENT_THIN_BINDINGS", "1") != "0",
                                description="compile each .cpp first against binding_registry.h's thin stand-in for "
                                "pybind11 (a binding in a third of the time), and where that fails against pybind11 "
                                "itself; CUDA_AGENT_THIN_BINDINGS=0 turns it off")
    object_cache: bool = Field(True, description="reuse the object of a source compiled before with the same "
                               "command and the same headers, where the judge's cache is trusted (docs/judge.md)")
    object_cache_dir: str | None = Field(None, description="the object cache's folder, for a cache of its own (the "
                                         "MCP server keeps one per client under its root); default: the judge's cache")
    object_cache_max_bytes: int | None = Field(None, ge=0, description="what the object cache may hold, kept on every "
                                               "store; default: $CUDA_AGENT_OBJECT_CACHE_MB MiB, else 2 GiB")


DEFAULT_TOLERANCES: dict[str, float] = {
    "float32": 1e-2,
    "float64": 1e-2,
    "float16": 1e-2,
    "bfloat16": 1e-2,
}


class VerifyConfig(BaseModel):
    trials: int = Field(5, ge=1, le=100, description="input sets, each from a fresh random seed")
    atol: float = Field(1e-2, ge=0)
    rtol: float = Field(1e-2, ge=0)
    # per-dtype overrides of (atol, rtol); dtypes not named use atol/rtol; integers and bools are exact
    dtype_tolerances: dict[str, tuple[float, float]] = Field(default_factory=dict)
    forbid_torch_ops: bool = Field(True, description="fail when the forward dispatches PyTorch compute ops")
    audit_ops: bool = Field(True, description="also account for the forward below Python dispatch: the profiler's op callbacks, and on CUDA the device's kernels and copies (needs forbid_torch_ops)")
    static_checks: bool = Field(True, description="scan model_new.py for judge-patching and shortcut constructs")
    signed_trials: int = Field(1, ge=0, le=20, description="extra input sets mapped to 4x - 2 (signed values)")
    repeat_first: bool = Field(True, description="run the first input set twice: the answers must agree")
    rel_norm_tol: float = Field(0.05, gt=0, description="limit on |out - ref| / |ref| per output")
    strict: bool = Field(False, description="float32 at atol = rtol = 1e-4, for evaluations that want it")
    generalize: bool = Field(False, description="also try other input sizes where the task allows (reported apart)")
    setup_timeout_s: float = Field(300.0, gt=0, description="process start, imports, model construction")
    trial_timeout_s: float = Field(120.0, gt=0, description="one input set: generation, forward, compare; for the "
                                   "candidate's waits the upper bound of the relative rule below")
    trial_timeout_factor: float = Field(100.0, ge=0, description="the candidate's waits on an input set are allowed "
                                        "this many times the reference's time on it (the slowest set so far), at "
                                        "least trial_timeout_floor_s, at most trial_timeout_s; 0: trial_timeout_s "
                                        "(sandbox/correctness/trial_timeout.py)")
    trial_timeout_floor_s: float = Field(10.0, gt=0, description="the least the relative rule allows the candidate")

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype in self.dtype_tolerances:
            return self.dtype_tolerances[dtype]
        if self.strict and dtype in ("float32", "float64"):
            return (min(self.atol, 1e-4), min(self.rtol, 1e-4))
        return (self.atol, self.rtol)


CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[str, ...] = CompileMode.__args__


class RewardConfig(BaseModel):
    """Milestone rewards; the defaults are the paper's scale."""

    failed: float = -1.0
    correct: float = 1.0
    faster_than_eager: float = 2.0
    faster_than_compile: float = 3.0
    unjudged: float = Field(0.0, description="a verify the task itself could not run (reference_oom: its reference out "
                            "of memory with the device to itself): milestone failed, but not the failed reward, "
                            "which says the kernel was wrong")
    eager_margin: float = Field(0.0, ge=0, description="speedup over eager must exceed 1 + margin")
    compile_margin: float = Field(0.05, ge=0, description="speedup over torch.compile must exceed 1 + margin")
    speedup_confidence: float = Field(0.95, ge=0.5, lt=1, description="the speed milestones rest on the lower end "
                                      "of the median speedup's one-sided confidence interval at this level (from the "
                                      "paired rounds, distribution-free): with 5 rounds, the slowest round's")
    launch_bound_counts: bool = Field(False, description="let launch-bound tasks earn faster_than_compile")
    launch_bound_eager_margin: float = Field(0.10, ge=0, description="on a launch-bound task the speedup over "
                                             "eager must exceed 1 + this (when larger than eager_margin): both "
                                             "times are mostly launch latency, and a few percent either way is "
                                             "noise between runs that a policy would learn to chase")


class ProfileConfig(BaseModel):
    compile_mode: CompileMode = Field("default", description="torch.compile mode of the baseline")
    static_checks: bool = Field(True, description="scan model_new.py before timing it, as verify does (the same "
                                "scan and refusal: forbidden_construct)")
    warmup_ms: float = Field(50.0, ge=0)
    min_warmup_calls: int = Field(3, ge=1)
    target_ms: float = Field(250.0, gt=0, description="timed budget per measured model, each call counted with the "
                             "drawing of its inputs: it sets the batches of calls over target_ms / max_trials (2.5 ms) "
                             "only, smaller ones fill max_trials or min_batch_ms first. 250: on an H200, 19_ReLU's "
                             "paired timing took 0.58 s against 1.02 s at 500, its speedups as close (docs/history.md, nineteenth round)")
    min_trials: int = Field(10, ge=3)
    max_trials: int = Field(100, ge=3)
    timing_batches: int = Field(5, ge=1, le=50, description="the timed calls run in this many batches, each timed "
                                "by the judge's own clock")
    min_batch_ms: float = Field(10.0, gt=0, description="each batch holds at least this much reported work (more "
                                "calls than max_trials allows on fast tasks), so the judge's clock bounds it")
    max_batch_calls: int = Field(1000, ge=1, description="calls per batch at most")
    spot_checks: int = Field(4, ge=0, le=20, description="timed calls whose outputs are checked against the reference, "
                             "on average over the rounds every timing runs: each timed call is drawn with the same "
                             "probability once it has returned, and at least one is checked")
    spot_device_bytes: int = Field(2 << 30, ge=0, description="the candidate's spot-checked outputs kept on the device "
                                   "up to this many bytes; the rest wait in host memory until checked (large outputs)")
    spot_device_room: bool = Field(True, description="on CUDA, keep more copies on the device than spot_device_bytes "
                                   "where it has room to spare (what the checks still need and a quarter of its "
                                   "memory left free); the checks then run before the device lock steps down to shared")
    timing_ahead: bool = Field(default_factory=lambda: os.environ.get("CUDA_AGENT_TIMING_AHEAD", "1") != "0",
                               description="set the first pairing up (both sides' warm-up and first inputs) before the "
                               "timing holds the device exclusively, under the shared lock; CUDA_AGENT_TIMING_AHEAD=0 "
                               "sets it up inside, as before")
    judge_clock_process: bool = Field(default_factory=lambda: os.environ.get("CUDA_AGENT_JUDGE_CLOCK", "process")
                                      != "thread", description="read the judge's clock around timed requests in a "
                                      "process of its own, not in the judging thread, which waits for the GIL "
                                      "(sandbox/timing/judge_clock.py); CUDA_AGENT_JUDGE_CLOCK=thread reads it there")
    spot_host_bytes: int = Field(8 << 30, ge=0, description="and in host memory up to this many bytes (at most a "
                                 "quarter of the candidate's RLIMIT_DATA); copies past both are let go unchecked, "
                                 "the first always kept (checks.spots_let_go)")
    audit_timed_calls: bool = Field(True, description="trace the kernels of the candidate's timed calls (CUDA)")
    pin_core: bool = Field(True, description="on CUDA, hold eager's and the candidate's processes to one CPU core, "
                           "the same for both, while they are timed (sandbox/timing/cores.py)")
    top_kernels: int = Field(8, ge=0)
    use_cache: bool = True
    setup_timeout_s: float = Field(300.0, gt=0)
    baseline_timeout_s: float = Field(900.0, gt=0, description="eager + torch.compile of the reference")
    timing_timeout_s: float = Field(300.0, gt=0)
    launch_bound_ms: float = Field(0.1, ge=0, description="eager medians below this mark a task launch-bound")
    retime_iqr_fraction: float = Field(0.2, gt=0, description="re-time a baseline whose IQR exceeds this share "
                                       "of its median")
    retime_max: int = Field(2, ge=0, le=10, description="re-timings at most, per baseline")
    # paired timings (docs/judge.md): none of these is part of the baseline's cache key
    noise_max_spread: float = Field(1.5, gt=1, description="eager's batches in the paired rounds may disagree by "
                                    "this factor at most (slowest median over fastest); beyond it the machine was "
                                    "too noisy to score a speedup (timing_noisy)")
    candidate_max_spread: float = Field(3.0, gt=1, description="two consecutive candidate batches may disagree "
                                        "by this factor at most while eager's agree; beyond it something disturbed "
                                        "the candidate's batches (timing_noisy, after noise_retries pairings)")
    noise_retries: int = Field(1, ge=0, le=3, description="pairings run again when the rounds were noisy, before "
                               "giving up")
    bound_retries: int = Field(2, ge=0, le=5, description="pairings run again (between fresh calibrations, the second "
                               "and later after a pause of bound_retry_pause_s times its number) when the candidate "
                               "failed the timing bound, before timing_unverified: another process's work on the "
                               "device inflates the judge's clock for an honest kernel in bursts (an honest ReLU at "
                               "KernelBench's size failed 2 of 8 profiles beside a GPU tenant with one retry, H200), "
                               "while a forged timing fails every pairing")
    bound_retry_pause_s: float = Field(0.5, ge=0, le=10, description="the pause before the second and later bound "
                                       "retries, times the retry's number")
    baseline_max_age_s: float = Field(86400.0, ge=0, description="a cached baseline older than this is measured "
                                      "again (its torch.compile/eager ratio scales the paired eager)")
    baseline_max_drift: float = Field(1.5, gt=1, description="a baseline whose eager median is slower than the "
                                      "paired eager by more than this factor was measured under load: measured "
                                      "again; a paired eager slower than the baseline by more than this is load "
                                      "now (timing_noisy)")
    # stopping the paired timing early (docs/judge.md, "Stopping the paired timing early"); not part of the
    # baseline's cache key either
    early_stop: bool = Field(True, description="stop the paired timing once its rounds decide the milestone; off: "
                             "every profile times timing_batches rounds")
    min_rounds: int = Field(3, ge=1, le=50, description="paired rounds before the timing may stop; never fewer "
                            "than a majority of timing_batches (what makes a stop exact), and the spot checks are "
                            "drawn from these rounds' calls")
    stop_tolerance: float = Field(0.02, ge=0, description="stop also when the fastest round's speedup is within "
                                  "this share of the slowest's, thresholds inside or not (0: only a decided "
                                  "milestone stops)")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="the milestone thresholds the early stop "
                                 "decides against: give the RewardConfig the reward will be computed with")
