"""The bottleneck rules: from a kernel's numbers to one to three sentences an agent can act on, most important first.

First what bounds the kernel (memory, compute or latency: where it sits on the roofline and how close each unit is
to its peak), then the cause the counters point at (uncoalesced accesses, the occupancy limiter, the stall warps
spend most time in), each with what it usually asks of the code. Thresholds are judgement, written down once here.
"""

from __future__ import annotations

from sandbox.analyze.result import KernelAnalysis

TINY_S = 5e-6  # a kernel this short is dominated by its launch and ramp-up
BUSY = 0.6  # a unit at this share of its peak is the one that bounds the kernel
IDLE = 0.25  # both memory and compute below this: the kernel waits (latency-bound)
POOR_EFFICIENCY = 0.6  # of each fetched sector's bytes, fewer used than this: uncoalesced
LOW_OCCUPANCY = 0.35
STALL_SHARE = 0.3  # a stall reason this large a share of all waits is worth naming

STALL_ADVICE = {
    "long_scoreboard": "waiting on global-memory loads: reuse data through shared memory or registers, and keep "
                       "more loads in flight (more warps, or several independent loads per thread)",
    "short_scoreboard": "waiting on shared memory or special functions: look for bank conflicts and "
                        "transcendental-heavy inner loops",
    "mio_throttle": "the shared-memory/special-function queue is full: fewer, wider shared accesses",
    "lg_throttle": "the global load/store queue is full: vectorise (float4) so fewer instructions move the bytes",
    "math_pipe_throttle": "the arithmetic pipes are saturated: use cheaper instructions (FMA, fast-math "
                          "intrinsics) or tensor cores",
    "barrier": "waiting at __syncthreads: balance the work between barriers, or use fewer of them",
    "membar": "waiting on memory fences: drop fences (and atomics) the algorithm does not need",
    "wait": "waiting on fixed-latency dependencies: interleave independent instructions (unroll)",
    "branch_resolving": "resolving branches: make control flow uniform across the warp",
    "no_instruction": "the instruction cache misses: a smaller kernel body, less unrolling",
    "tex_throttle": "the texture pipe is full: fewer texture/LDG.NC reads per thread",
    "dispatch_stall": "the dispatcher stalls: often register-bank or pipe contention",
    "drain": "draining stores at exit: normal for store-heavy kernels",
    "imc_miss": "constant-cache misses: keep constants warp-uniform",
    "sleeping": "threads sleep (nanosleep or a spin-wait)",
}


def verdict(a: KernelAnalysis) -> str:
    """memory-bound (DRAM: the roofline's memory roof), compute-bound (the SM's pipes, the load/store pipe
    included) or latency-bound (neither near its peak)."""
    dram = a.dram_share or 0.0
    mem = max(dram, a.memory_share or 0.0)
    sm = a.sm_share or 0.0
    roof = a.roofline[0] if a.roofline else None
    if a.duration_us * 1e-6 < TINY_S and mem < IDLE and sm < IDLE:
        return "latency-bound"
    if dram >= BUSY and dram >= sm:
        return "memory-bound"
    if sm >= BUSY:
        return "compute-bound"
    if mem < IDLE and sm < IDLE:
        return "latency-bound"
    # in between: the roofline says which roof the kernel would reach first, where it counted the kernel's arithmetic
    # (tensor-core work is not in ncu's per-instruction counts: a GEMM on tensor cores counts no FLOP); else the
    # busier of the memory system and the SM
    if roof is not None and roof.flops > 0:
        return "memory-bound" if roof.bound == "memory" else "compute-bound"
    return "memory-bound" if mem >= sm else "compute-bound"


def _gbs(x: float | None) -> str:
    return "?" if x is None else f"{x / 1e9:,.0f}"


