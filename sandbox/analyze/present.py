"""The analysis as text a model reads: short and ranked, the bottleneck first; every number stays in the model."""

from __future__ import annotations

from sandbox.analyze.result import AnalyzeResult, KernelAnalysis, TorchKernelRow


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def _kernel_line(k: KernelAnalysis) -> str:
    roof = k.roofline[0] if k.roofline else None
    parts = [f"{k.duration_us:.1f} us", f"grid {'x'.join(map(str, k.grid))} block {'x'.join(map(str, k.block))}"]
    if k.registers_per_thread is not None:
        parts.append(f"{k.registers_per_thread} regs")
    if k.shared_mem_per_block:
        parts.append(f"{k.shared_mem_per_block} B smem")
    parts.append(f"DRAM {_pct(k.dram_share)} of peak, SM {_pct(k.sm_share)}")
    if k.l1_hit is not None or k.l2_hit is not None:
        parts.append(f"L1 hit {_pct(k.l1_hit)}, L2 hit {_pct(k.l2_hit)}")
    if roof is not None and roof.intensity is not None and roof.flops > 0:
        parts.append(f"{roof.intensity:.3g} FLOP/B ({roof.precision}; ridge {roof.ridge:.3g}), "
                     f"{_pct(roof.share_of_roof)} of the roof")
    if k.achieved_occupancy is not None:
        parts.append(f"occupancy {_pct(k.achieved_occupancy)} of {_pct(k.theoretical_occupancy)}"
                     + (f" ({k.occupancy_limiter}-limited)" if k.occupancy_limiter and (k.theoretical_occupancy or 1) < 1
                        else ""))
    if k.load_sectors_per_request is not None:
        parts.append(f"{k.load_sectors_per_request:.1f} sectors/load request")
    if k.stalls:
        parts.append("stalls: " + ", ".join(f"{s.name} {s.share:.0%}" for s in k.stalls))
    return f"  [{k.verdict}] {k.name[:100]} ({k.share:.0%}): " + "; ".join(parts)


def _table(rows: list[TorchKernelRow], limit: int = 8) -> list[str]:
    return [f"  {r.total_us:10.1f} us  {r.calls:4d}x  {r.name[:100]}" for r in rows[:limit]]


def _compiled(r: AnalyzeResult) -> list[str]:
    if not r.compiled_kernels:
        return []
    return ["torch.compile's (the cached baseline's, torch profiler):", *_table(r.compiled_kernels, 3)]


def analyze_text(r: AnalyzeResult) -> str:
    head = f"analyze ({r.backend}, {r.device}{', ncu ' + r.ncu_version if r.ncu_version else ''}, {r.duration_s:.1f} s" \
           + (", cached" if r.cached else "") + ")"
    if r.reason is not None:
        return f"analyze FAILED [{r.reason}] ({r.duration_s:.1f} s): {r.message[:3000]}"
    if r.unavailable is not None:
        lines = [f"{head}: no hardware-counter analysis [{r.unavailable}]: {r.message[:1500]}"]
        if r.fallback:
            lines += ["torch profiler's table of ModelNew's forward instead:", *_table(r.fallback)]
        if r.fallback_eager:
            lines += ["and of the reference (eager):", *_table(r.fallback_eager, 4)]
        lines += _compiled(r)
        return "\n".join(lines)
    lines = [f"{head}: advice from Nsight Compute, not a timing (replayed kernels, caches flushed)"]
    lines += [f"{i}. {s}" for i, s in enumerate(r.summary, 1)]
    lines.append("ModelNew's kernels:")
    lines += [_kernel_line(k) for k in r.kernels[:3]]
    if r.eager_kernels:
        lines.append("eager's (what it competes with):")
        lines += [_kernel_line(k) for k in r.eager_kernels[:2]]
    lines += _compiled(r)
    if r.limits is not None and r.limits.truncated:
        lines.append(f"(stopped at {r.limits.max_kernels} kernels: later launches not analysed)")
    return "\n".join(lines)
