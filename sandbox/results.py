"""Result models shared by the CLI, the MCP server and the harness.

Each operation computes its result once, here-typed; front ends only present it.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class Reason(StrEnum):
    """Why an operation failed. Stable strings: agents and dashboards key on them."""

    compile_error = "compile_error"
    compile_timeout = "compile_timeout"
    not_compiled = "not_compiled"
    protected_file_tampered = "protected_file_tampered"
    import_error = "import_error"
    init_error = "init_error"
    state_dict_mismatch = "state_dict_mismatch"
    runtime_error = "runtime_error"
    cuda_error = "cuda_error"
    crash = "crash"
    timeout = "timeout"
    oom = "oom"
    output_structure = "output_structure"
    output_type = "output_type"
    shape_mismatch = "shape_mismatch"
    dtype_mismatch = "dtype_mismatch"
    device_mismatch = "device_mismatch"
    value_mismatch = "value_mismatch"
    nan_inf_mismatch = "nan_inf_mismatch"
    input_mutated = "input_mutated"
    torch_op_used = "torch_op_used"
    delegation = "delegation"
    forbidden_construct = "forbidden_construct"
    global_state_changed = "global_state_changed"
    background_work = "background_work"
    no_kernel_launched = "no_kernel_launched"
    dispatch_tampered = "dispatch_tampered"
    audit_tampered = "audit_tampered"
    host_round_trip = "host_round_trip"
    nondeterministic_output = "nondeterministic_output"
    async_work = "async_work"
    timer_tampered = "timer_tampered"
    impossible_speed = "impossible_speed"
    spot_check_failed = "spot_check_failed"
    timing_unverified = "timing_unverified"
    timing_noisy = "timing_noisy"
    forbidden_symbol = "forbidden_symbol"
    resource_limit = "resource_limit"
    reference_error = "reference_error"
    reference_oom = "reference_oom"
    nondeterministic_reference = "nondeterministic_reference"
    internal_error = "internal_error"


# Verdicts that mean the candidate cheated (or tried to), as opposed to failing innocently. The reward
# layer turns any of these, from verify or profile, into the failed milestone: caught cheating must cost.
INTEGRITY_REASONS: frozenset[Reason] = frozenset({
    Reason.protected_file_tampered, Reason.torch_op_used, Reason.delegation, Reason.forbidden_construct,
    Reason.global_state_changed, Reason.background_work, Reason.dispatch_tampered, Reason.async_work,
    Reason.timer_tampered, Reason.impossible_speed, Reason.spot_check_failed, Reason.timing_unverified,
    Reason.forbidden_symbol, Reason.audit_tampered, Reason.host_round_trip,
})


# Verify verdicts about the task, not the candidate: the task's own code ran out of memory with the device to itself
# and no candidate process beside it (sandbox/correctness/oom.py). The reward layer gives them RewardConfig.unjudged,
# never the failed reward: the policy is not told that a kernel was wrong when the task could not be run.
UNJUDGED_REASONS: frozenset[Reason] = frozenset({Reason.reference_oom})


class Diagnostic(BaseModel):
    file: str | None = None
    line: int | None = None
    column: int | None = None
    severity: str = Field(description="error, warning or note")
    message: str


class CompileResult(BaseModel):
    ok: bool
    reason: Reason | None = None
    message: str = ""
    backend: str
    duration_s: float
    up_to_date: bool = Field(False, description="nothing needed rebuilding")
    rebuilt: list[str] = Field(default_factory=list, description="sources that were recompiled")
    reused: list[str] = Field(default_factory=list, description="of the rebuilt sources, those whose object an "
                              "identical earlier compile made (the judge's object cache)")
    steps: dict[str, float] = Field(default_factory=dict, description="seconds each step of this build took: "
                                    "a source's compile (by its path) or 'link'")
    cpu_s: float | None = Field(None, description="CPU seconds this build's processes used (the compilers, the "
                                "linker, their launchers), summed over cores; None where they could not be read")
    full_bindings: list[str] = Field(default_factory=list, description="of the rebuilt .cpp sources, those that did "
                                     "not compile against binding_registry.h's thin stand-in for pybind11 and were "
                                     "compiled against the pybind11 header (slower; docs/judge.md)")
    diagnostics: list[Diagnostic] = Field(default_factory=list)
    log_tail: str = ""
    log_path: str | None = None
    restored_files: list[str] = Field(default_factory=list)


class TensorCheck(BaseModel):
    """One leaf of the output structure, compared with the reference."""

    path: str = Field(description="where in the output, e.g. 'out' or 'out[1]'")
    ok: bool
    shape: list[int] | None = None
    dtype: str | None = None
    numel: int = 0
    mismatched: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    rel_error_norm: float | None = None
    first_mismatch_index: list[int] | None = None
    expected_value: float | None = None
    actual_value: float | None = None
    message: str = ""


class TrialResult(BaseModel):
    seed: int
    variant: str = Field("original", description="input distribution: original, or signed (4x - 2)")
    skipped: bool = Field(False, description="the reference is not finite on this distribution")
    ok: bool
    reason: Reason | None = None
    message: str = ""
    outputs: list[TensorCheck] = Field(default_factory=list)


class TrialTimeout(BaseModel):
    """The time verify gave the candidate on an input set (sandbox/correctness/trial_timeout.py)."""
    seconds: float
    rule: str = Field(description="relative (factor x the reference's time), floor, or cap (the trial timeout)")
    reference_s: float | None = Field(None, description="the reference's slowest input set so far")
    cap_s: float
    floor_s: float
    factor: float


class VerifyResult(BaseModel):
    ok: bool
    reason: Reason | None = None
    message: str = ""
    backend: str
    device: str | None = None
    trials: list[TrialResult] = Field(default_factory=list)
    torch_ops: list[str] = Field(default_factory=list, description="PyTorch compute ops the candidate dispatched")
    atol: float
    rtol: float
    duration_s: float
    phases: dict[str, float] = Field(default_factory=dict, description="seconds spent per phase")
    sandbox_notes: list[str] = Field(default_factory=list, description="isolation the judge could not apply here")
    generalization: TrialResult | None = Field(None, description="the optional check on other input sizes; it does "
                                               "not change ok")
    shape_overrides: dict[str, int] = Field(default_factory=dict)
    restored_files: list[str] = Field(default_factory=list)
    trial_timeout: TrialTimeout | None = Field(None, description="the candidate's timeout on the last input set run, "
                                               "and the rule that set it")


class BatchWall(BaseModel):
    calls: int
    wall_ms: float = Field(description="the judge's clock around the batch request")
    reported_mean_ms: float = Field(description="the mean of the per-call times the timer reported for it")
    reported_median_ms: float | None = Field(None, description="their median")
    ms: float | None = Field(None, description="a paired round's time for this batch: by the judge's clock for a "
                             "stream of calls, else the reported median")
    stream: bool = Field(False, description="the calls ran back to back on inputs drawn ahead, one synchronize at "
                         "the end (CUDA); scored by the judge's clock")
    implied_ms: float | None = Field(None, description="(wall - round trip)/calls - calibrated overhead: a lower "
                                     "bound on the real per-call time")
    allowed_ms: float | None = Field(None, description="how far implied may exceed reported")
    waited: float | None = Field(None, description="the share of its runnable time the timed process's threads spent "
                                 "waiting for a core during the batch (the kernel's run-queue delay, read by the judge; "
                                 "CPU backend): what other work on the machine took from it")


class TimingBound(BaseModel):
    """The judge's external bound on the candidate's reported times (sandbox/timing/timing_bound.py)."""
    ok: bool
    round_trip_ms: float = Field(description="a: the empty request's round trip, the smaller of the candidate's "
                                 "and the reference's")
    overhead_per_call_ms: float = Field(description="o: the harness's per-call work, calibrated on eager (on CUDA "
                                        "under the candidate's kernel-audit profiler)")
    batches: list[BatchWall]
    batch_excess_ms: float = Field(description="the best batch's implied - reported - allowed (<= 0 passes)")
    implied_ms: float = Field(description="the per-call time all batches together imply")
    aggregate_excess_ms: float = Field(description="the same over all batches, with the looser tolerance")
    max_forgery_factor: float | None = Field(None, description="how much faster than real a forgery could look and "
                                             "still pass this run's best batch (None: unbounded)")
    recalibrated: bool = Field(False, description="the first timing failed against the cached calibration: eager was "
                               "re-timed before and after a second timing of the candidate (its processes stopped "
                               "meanwhile), and this is the second timing against the larger calibration")


class Timing(BaseModel):
    median_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    trials: int
    input_sets: int
    retimed: int = Field(0, description="repeats of this measurement because its IQR was a large share of the median")
    round_trip_ms: float | None = Field(None, description="the judge's clock around an empty batch request "
                                        "(the fixed cost of one request)")
    batches: list[BatchWall] = Field(default_factory=list, description="the timed calls' batches, each timed "
                                     "by the judge's own clock outside the process that ran the model")


class PairedRound(BaseModel):
    """One candidate batch between two eager batches, timed back to back in the same session."""
    eager_before_ms: float = Field(description="the median call of the eager batch before it")
    candidate_ms: float = Field(description="the median call of the candidate's batch")
    eager_after_ms: float = Field(description="the median call of the eager batch after it")
    speedup: float | None = Field(None, description="the mean of the two eager medians over the candidate's")
    counted: bool = Field(True, description="whether the speedups count this round: on CUDA a round whose two eager "
                          "batches disagree by more than noise_max_spread is left out (the machine moved inside it), "
                          "and the profile is noisy only when fewer undisturbed rounds remain than min_rounds")


class PairedTiming(BaseModel):
    """How the speedups were measured: eager and ModelNew alternating on the device (docs/judge.md, "Paired
    timings"), and what still comes from the cached baseline."""
    rounds: list[PairedRound]
    eager_spread: float = Field(description="the slowest eager batch's median over the fastest's: how far the "
                                "machine moved during the rounds; on CUDA, of two consecutive eager batches (the two "
                                "either side of a round: sandbox.timing.paired.spread_is_local)")
    noisy: bool = Field(description="no speedup is scored: eager_spread above ProfileConfig.noise_max_spread (on "
                        "CUDA: in so many rounds that fewer than min_rounds undisturbed ones remain), or eager slower "
                        "than the baseline by more than baseline_max_drift (the machine is loaded now)")
    disturbed_rounds: int = Field(0, description="rounds left out of the speedups (PairedRound.counted)")
    attempts: int = Field(1, description="pairings run: a second when the first was noisy or failed the bound")
    paired_again_for: list[str] = Field(default_factory=list, description="why each pairing before the last was "
                                        "run again: the noise rule's message, or 'timing bound' (its batches took "
                                        "longer by the judge's clock than reported)")
    max_rounds: int | None = Field(None, description="the rounds a pairing may run (timing_batches)")
    min_rounds: int | None = Field(None, description="the rounds the first pairing runs before it may stop early "
                                   "(a majority of max_rounds; the spot checks are drawn from them)")
    stopped: str | None = Field(None, description="why the last pairing's rounds ended: 'decided' (no milestone "
                                "threshold inside the rounds' speedups: more rounds could not change the milestone), "
                                "'tight' (the rounds agreed within stop_tolerance), 'noisy' (eager's rounds already "
                                "disagreed beyond noise_max_spread), 'max_rounds' (the full budget; re-pairings always "
                                "run it)")
    stop_thresholds: list[tuple[float | None, float | None]] = Field(
        default_factory=list, description="the milestone thresholds on the speedup-over-eager scale the early stop "
        "decided against, each as a range (torch.compile's through the baseline's ratio and its quartiles); None: "
        "beyond any speedup (a ratio of 0)")
    baseline_eager_ms: float = Field(description="the cached baseline's eager median, measured beside its "
                                     "torch.compile time")
    baseline_compiled_ms: float | None = Field(None, description="the cached baseline's torch.compile median")
    compile_ratio: float | None = Field(None, description="torch.compile over eager in the baseline, what "
                                        "speedup_vs_compile is speedup_vs_eager times: over the mean of the eager "
                                        "timings either side of torch.compile's (baseline.compile_timed)")
    eager_drift: float = Field(description="the paired eager median over the cached baseline's")
    baseline_age_s: float | None = Field(None, description="how old the cached baseline is (None: unknown)")
    baseline_retimed: str | None = Field(None, description="why this profile measured the baseline again: "
                                         "'age' (older than baseline_max_age_s), 'drift' (eager faster now "
                                         "than the baseline by more than baseline_max_drift: it was measured under "
                                         "load) or 'compile' (its torch.compile figure was noisy and a milestone "
                                         "rested on it)")
    load_factor: float | None = Field(None, description="how far the machine's load could have moved a round's speedup: "
                                      "the largest over the rounds of (1 - candidate's waited) / (1 - eager's), or its "
                                      "inverse (CPU backend; None where not read); above noise_max_spread: noisy")
    rounds_spread: float | None = Field(None, description="the fastest counted round's speedup over the slowest's")
    waited: tuple[float, float] | None = Field(None, description="eager's and the candidate's mean share of runnable "
                                               "time spent waiting for a core over their batches (CPU backend)")


class KernelStat(BaseModel):
    name: str
    total_ms: float
    calls: int
    percent: float


class ProfilerCost(BaseModel):
    """What the profiler itself cost while it measured top_kernels (their times include it)."""
    calls: int
    plain_ms_per_call: float = Field(description="wall time of the same calls without the profiler")
    profiled_ms_per_call: float = Field(description="wall time of each call under the profiler")
    rows_ms_per_call: float = Field(description="all profiled rows' times summed, per call")
    overhead_factor: float | None = Field(None, description="profiled_ms_per_call / plain_ms_per_call")


class ProfileResult(BaseModel):
    ok: bool
    reason: Reason | None = None
    message: str = ""
    backend: str
    device: str | None = None
    torch_version: str | None = None
    compile_mode: str
    eager: Timing | None = Field(None, description="eager, timed in this profile in rounds alternating with "
                                 "ModelNew's (all its batches pooled)")
    compiled: Timing | None = Field(None, description="torch.compile, estimated for now: the cached baseline's "
                                    "timing scaled by the paired eager over the baseline's eager (not re-timed; "
                                    "see paired)")
    candidate: Timing | None = None
    speedup_vs_eager: float | None = Field(None, description="the median over the paired rounds of eager (the "
                                           "mean of the batches either side) over ModelNew")
    speedup_vs_compile: float | None = Field(None, description="speedup_vs_eager times the cached baseline's "
                                             "torch.compile/eager ratio")
    speedup_vs_eager_range: tuple[float, float] | None = Field(
        None, description="the slowest and fastest paired round's speedup")
    speedup_vs_compile_range: tuple[float, float] | None = Field(
        None, description="speedup_vs_eager_range times the baseline ratio's range (its quartiles)")
    speedup_vs_eager_ci: tuple[float, float] | None = Field(
        None, description="the median speedup's confidence interval from the counted rounds, at "
        "RewardConfig.speedup_confidence (one-sided at each end): faster_than_eager needs its lower end above the margin")
    speedup_vs_compile_ci: tuple[float, float] | None = Field(
        None, description="speedup_vs_eager_ci times the baseline ratio's range: faster_than_compile needs its lower end "
        "above the margin")
    paired: PairedTiming | None = Field(None, description="the paired rounds the speedups come from")
    launch_bound: bool | None = Field(None, description="eager time below the configured floor: the baselines time "
                                      "launch and guard overhead, so torch.compile's is not a fair bar")
    top_kernels: list[KernelStat] = Field(default_factory=list)
    profiler: ProfilerCost | None = Field(None, description="the profiler's own cost, when top_kernels were "
                                          "measured in separate profiled calls (the CPU backend)")
    baseline_cached: bool = False
    compile_error: str | None = Field(None, description="why torch.compile of the reference failed, if it did")
    compile_noise: str | None = Field(None, description="why the baseline's torch.compile figure cannot carry a "
                                      "milestone (baseline.compile_noise), where the profile kept it unverified: no "
                                      "milestone was in reach by its ProfileConfig.reward; faster_than_compile is then "
                                      "withheld whatever RewardConfig the reward is computed with")
    checks: dict = Field(default_factory=dict, description="what the judge checked on the timed calls")
    sandbox_notes: list[str] = Field(default_factory=list, description="confinement of the candidate's timer")
    queued_s: float = Field(0.0, description="seconds waited for the device (other judgments' timing or verify)")
    timing_core: int | None = Field(None, description="the CPU core eager's and the candidate's processes were held "
                                    "to while timed (CUDA; None: not held)")
    exclusive_s: float | None = Field(None, description="seconds this profile held the device to itself (the "
                                      "paired timing and the top kernels; the spot checks run after, beside "
                                      "other judgments' verifies)")
    phases: dict[str, float] = Field(default_factory=dict, description="seconds per phase: baseline (cache lookup or "
                                     "timing), setup_queued (the shared device lock), setup (workers ready, extension loaded, models built), queued (the "
                                     "device lock), timing (the paired rounds), kernels, spot_checks (the lock "
                                     "stepped down to shared), audit (CUDA: the kernel audits, the device let go), "
                                     "teardown; ahead (the first pairing's untimed start: both sides' warm-up and first inputs, under the shared "
                                     "lock before the queue; inside timing: timing_ahead, timing_pauses_ahead); and from asking for each worker to its "
                                     "being ready (timer_wait, eager_wait, worker_wait: the longest); inside timing: "
                                     "timing_begin (timing_begin_profiler: the audit's profilers started), timing_batches "
                                     "(timing_batches_clock: the batches' own clock), "
                                     "timing_end, timing_pauses (stopping the other side), timing_recalibrate "
                                     "(a re-pairing's calibrations); inside spot_checks: spot_checks_run (the "
                                     "reference run again), spot_checks_fetch (copies from host memory), "
                                     "spot_checks_compare (spot_checks_open: of it, opening the exported copies)")
    timing_bound: TimingBound | None = Field(None, description="the judge's own clock's bound on the candidate's "
                                             "reported times")
    duration_s: float
    restored_files: list[str] = Field(default_factory=list)


class RewardResult(BaseModel):
    reward: float
    milestone: str = Field(description="failed, correct, faster_than_eager or faster_than_compile")
    compiled: bool
    correct: bool
    reason: Reason | None = Field(None, description="why the milestone is failed: the compile or verify reason, or "
                                  "the integrity reason profile caught; timing_noisy when it stops at correct "
                                  "because the machine was too noisy to time a speedup")
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    launch_bound: bool | None = None


class TaskInfo(BaseModel):
    id: str
    name: str
    sha256: str
    path: str | None = None


class InitResult(BaseModel):
    ok: bool
    workdir: str
    task: TaskInfo
    backend: str
    files: list[str]
