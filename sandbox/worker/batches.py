"""The loops of a batch of timed calls, for the timer role (sandbox/worker/timer.py).

Two ways to run a batch:

- **stream** (CUDA, every call's inputs drawn ahead by time_prepare into tensors of its own, the same tensors
  in every batch, so a cache keyed by address always hits stale values): the calls run back to back, as a user's
  loop runs a model, with one device synchronize at the end of the batch. The host path (the Python forward,
  the binding, the launch) overlaps the device's work, so a call costs what a user feels: the larger of the
  two. The judge scores the batch by its own clock around the request (sandbox/timing/timing_bound.py); the
  pair of events around the whole batch is only the timer's report, which the judge checks against its clock.
  Per-call events with a synchronize after each call measured, for a kernel shorter than its host path, the
  host's jitter rather than the kernel, and failed honest small kernels (issue 33).
- **synced** (the CPU, or inputs too large to draw ahead): each call's inputs are copied into the same
  tensors, each call timed on its own (CUDA events and a synchronize, with the L2 flushed, or the host clock).

Whether a call is spot-checked is drawn after it has returned, independently of every other call, and its
outputs are copied at once (Judge VII, classes 4 and 5: docs/judge.md rows 31-32). The reference's timed calls
(eager, the baselines) are drawn and copied the same way, so that both sides of a pairing pay the copies, but
only the candidate's copies are kept: holding the reference's too doubled what a timing needs on the device, and
KernelBench's 19_ReLU (6 GiB outputs) ran out of an H100's 80 GB.
"""

from __future__ import annotations

import os
import resource

import torch

from sandbox.worker import guards
from sandbox.worker.exchange import leaves, snapshot_tree
from sandbox.worker.inputs import make_inputs, refill_inputs
from sandbox.worker.protocol import CAPTURED
from sandbox.worker.startup import synchronize

# captured before any candidate code runs: later monkeypatching of torch.cuda cannot reach these
if torch.cuda.is_available():
    _EVENT = torch.cuda.Event
    _RECORD = torch.cuda.Event.record
    _ELAPSED = torch.cuda.Event.elapsed_time
    _SYNC = torch.cuda.synchronize

# a batch's inputs are drawn before it starts when all its sets fit in this much memory: on a GPU, room for
# several dozen calls of a large elementwise task (64 MiB a set), so that the fast calls that need the stream
# protocol most get it
PREPARE_BUDGET_BYTES = {"cpu": 512 << 20, "cuda": 4 << 30}
# captured before any candidate code runs: the spot checks' draw (the OS's random bytes, as SystemRandom.random
# reads them, without a Python method or module global between: random.SystemRandom can be patched), and the
# copy of a kept spot to host memory
_URANDOM = os.urandom
_TO = torch.Tensor.to
_GETRLIMIT = resource.getrlimit
_MEM_INFO = torch.cuda.mem_get_info if torch.cuda.is_available() else None
# this process's caching allocator: memory it reserved and holds free is room for its own later allocations,
# though the driver's free count (_MEM_INFO) calls it used (the C function, not torch.cuda.memory_stats, which
# candidate code could patch)
_MEM_STATS = getattr(torch._C, "_cuda_memoryStats", None) if torch.cuda.is_available() else None
# the candidate's kept spot copies stay on the device up to this many bytes; the rest wait in host memory (moved
# between batches, outside the judge's clock) and go back to the device one at a time when the judge checks them
# (sandbox/worker/timer.py: spot_outputs). A timing draws four checks on average: for KernelBench's 19_ReLU (6 GiB
# of outputs a call) those copies beside the inputs, an output and eager's process overran an H100's 80 GB
# (ProfileConfig.spot_device_bytes; on the CPU, where the copies are in host memory anyway, a test's budget of 0
# defers their export the same way)
SPOT_DEVICE_BYTES = 2 << 30
# and in host memory up to this many bytes, at most a quarter of the process's RLIMIT_DATA: the copies count
# against the candidate's limit (32 GiB on an H100 host), and 19_ReLU's honest kernel was failed runtime_error
# when a fifth 6 GiB copy was refused. Copies past both budgets are let go unchecked, the first always kept: the
# draw happens after each call returned, so letting some go only lowers the check rate (ProfileConfig.spot_host_bytes)
SPOT_HOST_BYTES = 8 << 30
# past SPOT_DEVICE_BYTES, copies stay on the device while it has room to spare: what the checks still need there
# (the reference run again on an input set, its outputs and the comparison's) and this share of the device's
# memory for everyone else (ready workers' contexts: nothing else allocates while the checks hold the device
# alone). A 6 GiB copy's trip through pageable host memory took 5.2 s out and 0.9 s back on an H100 host, most of
# 19_ReLU's 9.3 s profile (3daac8d:bench/results/judge_vi_round5_h100/); with a quarter reserved, 19_ReLU still found no
# room there (3daac8d:bench/results/judge_vi_round6_h100/), so a tenth. checks.spot_device_room says what each timing saw
SPOT_ROOM_RESERVE = 0.10


