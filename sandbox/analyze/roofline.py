"""From one kernel's raw ncu metrics to the numbers an engineer reads: bandwidth and its share of peak, the roofline
at each precision, occupancy and its limiter, memory access efficiency, the top stall reasons.

The device's peaks come from ncu's own peak metrics where it reported them (the per-cycle peak of the unit, summed
over the device, times the clock it ran at), and otherwise from a small table of datasheet figures keyed by the
device's name; the table is a fallback, the counters the authority.
"""

from __future__ import annotations

import re

from sandbox.analyze.ncu_csv import NcuKernel
from sandbox.analyze.result import KernelAnalysis, Roofline, StallReason

# datasheet peaks (dense, non-tensor-core FP32 and FP16; DRAM bytes/s), by a fragment of the device's name, most
# specific first: where ncu did not report its own peak metrics
DEVICE_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"dram": 4.8e12, "fp32": 67e12, "fp16": 134e12, "fp64": 34e12, "bf16_tensor": 989e12}),
    ("H100 PCIe", {"dram": 2.0e12, "fp32": 51e12, "fp16": 102e12, "fp64": 26e12, "bf16_tensor": 756e12}),
    ("H100 NVL", {"dram": 3.9e12, "fp32": 60e12, "fp16": 120e12, "fp64": 30e12, "bf16_tensor": 835e12}),
    ("H100", {"dram": 3.35e12, "fp32": 67e12, "fp16": 134e12, "fp64": 34e12, "bf16_tensor": 989e12}),
    ("A100-SXM4-80GB", {"dram": 2.039e12, "fp32": 19.5e12, "fp16": 78e12, "fp64": 9.7e12, "bf16_tensor": 312e12}),
    ("A100", {"dram": 1.555e12, "fp32": 19.5e12, "fp16": 78e12, "fp64": 9.7e12, "bf16_tensor": 312e12}),
    ("L40S", {"dram": 0.864e12, "fp32": 91.6e12, "fp16": 91.6e12, "fp64": 1.4e12, "bf16_tensor": 362e12}),
]

PRECISIONS = {"fp32": "f", "fp16": "h", "fp64": "d"}
_OP = "sm__sass_thread_inst_executed_op_{p}{op}_pred_on.sum"
CLOCK = "sm__cycles_elapsed.avg.per_second"
DRAM_CLOCK = "dram__cycles_elapsed.avg.per_second"
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# stalls that are the scheduler's bookkeeping, not a wait a kernel can remove
NOT_A_WAIT = {"selected", "not_selected"}
OCCUPANCY_LIMITS = {"launch__occupancy_limit_registers": "registers",
                    "launch__occupancy_limit_shared_mem": "shared_memory",
                    "launch__occupancy_limit_warps": "block_size", "launch__occupancy_limit_blocks": "blocks"}


def table_peaks(device: str | None) -> dict[str, float] | None:
    for fragment, peaks in DEVICE_PEAKS:
        if device and fragment.lower() in device.lower():
            return peaks
    return None


def peaks(k: NcuKernel, device: str | None) -> dict[str, float]:
    """The device's peaks for this kernel's run: ncu's (peak per cycle x clock) where reported, else the table's.
    Keys: dram (bytes/s) and each precision (FLOP/s); missing where neither source has it."""
    out: dict[str, float] = dict(table_peaks(device) or {})
    clock = k.get(CLOCK)
    for prec, p in PRECISIONS.items():
        per_cycle = k.get(_OP.format(p=p, op="fma") + ".peak_sustained")
        if clock and per_cycle:
            out[prec] = 2 * per_cycle * clock  # an FMA is two operations
    dram_per_cycle, dram_clock = k.get("dram__bytes.sum.peak_sustained"), k.get(DRAM_CLOCK)
    if dram_per_cycle and dram_clock:
        out["dram"] = dram_per_cycle * dram_clock
    return out


def flops(k: NcuKernel, p: str) -> float:
    fma, add, mul = (k.get(_OP.format(p=p, op=op)) or 0.0 for op in ("fma", "add", "mul"))
    return 2 * fma + add + mul


def dram_bytes(k: NcuKernel) -> float | None:
    total = k.get("dram__bytes.sum")
    if total is None:
        rd, wr = k.get("dram__bytes_read.sum"), k.get("dram__bytes_write.sum")
        total = (rd or 0.0) + (wr or 0.0) if rd is not None or wr is not None else None
    return total