def _headline(a: KernelAnalysis, kind: str) -> str:
    roof = a.roofline[0] if a.roofline else None
    place = ""
    if roof is not None and roof.intensity is not None and roof.flops > 0:
        place = f"; {roof.intensity:.2g} FLOP/byte against a ridge at {roof.ridge:.3g}"
    if kind == "memory-bound":
        peak = roof.peak_bytes_per_s if roof else None
        return (f"memory-bound at {a.dram_share or 0:.0%} of peak DRAM bandwidth ({_gbs(a.dram_bytes_per_s)} of "
                f"{_gbs(peak)} GB/s{place})")
    if kind == "compute-bound":
        fp = f", {roof.share_of_roof:.0%} of the {roof.precision} roof" if roof and roof.share_of_roof else ""
        return f"compute-bound: SM throughput at {a.sm_share or 0:.0%} of peak{fp}{place}"
    tiny = a.duration_us * 1e-6 < TINY_S
    return (f"latency-bound: {a.duration_us:.1f} us, DRAM at {a.dram_share or 0:.0%} and SM at {a.sm_share or 0:.0%} "
            "of peak" + ("; a launch this short is mostly overhead: fuse it with its neighbours or give each thread "
                         "more work" if tiny else ": too little work in flight to hide latency"))


def _coalescing(a: KernelAnalysis) -> str | None:
    spr, eff = a.load_sectors_per_request, a.load_efficiency
    if spr is None or eff is None or eff >= POOR_EFFICIENCY:
        return None
    ideal = max(1.0, round(spr * eff))
    return (f"loads are uncoalesced: {spr:.1f} sectors per request against {ideal:.0f} ideal ({eff:.0%} of each "
            "32-byte sector used): make consecutive threads touch consecutive addresses (transpose through "
            "shared memory if the access is strided)")


def _occupancy(a: KernelAnalysis) -> str | None:
    ach, theo = a.achieved_occupancy, a.theoretical_occupancy
    if ach is None or theo is None or ach >= LOW_OCCUPANCY:
        return None
    if theo < LOW_OCCUPANCY * 1.5 and a.occupancy_limiter in ("registers", "shared_memory", "block_size"):
        detail = {"registers": f"{a.registers_per_thread} registers per thread: cap them (__launch_bounds__) or "
                               "hold less per thread",
                  "shared_memory": f"{a.shared_mem_per_block} bytes of shared memory per block: smaller tiles",
                  "block_size": f"blocks of {_threads(a)} threads: use 128-256 threads per block"}[a.occupancy_limiter]
        return f"occupancy {ach:.0%} (at most {theo:.0%}) limited by {detail}"
    if a.waves is not None and a.waves < 1:
        return (f"occupancy {ach:.0%} of {theo:.0%} possible: the grid fills {a.waves:.2f} of one wave; launch more "
                "blocks (split the work finer) so every SM has warps")
    return None


def _threads(a: KernelAnalysis) -> int:
    n = 1
    for d in a.block or [0]:
        n *= d
    return n


def _stall(a: KernelAnalysis) -> str | None:
    if not a.stalls or a.stalls[0].share < STALL_SHARE:
        return None
    s = a.stalls[0]
    advice = STALL_ADVICE.get(s.name, "")
    return f"warps stall mostly on {s.name} ({s.share:.0%} of stalls)" + (f": {advice}" if advice else "")


def bottleneck(a: KernelAnalysis, limit: int = 3) -> tuple[str, list[str]]:
    """(verdict, the ranked sentences)."""
    kind = verdict(a)
    found = [_headline(a, kind)]
    causes = [_coalescing(a), _occupancy(a), _stall(a)]
    if kind == "compute-bound":  # a compute-bound kernel's stall says more than its memory accesses
        causes = [causes[2], causes[1], causes[0]]
    found += [c for c in causes if c]
    return kind, found[:limit]


def apply(a: KernelAnalysis) -> KernelAnalysis:
    a.verdict, a.bottleneck = bottleneck(a)
    return a