def host_budget(run: dict) -> int:
    budget = int(run.get("host_spot_budget", SPOT_HOST_BYTES))
    soft, _ = _GETRLIMIT(resource.RLIMIT_DATA)
    return budget if soft == resource.RLIM_INFINITY else min(budget, soft // 4)


def spot(run: dict, seed: int, out) -> None:
    """The copy of a spot-checked call's outputs: kept for the candidate's checks, dropped for the reference's."""
    snap = snapshot_tree(out)
    run["spotted"] = run.get("spotted", 0) + 1
    if run["candidate"]:
        run["spots"].append((seed, snap))


def _map(obj, f):
    if type(obj) is torch.Tensor:
        return f(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map(o, f) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, f) for k, v in obj.items()}
    return obj


def own_cached(dev: torch.device) -> int:
    """Bytes this process's caching allocator has reserved on `dev` and holds free (0 where unknown)."""
    if _MEM_STATS is None:
        return 0
    try:
        stats = _MEM_STATS(dev.index if dev.index is not None else torch.cuda.current_device())
    except (RuntimeError, TypeError, ValueError):
        return 0
    try:  # nested as torch.cuda.memory_stats_as_nested_dict gives it
        return max(0, int(stats["reserved_bytes"]["all"]["current"]) - int(stats["allocated_bytes"]["all"]["current"]))
    except (KeyError, TypeError, ValueError):
        return 0


def offload_spots(run: dict, dev: torch.device) -> None:
    """Move the candidate's kept spot copies past run["spot_budget"] bytes on the device to host memory (their
    indices in run["host_spots"]). Only copies whose every leaf is a plain tensor on `dev` move, so on_device puts each back
    where it was. Between batches only: the copy is the device's work, and a batch's clock must not carry it."""
    kept, moved, budget = 0, run.setdefault("host_spots", set()), device_budget(run, dev)
    for k, (seed, snap) in enumerate(run["spots"]):
        if snap is None:
            continue
        ts = leaves(snap)
        if k in moved or not ts or not all(type(t) is torch.Tensor and t.device == dev for t in ts):
            continue
        size = sum(t.numel() * t.element_size() for t in ts)
        if kept + size > budget:
            on_host = run.get("host_spot_bytes", 0)
            if (kept or moved) and on_host + size > host_budget(run):
                run["spots"][k] = (seed, None)  # let go unchecked (SPOT_HOST_BYTES)
                run["spots_let_go"] = run.get("spots_let_go", 0) + 1
                continue
            run["host_spot_bytes"] = on_host + size
            run["spots"][k] = (seed, _map(snap, lambda t: _TO(t, "cpu")))
            moved.add(k)
            # one copy a tensor, which the kernel audit sees and takes out of the candidate's (kernel_audit.verdict)
            run["host_copies"] = run.get("host_copies", 0) + sum(1 for t in ts if t.numel())
        else:
            kept += size
    run["spot_device_bytes"] = kept


def _device_bytes(run: dict, dev: torch.device) -> int:
    total = 0
    for k, (_, snap) in enumerate(run["spots"]):
        if snap is not None and k not in run.get("host_spots", ()):
            total += sum(t.numel() * t.element_size() for t in leaves(snap)
                         if type(t) is torch.Tensor and t.device == dev)
    return total


def device_budget(run: dict, dev: torch.device) -> int:
    """The bytes of spot copies that may stay on the device: SPOT_DEVICE_BYTES (the run's spot_budget), or more
    where the device has room to spare (SPOT_ROOM_RESERVE) and the run allows it (ProfileConfig.spot_device_room)."""
    budget = run.get("spot_budget", SPOT_DEVICE_BYTES)
    if dev.type != "cuda" or _MEM_INFO is None or not run.get("spot_room", True):
        return budget
    free, total = _MEM_INFO(dev)
    need = run.get("set_bytes", 0) + 3 * run.get("out_bytes", 0) + int(SPOT_ROOM_RESERVE * total)
    # the copies already on the device are in use, not free: they count towards the room they took; so does what
    # this process's allocator holds free (19_ReLU's timer held its freed 6 GiB outputs there, and the driver's
    # count alone offered its copy no room: 3daac8d:bench/results/judge_vi_round7_h100/)
    room = _device_bytes(run, dev) + free + own_cached(dev) - need
    run["spot_device_room"] = min(run.get("spot_device_room", room), room)  # the least seen: what limited it
    return max(budget, room)


