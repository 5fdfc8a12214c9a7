"""The timer's checks of its own clocks on CUDA (sandbox/worker/timer.py): the device's times against the host
clock around them (a patched timer), work left running past the timed calls' end events (another stream), and
times below what writing the outputs takes at peak bandwidth."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sandbox.worker import batches, guards
from sandbox.worker.protocol import CAPTURED, Reply

# captured before any candidate code runs: later monkeypatching of torch.cuda cannot reach these
if torch.cuda.is_available():
    _SYNC = torch.cuda.synchronize

# calls timed one at a time when a stream of calls seemed to leave work running (check_clocks)
PER_CALL_CHECKS = 16


def empty_call_gap(dev: torch.device) -> float:
    """The host-vs-device gap of an empty call (launch and sync latency), the median of 20, in ms."""
    perf = CAPTURED["perf_counter"]
    gaps = []
    for _ in range(20):
        _SYNC(dev)
        gaps.append(batches.empty_gap(perf, dev))
    return sorted(gaps)[len(gaps) // 2]


def check_clocks(run: dict, per_call: Callable[[dict], None], dev: torch.device, checks: dict) -> None:
    """Raise the Reply a run's clocks call for (timer_tampered, async_work, impossible_speed), recording what was
    measured in `checks`. `per_call(probe)` times a few calls one at a time into the run-shaped dict `probe`."""
    from sandbox.timing.timing_bound import summarize

    base_gap = empty_call_gap(dev)
    med_event = summarize(run["events"])["median_ms"]
    gap, excess, tampered = batches.clock_checks(run, base_gap)
    if excess > 0 and not tampered:
        # a stream batch ends in one synchronize, so a single late wake-up of the timer on a loaded host (sixteen
        # episodes building beside it) reads as work left running past the batch: an honest kernel was failed
        # that way. The work itself is in the judge's clock either way (the batch's device-wide synchronize).
        # Calls timed one at a time tell the two apart: work left running shows past every call's end event, a
        # late wake-up past few of them (clock_checks takes the median call). Each is set against an empty call
        # timed just before it, not against base_gap: load that outlasts a wake-up but comes and goes (a policy
        # generating on the same GPU, pool workers opening it: neither takes the device lock) stretches every gap
        # of a probe past one measured a moment earlier (the likeliest cause of two honest kernels failed
        # async_work with 16 episodes at a time; a bursty load on an H200 did not reproduce it:
        # 3daac8d:bench/results/judge_vi_async_load_2026-11-28). Work the candidate leaves running cannot stretch the
        # empty call: the synchronize that ends each call waits for all of it first.
        probe = {**run, "candidate": False, "events": [], "hosts": [], "stream": [], "spots": [], "inputs": None,
                 "recorder": None, "empty_gaps": []}
        per_call(probe)
        gap, excess, tampered = batches.clock_checks(probe, base_gap)
        checks["async_checked_per_call"] = True
        base_gap = sorted(probe["empty_gaps"])[len(probe["empty_gaps"]) // 2] if probe["empty_gaps"] else base_gap
    checks.update(host_event_gap_ms=gap + base_gap, empty_call_gap_ms=base_gap)
    if tampered:
        raise Reply("timer_tampered", "device timings exceed the host clock around them: the timer was patched")
    if excess > 0:
        raise Reply("async_work", f"each call kept the GPU busy {gap:.3f} ms past its end event "
                    "(work on another stream, or left running): do all work on the current stream")
    floor_ms = run["out_bytes"] / guards.peak_bandwidth_bytes_per_s(dev) * 1e3
    checks["floor_ms"] = floor_ms
    if med_event < 0.8 * floor_ms:
        raise Reply("impossible_speed", f"{med_event:.4f} ms is below the {floor_ms:.4f} ms it takes just to write "
                    "the outputs at peak memory bandwidth; this time cannot be scored")
