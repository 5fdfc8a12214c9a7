"""The analysis's result model, shared by the CLI, the MCP server and the harness (as sandbox/results.py's are).

Every number ncu gave is kept here; the short ranked text a model reads is sandbox.analyze.present's. Nothing in it
is a reward: ncu replays each kernel with its caches flushed, and its durations are not the profile's times.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from sandbox.results import Reason


class Unavailable(StrEnum):
    """Why the hardware-counter analysis could not run. Stable strings: agents and dashboards key on them."""

    cpu_backend = "cpu_backend"  # no GPU: nothing for ncu to read
    no_ncu = "no_ncu"  # Nsight Compute is not installed (or not on PATH / CUDA_AGENT_NCU)
    counter_permission = "counter_permission"  # ERR_NVGPUCTRPERM: the driver keeps the counters to admins
    ncu_failed = "ncu_failed"  # ncu ran and profiled nothing, or its output could not be read
    timeout = "timeout"  # the analysis ran past its limit and was killed


class StallReason(BaseModel):
    name: str = Field(description="ncu's stall name, e.g. long_scoreboard (waiting on a global load)")
    warps_per_issue: float = Field(description="warps stalled for this reason per issued instruction")
    share: float = Field(description="of all stalled warps, this reason's share (0-1)")


class Roofline(BaseModel):
    """Where a kernel sits against the device's roofline, at one precision."""

    precision: str = Field(description="fp32, fp16 or fp64: the non-tensor-core instructions counted")
    flops: float = Field(description="floating-point operations the kernel executed at this precision")
    dram_bytes: float = Field(description="bytes moved to and from DRAM")
    intensity: float | None = Field(None, description="FLOP per DRAM byte (None: no DRAM traffic)")
    peak_flops_per_s: float = Field(description="the device's peak at this precision, FLOP/s")
    peak_bytes_per_s: float = Field(description="the device's peak DRAM bandwidth, bytes/s")
    ridge: float = Field(description="the intensity where the roofs meet: peak FLOP/s over peak bytes/s")
    bound: str = Field(description="memory or compute: which roof is the lower at this intensity")
    attainable_flops_per_s: float = Field(description="the roof at this intensity: min(peak, intensity x bandwidth)")
    achieved_flops_per_s: float
    share_of_roof: float | None = Field(None, description="achieved over attainable (0-1)")
    ridge_distance: float | None = Field(None, description="intensity over ridge: below 1 memory-bound, the "
                                         "factor the intensity would have to grow by to reach the ridge is 1/this")


class KernelAnalysis(BaseModel):
    name: str = Field(description="the kernel's name as launched (demangled, shortened)")
    side: str = Field(description="candidate or eager")
    duration_us: float = Field(description="ncu's duration of one replay (caches flushed, clocks as found)")
    share: float = Field(description="of its side's profiled kernel time, this kernel's share (0-1)")
    grid: list[int] = Field(default_factory=list)
    block: list[int] = Field(default_factory=list)
    registers_per_thread: int | None = None
    shared_mem_per_block: int | None = Field(None, description="bytes, static plus dynamic")
    dram_bytes: float | None = None
    dram_bytes_per_s: float | None = None
    dram_share: float | None = Field(None, description="achieved DRAM bandwidth over the device's peak (0-1)")
    sm_share: float | None = Field(None, description="SM (compute) throughput as ncu's share of its peak (0-1)")
    memory_share: float | None = Field(None, description="the busiest memory unit's share of its peak (0-1)")
    l1_hit: float | None = Field(None, description="L1/TEX sector hit rate (0-1)")
    l2_hit: float | None = Field(None, description="L2 sector hit rate (0-1)")
    roofline: list[Roofline] = Field(default_factory=list, description="one per precision the kernel computed in "
                                     "(fp32 always)")
    achieved_occupancy: float | None = Field(None, description="active warps over the SM's maximum (0-1)")
    theoretical_occupancy: float | None = Field(None, description="the most this launch allows (0-1)")
    occupancy_limiter: str | None = Field(None, description="registers, shared_memory, block_size or blocks: "
                                          "what bounds the theoretical occupancy")
    waves: float | None = Field(None, description="waves of blocks per SM")
    load_sectors_per_request: float | None = Field(None, description="32-byte sectors per global load request: 4 "
                                                   "is ideal for 4-byte words (a warp reads 128 contiguous bytes)")
    store_sectors_per_request: float | None = None
    stalls: list[StallReason] = Field(default_factory=list, description="top warp stall reasons, largest first")
    verdict: str | None = Field(None, description="memory-bound, compute-bound or latency-bound (sandbox.analyze.rules)")
    load_efficiency: float | None = Field(None, description="of the bytes each global load's sectors bring, the share "
                                          "the threads asked for (0-1): 1 is perfectly coalesced")
    bottleneck: list[str] = Field(default_factory=list, description="ranked sentences, most important first")
    metrics: dict[str, float] = Field(default_factory=dict, description="every raw ncu metric read for it")


class TorchKernelRow(BaseModel):
    name: str
    total_us: float
    calls: int


class AnalyzeLimits(BaseModel):
    """What bounded the analysis (so a reader knows what it did not look at)."""

    max_kernels: int = Field(description="kernels ncu profiled at most (--launch-count), both sides together")
    replay_mode: str
    sections: list[str]
    timeout_s: float
    truncated: bool = Field(False, description="the limit on kernels was reached: later kernels were not profiled")


class AnalyzeResult(BaseModel):
    ok: bool
    reason: Reason | None = Field(None, description="the candidate's failure (not_compiled, import_error, ...)")
    unavailable: Unavailable | None = Field(None, description="why no hardware-counter analysis was made; "
                                            "fallback then holds the torch profiler's table where it could run")
    message: str = ""
    backend: str
    device: str | None = None
    ncu_version: str | None = None
    summary: list[str] = Field(default_factory=list, description="the bottleneck sentences of the top kernels, "
                               "ranked: what to change first")
    kernels: list[KernelAnalysis] = Field(default_factory=list, description="the candidate's kernels by time, "
                                          "largest first")
    eager_kernels: list[KernelAnalysis] = Field(default_factory=list, description="the reference's (PyTorch "
                                                "eager's) kernels of the same forward, largest first")
    fallback: list[TorchKernelRow] = Field(default_factory=list, description="torch.profiler's table of the "
                                           "candidate's forward, where ncu could not run")
    fallback_eager: list[TorchKernelRow] = Field(default_factory=list)
    compiled_kernels: list[TorchKernelRow] = Field(default_factory=list, description="torch.compile's top kernels "
                                                   "of the task (torch profiler), from the cached baseline where a "
                                                   "profile measured one on this device; empty until then")
    limits: AnalyzeLimits | None = None
    cached: bool = Field(False, description="the result of an earlier analysis of the same build and task")
    key: str | None = Field(None, description="the cache key: build content, task, device, settings")
    sandbox_notes: list[str] = Field(default_factory=list, description="confinement of the analysed process")
    duration_s: float
    restored_files: list[str] = Field(default_factory=list)