# a timing's first inputs drawn ahead of its exclusive hold (time_prepare(ahead=True)) take at most this share of the
# device's free memory, per side: eight judgments queued at once, both sides of each taking a sixteenth of what the ones
# before them left, still leave a third of it to the verifies running beside them (inside the hold the inputs may take
# PREPARE_BUDGET_BYTES). On an H200 (130 GB free) a small task's 4 GB of draws fit from the first to the last
AHEAD_SHARE = 1 / 16


def prepare_budget(run: dict, dev: torch.device) -> int:
    """The bytes of a batch's inputs time_prepare may draw: PREPARE_BUDGET_BYTES, or less where the judgment's memory
    admission allows less (run["ahead_budget"]: sandbox/timing/memory_admission.py, allowance)."""
    budget = run.get("ahead_budget")
    return PREPARE_BUDGET_BYTES[dev.type] if budget is None else min(PREPARE_BUDGET_BYTES[dev.type], int(budget))


def room_ahead(run: dict, need: int, dev: torch.device) -> bool:
    """Whether `need` bytes of inputs (those the run holds already excepted) may be drawn before the timing holds the
    device: on the CPU always, on CUDA within AHEAD_SHARE of the free memory, or under a memory admission within its
    allowance (the free memory is the other admitted judgments')."""
    if run.get("ahead_budget") is not None:
        return need <= prepare_budget(run, dev)
    if dev.type != "cuda" or _MEM_INFO is None:
        return True
    free, _ = _MEM_INFO(dev)
    pool = run.get("pool")
    held = sum(t.numel() * t.element_size() for p in pool for t in leaves(p)) if pool else 0
    return max(0, need - held) <= AHEAD_SHARE * (free + own_cached(dev))


def draw_once(mod, seed: int, dev: torch.device, perf) -> tuple[int, float]:
    """One call's input set drawn as a timed call's is: its bytes, and the milliseconds the drawing took (the judge's
    batch budget counts it: sandbox/timing/timing_bound.py, batch_calls)."""
    t0 = perf()
    drawn = make_inputs(mod, seed, dev)
    synchronize(dev)
    return sum(t.numel() * t.element_size() for t in leaves(drawn)), (perf() - t0) * 1e3


def on_device(snap, device: torch.device):
    """A spot copy waiting in host memory, back on the device to be exported (sandbox/worker/timer.py)."""
    return _map(snap, lambda t: _TO(t, device))


def checked(i: int, calls: int, first: int, rate: float, floor: bool, none_yet: bool) -> bool:
    """Whether call i of a batch is spot-checked: drawn now that it has returned; the floor checks the batch's
    last call if no call of the timing has been."""
    return (i >= first and (int.from_bytes(_URANDOM(7), "big") >> 3) * 2.0 ** -53 < rate) or (
        floor and i == calls - 1 and none_yet)


def stream(run: dict, fn, sets: list, seeds: list[int], rate: float, floor: bool, dev: torch.device) -> dict:
    """The calls back to back on their own input sets, one synchronize at the end (module docstring)."""
    perf = CAPTURED["perf_counter"]
    calls, first = len(sets), 1 if len(sets) > 1 else 0
    run["l2_reset"] = guards.reset_persisting_l2() or run["l2_reset"]
    _SYNC(dev)
    start, end = _EVENT(enable_timing=True), _EVENT(enable_timing=True)
    h0 = perf()
    _RECORD(start)
    for i in range(calls):
        out = fn(*sets[i])
        sets[i] = None
        if checked(i, calls, first, rate, floor, not run.get("spotted")):
            spot(run, seeds[i], out)
            # the copy finishes before any later code of the candidate runs: work it queues afterwards on another
            # stream cannot fill the checked output in ahead of the copy
            _SYNC(dev)
        del out
    _RECORD(end)
    _SYNC(dev)
    host, ev = (perf() - h0) * 1e3, _ELAPSED(start, end)
    run["stream"].append((host, ev, calls))
    run["events"].extend([ev / calls] * calls)
    run["hosts"].extend([host / calls] * calls)
    return {"times": [ev / calls] * calls, "stream": True}