def roofline(k: NcuKernel, pk: dict[str, float], duration_s: float) -> list[Roofline]:
    """One roofline per precision the kernel computed in (fp32 always, where the peaks are known)."""
    moved = dram_bytes(k)
    bw = pk.get("dram")
    out = []
    for prec, p in PRECISIONS.items():
        work, peak = flops(k, p), pk.get(prec)
        if peak is None or bw is None or moved is None or (work == 0 and prec != "fp32"):
            continue
        ridge = peak / bw
        intensity = work / moved if moved > 0 else None
        attainable = peak if intensity is None else min(peak, intensity * bw)
        achieved = work / duration_s if duration_s > 0 else 0.0
        out.append(Roofline(precision=prec, flops=work, dram_bytes=moved, intensity=intensity, peak_flops_per_s=peak,
                            peak_bytes_per_s=bw, ridge=ridge,
                            bound="compute" if intensity is None or intensity >= ridge else "memory",
                            attainable_flops_per_s=attainable, achieved_flops_per_s=achieved,
                            share_of_roof=achieved / attainable if attainable > 0 else None,
                            ridge_distance=intensity / ridge if intensity is not None else None))
    return out


def stalls(k: NcuKernel, top: int = 3) -> list[StallReason]:
    found = {m.group(1): v for name, v in k.metrics.items() if (m := STALL.match(name)) and v > 0}
    waits = {n: v for n, v in found.items() if n not in NOT_A_WAIT}
    total = sum(waits.values())
    ranked = sorted(waits.items(), key=lambda kv: -kv[1])[:top]
    return [StallReason(name=n, warps_per_issue=v, share=v / total if total else 0.0) for n, v in ranked]


def _pct(k: NcuKernel, *names: str) -> float | None:
    v = k.get(*names)
    return None if v is None else v / 100.0


def limiter(k: NcuKernel) -> str | None:
    """What bounds the theoretical occupancy: the launch limit with the fewest blocks per SM."""
    limits = {why: v for name, why in OCCUPANCY_LIMITS.items() if (v := k.get(name)) is not None}
    if not limits:
        return None
    lowest = min(limits.values())
    # ties: registers and shared memory are what code can change; name them before the hardware's block cap
    for why in ("registers", "shared_memory", "block_size", "blocks"):
        if limits.get(why) == lowest:
            return why
    return None


def dram_share(k: NcuKernel, bw: float | None, pk: dict[str, float]) -> float | None:
    """Achieved DRAM bandwidth over the peak. ncu's own percentage of peak where it reported one: it is computed from
    the same counters without our unit conversions, and on the H200 the figure derived from bytes, duration and the
    peak per cycle read about 1e-9 for a coalesced copy near peak (the units of one column taken wrongly); the
    derived figure only where ncu gave no percentage."""
    own = _pct(k, "dram__throughput.avg.pct_of_peak_sustained_elapsed",
               "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
    if own is not None:
        return own
    return bw / pk["dram"] if bw is not None and pk.get("dram") else None


def _per_request(k: NcuKernel, op: str) -> float | None:
    sectors = k.get(f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum")
    requests = k.get(f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum")
    return sectors / requests if sectors is not None and requests else None


def analyse(k: NcuKernel, side: str, device: str | None, side_total_s: float) -> KernelAnalysis:
    """Every number for one kernel; the bottleneck sentences are sandbox.analyze.rules'."""
    duration = k.get("gpu__time_duration.sum") or 0.0
    pk = peaks(k, device)
    moved = dram_bytes(k)
    bw = moved / duration if moved is not None and duration > 0 else k.get("dram__bytes.sum.per_second")
    smem = [v for v in (k.get("launch__shared_mem_per_block_static"), k.get("launch__shared_mem_per_block_dynamic"))
            if v is not None]
    regs = k.get("launch__registers_per_thread")
    return KernelAnalysis(
        name=short_name(k.name), side=side, duration_us=duration * 1e6,
        share=duration / side_total_s if side_total_s > 0 else 0.0, grid=k.grid, block=k.block,
        registers_per_thread=int(regs) if regs is not None else None,
        shared_mem_per_block=int(sum(smem)) if smem else None, dram_bytes=moved, dram_bytes_per_s=bw,
        dram_share=dram_share(k, bw, pk),
        sm_share=_pct(k, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        memory_share=_pct(k, "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
        l1_hit=_pct(k, "l1tex__t_sector_hit_rate.pct"), l2_hit=_pct(k, "lts__t_sector_hit_rate.pct"),
        roofline=roofline(k, pk, duration),
        achieved_occupancy=_pct(k, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        theoretical_occupancy=_pct(k, "sm__maximum_warps_per_active_cycle_pct"), occupancy_limiter=limiter(k),
        waves=k.get("launch__waves_per_multiprocessor"),
        load_sectors_per_request=_per_request(k, "ld"), store_sectors_per_request=_per_request(k, "st"),
        load_efficiency=_pct(k, "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct"),
        stalls=stalls(k), metrics=dict(k.metrics))


def short_name(name: str, limit: int = 160) -> str:
    """A kernel's name without its return type and template noise past `limit` characters."""
    name = re.sub(r"^void\s+", "", name.strip())
    return name if len(name) <= limit else name[: limit - 3] + "..."