def empty_gap(perf, dev: torch.device) -> float:
    """How far the host clock around an empty call (two events and a synchronize) runs past the device's, in ms:
    launch and wake-up latency, which a loaded host stretches. The device is idle when it is called."""
    start, end = _EVENT(enable_timing=True), _EVENT(enable_timing=True)
    h0 = perf()
    _RECORD(start)
    _RECORD(end)
    _SYNC(dev)
    return (perf() - h0) * 1e3 - _ELAPSED(start, end)


def synced(run: dict, fn, sets: list | None, seeds: list[int], rate: float, floor: bool, dev: torch.device,
           mod, recorded) -> dict:
    """Each call timed on its own (module docstring). `sets`: the inputs drawn ahead, or None to draw each call's
    here; `recorded(fn, inputs)`: the call under the op recorder, or None."""
    perf = CAPTURED["perf_counter"]
    cuda = run["cuda"]
    calls, first = len(seeds), 1 if len(seeds) > 1 else 0
    events, hosts = [], []
    inputs = run["inputs"]
    for i in range(calls):
        if sets is not None:  # drawn ahead: each call has tensors of its own, nothing to copy
            inputs, sets[i] = sets[i], None
        else:
            # fresh contents in the same tensors every call: a cache keyed by content never hits, and one keyed
            # by address (or shape) always does, so the spot checks see it
            inputs = refill_inputs(inputs, make_inputs(mod, seeds[i], dev))
        if cuda:
            run["l2_reset"] = guards.reset_persisting_l2() or run["l2_reset"]
            run["flush"].zero_()
            _SYNC(dev)
            if "empty_gaps" in run:  # clocks.check_clocks's probe: an empty call beside each, under the same load
                run["empty_gaps"].append(empty_gap(perf, dev))
            start, end = _EVENT(enable_timing=True), _EVENT(enable_timing=True)
            h0 = perf()
            _RECORD(start)
            out = fn(*inputs) if recorded is None else recorded(fn, inputs)
            _RECORD(end)
            _SYNC(dev)
            hosts.append((perf() - h0) * 1e3)
            events.append(_ELAPSED(start, end))
        else:
            h0 = perf()
            out = fn(*inputs) if recorded is None else recorded(fn, inputs)
            hosts.append((perf() - h0) * 1e3)
            events.append(hosts[-1])
        if checked(i, calls, first, rate, floor, not run.get("spotted")):
            spot(run, seeds[i], out)
        del out
    synchronize(dev)  # the reply leaves after the batch's work, so the judge's clock covers it
    run["inputs"] = inputs if sets is None else None
    run["events"].extend(events)
    run["hosts"].extend(hosts)
    return {"times": events, "hosts": hosts if cuda else []}


def clock_checks(run: dict, base_gap: float) -> tuple[float, float, bool]:
    """From the timed calls' host and device clocks: (how long each call kept the device busy past its events,
    in ms; by how much that exceeds its allowance; whether the device's times exceed the host clock around them).
    Stream batches are compared batch by batch: a batch's pair of events spans all its calls, so an honest
    batch's host time exceeds it by one synchronize's latency (base_gap), and work left on another stream by the
    whole of that work; the allowance is a quarter of the batch's device time, as it is of a synced call's."""
    from sandbox.timing.timing_bound import summarize

    if run.get("empty_gaps"):  # each call against the empty call timed just before it (clocks.check_clocks)
        events, hosts, empties = run["events"], run["hosts"], run["empty_gaps"]
        med_event = summarize(events)["median_ms"]
        gap = summarize([h - e - g for h, e, g in zip(hosts, events, empties, strict=True)])["median_ms"]
        return gap, gap - max(0.05, 0.25 * med_event), sum(events) > 1.05 * sum(hosts) + 0.1
    if run["stream"]:
        rows = sorted(run["stream"], key=lambda r: r[0] - r[1] - base_gap - max(0.05, 0.25 * r[1]))
        host, ev, n = rows[len(rows) // 2]  # the median batch by its excess
        hosts, evs = [r[0] for r in run["stream"]], [r[1] for r in run["stream"]]
        return ((host - ev - base_gap) / n, host - ev - base_gap - max(0.05, 0.25 * ev),
                sum(evs) > 1.05 * sum(hosts) + 0.1)
    events, hosts = run["events"], run["hosts"]
    med_event = summarize(events)["median_ms"]
    med_gap = summarize([h - e for h, e in zip(hosts, events, strict=True)])["median_ms"]
    return med_gap - base_gap, med_gap - base_gap - max(0.05, 0.25 * med_event), sum(events) > 1.05 * sum(hosts) + 0.1
