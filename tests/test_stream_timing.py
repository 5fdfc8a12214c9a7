"""Stream timing (issue 33): on CUDA, fast calls run back to back on inputs drawn ahead and are scored by the
judge's own clock (sandbox/worker/batches.py, sandbox/timing/timing_bound.py). Scripted timers stand in for the
GPU: each batch takes `calls * host_ms` of real time by the judge's clock and reports what the timer would.

A launch-bound call (its host path longer than its kernel) was failed `timing_unverified` when each call was
timed by its own events and synchronize: the events saw the kernel, the judge's clock the host path too. Timed
as a stream, the events span the host path as the judge's clock does, so the honest call passes, a forged report
is still refused, and the score is the judge's clock whatever the timer reports."""

from __future__ import annotations

import time

import pytest

from conftest import scripted_baseline
from sandbox.config import ProfileConfig
from sandbox.timing import paired, timing_bound
from sandbox.timing.baseline import timing_cfg
from sandbox.timing.profile import _paired

CFG = ProfileConfig(target_ms=100, max_trials=30, warmup_ms=12, top_kernels=0, early_stop=False)


class StreamTimer:
    """A timer whose every call costs `host_ms` of the judge's clock; it reports `reported_ms` a call, as a stream
    (one event pair over the batch) or, with stream=False, as per-call events that see the kernel alone."""

    def __init__(self, host_ms: float, reported_ms: float, stream: bool = True, fit: int = 10_000, draw_ms: float = 0.0):
        self.host_ms, self.reported_ms, self.stream, self.fit, self.draw_ms = host_ms, reported_ms, stream, fit, draw_ms
        self.calls: list[int] = []
        self.proc = type("P", (), {"pid": -1})()

    def request(self, op: str, timeout: float, what: str, **args) -> dict:
        if op == "time_begin":
            return {"ok": True, "est_ms": self.host_ms, "prepare_calls": self.fit, "draw_ms": self.draw_ms}
        if op == "time_batch" and args["calls"]:
            n = args["calls"]
            self.calls.append(n)
            time.sleep(n * self.host_ms / 1e3)
            return {"ok": True, "times": [self.reported_ms] * n, "stream": self.stream}
        return {"ok": True, "times": []}


def _pair(eager: StreamTimer, cand: StreamTimer, backend: str = "cuda"):
    return _paired(eager, cand, scripted_baseline(0.1), timing_cfg(CFG), CFG, backend)


def test_an_honest_launch_bound_stream_passes_and_is_scored_by_the_judges_clock(unpaused):
    # eager 0.1 ms a call, the candidate 0.2 ms of host path around a much shorter kernel: as a stream, its
    # events span the host path (the device waits for each launch)
    run, bound, attempts = _pair(StreamTimer(0.1, 0.1), StreamTimer(0.2, 0.2))
    assert bound.ok and attempts == 1, bound
    assert all(b["stream"] for b in run["candidate"]["batches"] + run["eager"]["batches"])
    s, _ = paired.speedup(paired.rounds(run["eager"]["batches"], run["candidate"]["batches"]))
    assert 0.35 < s < 0.65, s  # 0.5, by the judge's clock (sleep's overshoot moves it a little)


def test_the_same_call_timed_by_per_call_events_failed_the_bound(unpaused):
    """The old protocol's failure, kept as the reason for the new one: each call's events saw a 0.05 ms kernel
    while the judge's clock saw 0.2 ms of host path a call."""
    _, bound, _ = _pair(StreamTimer(0.1, 0.1, stream=False), StreamTimer(0.2, 0.05, stream=False), backend="cpu")
    assert not bound.ok and bound.batch_excess_ms > 0


def test_a_forged_stream_report_is_refused_and_would_not_have_paid(unpaused):
    run, bound, _ = _pair(StreamTimer(0.1, 0.1), StreamTimer(0.2, 0.01))
    assert not bound.ok and bound.batch_excess_ms > 0, bound
    # and the rounds never read the report: the speedup is the judge's clock's
    s, _ = paired.speedup(paired.rounds(run["eager"]["batches"], run["candidate"]["batches"]))
    assert s < 0.7, s


def test_batches_fit_the_inputs_the_timer_can_draw_ahead(unpaused):
    """The judge sizes a batch to the input sets the timer can hold (prepare_calls), so that fast calls run as a
    stream; a batch so capped is not re-timed as short."""
    cand = StreamTimer(0.02, 0.02, fit=7)
    run = timing_bound.Run(cand, "candidate", 1, timing_cfg(CFG), 60.0, "timing")
    run.begin()
    assert run.n == 7 and run.capped
    run.batch()
    assert cand.calls == [7] and not run.short()
    # with room for every call the batch takes what the budget asks (min_batch_ms of work: 500 calls)
    free = timing_bound.Run(StreamTimer(0.02, 0.02), "candidate", 1, timing_cfg(CFG), 60.0, "timing")
    free.begin()
    assert free.n == timing_bound.batch_calls(0.02, timing_cfg(CFG)) > 7 and not free.capped


def test_a_run_sizes_its_batches_by_the_draws_its_timer_measured(unpaused):
    """The timer's time_begin says what one call's inputs cost to draw; a long call with long draws gets fewer calls
    a batch (the budget is the device's time), and the rounds still run and are scored."""
    slow = timing_bound.Run(StreamTimer(4.0, 4.0, draw_ms=6.0), "candidate", 1, timing_cfg(CFG), 60.0, "timing")
    slow.begin()
    alone = timing_bound.Run(StreamTimer(4.0, 4.0), "candidate", 1, timing_cfg(CFG), 60.0, "timing")
    alone.begin()
    assert (slow.n, alone.n) == (3, 5)  # ceil(100 ms / 5 batches / 10 ms), floored by min_batch_ms; ceil(20 / 4)
    slow.batch()
    assert slow.w.calls == [3]


def test_a_launch_bound_eager_slower_than_its_baseline_is_not_load_on_cuda():
    """On CUDA a launch-bound eager moves by half between processes (the H200's [4096, 4096] abs: 0.044 ms in its
    baseline's process, 0.066 ms in every round of one profile's), so that alone is not noise there; a spread
    across the rounds still is, and on the CPU the drift still is."""
    fast, slow = scripted_baseline(0.044), scripted_baseline(0.5)
    assert not paired.drift_counts(fast, CFG, "cuda")
    assert paired.drift_counts(fast, CFG, "cpu") and paired.drift_counts(slow, CFG, "cuda")

    def run(eager: list[float]) -> dict:
        return {"eager": {"median_ms": sorted(eager)[len(eager) // 2],
                          "batches": [{"reported_median_ms": e, "ms": e} for e in eager]}}

    steady = run([0.07] * 4)
    assert "baseline" in paired.noise(steady, fast, 1.5, 1.5)
    assert paired.noise(steady, fast, 1.5, 1.5, drift=paired.drift_counts(fast, CFG, "cuda")) is None
    assert "apart" in paired.noise(run([0.044, 0.09, 0.05, 0.05]), fast, 1.5, 1.5, drift=False)


def test_on_cuda_a_drift_across_the_rounds_is_not_noise_but_a_change_inside_a_round_is():
    """On CUDA only each round's two eager batches must agree (paired.spread_is_local): a drift over the pairing
    cancels in every round's mean of its two eager batches, as a launch-bound eager on an idle H100 drifted 1.57x
    over six batches and failed the example's honest kernel. A jump between a round's two batches still counts,
    and on the CPU every batch still does."""
    fast = scripted_baseline(0.044)
    assert paired.spread_is_local("cuda") and not paired.spread_is_local("cpu")

    def run(eager: list[float]) -> dict:
        return {"eager": {"median_ms": sorted(eager)[len(eager) // 2],
                          "batches": [{"reported_median_ms": e, "ms": e} for e in eager]}}

    drifting = run([0.047, 0.044, 0.041, 0.037, 0.033, 0.030])
    assert paired.eager_spread(drifting["eager"]["batches"]) == pytest.approx(0.047 / 0.030)
    assert paired.eager_spread(drifting["eager"]["batches"], local=True) == pytest.approx(0.037 / 0.033)
    assert "apart" in paired.noise(drifting, fast, 1.5, 1.5, drift=False)
    assert paired.noise(drifting, fast, 1.5, 1.5, drift=False, local=True) is None
    jump = run([0.044, 0.044, 0.070, 0.045, 0.044, 0.044])
    why = paired.noise(jump, fast, 1.5, 1.5, drift=False, local=True)
    assert why is not None and "one round apart" in why


def test_a_disturbance_on_the_candidates_batches_alone_is_noise():
    """An honest abs kernel on an H200 under sixteen judgments: 0.069 ms a call in its first round, then 1.911 and
    1.946 ms, between eager batches that agreed; it was scored 0.02x eager (0.65x in every other profile of it).
    The candidate's consecutive batches must agree within candidate_max_spread (3x), which a data-dependent
    kernel's inputs stay well inside."""
    fast = scripted_baseline(0.044)

    def run(eager: list[float], cand: list[float]) -> dict:
        return {"eager": {"median_ms": sorted(eager)[len(eager) // 2],
                          "batches": [{"reported_median_ms": e, "ms": e} for e in eager]},
                "candidate": {"batches": [{"reported_median_ms": c, "ms": c} for c in cand]}}

    eager = [0.051, 0.047, 0.045, 0.046]
    seen = run(eager, [0.069, 1.911, 1.946])
    assert paired.noise(seen, fast, 1.5, 1.5, drift=False, local=True) is None  # eager's rule alone let it score
    why = paired.noise(seen, fast, 1.5, 1.5, drift=False, local=True, cand_spread=CFG.candidate_max_spread)
    assert why is not None and "0.069" in why and "1.911" in why, why
    steady = run(eager, [0.069, 0.071, 0.066])
    assert paired.noise(steady, fast, 1.5, 1.5, drift=False, local=True, cand_spread=3.0) is None
    # a drift of the candidate's over the pairing, each step inside the allowance, is not refused
    assert paired.noise(run(eager, [0.02, 0.05, 0.12]), fast, 1.5, 1.5, drift=False, local=True, cand_spread=3.0) is None
    assert paired.noise(run(eager, [0.05, 0.02]), fast, 1.5, 1.5, drift=False, local=True, cand_spread=2.0) is not None


def test_the_paired_processes_are_held_to_one_core_while_timed_and_let_go_after():
    import os
    import subprocess
    import sys

    from sandbox.timing import cores

    allowed = sorted(os.sched_getaffinity(0))
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        time.sleep(0.5)  # both threads started
        tids = [int(t) for p in procs for t in os.listdir(f"/proc/{p.pid}/task")]
        assert len(tids) == 4
        with cores.one_core([p.pid for p in procs], "1") as core:
            if len(allowed) < 2:
                assert core is None
                return
            assert core == cores.core_for("1", allowed)
            assert all(os.sched_getaffinity(t) == {core} for t in tids)
        assert all(sorted(os.sched_getaffinity(t)) == allowed for t in tids)
        # GPUs of one host get different cores where there are enough
        assert len({cores.core_for(str(g), allowed) for g in range(min(len(allowed), 8))}) == min(len(allowed), 8)
    finally:
        for p in procs:
            p.kill()


def test_builds_are_kept_off_every_gpus_timing_core_and_its_hyperthread():
    from sandbox.timing import cores

    allowed = list(range(16))
    # 8 cores with two threads each, siblings n and n+8 (a common layout)
    smt = lambda c: {c % 8, c % 8 + 8}  # noqa: E731
    one = cores.build_cores(allowed, gpus=1, siblings=smt)
    assert one == set(allowed) - {15, 7}, one
    two = cores.build_cores(allowed, gpus=2, siblings=smt)
    assert two == set(allowed) - {15, 7, 14, 6}, two
    for g in range(2):
        assert not smt(cores.core_for(str(g), allowed, 2)) & two
    # a GPU named by UUID (CUDA_VISIBLE_DEVICES) is timed on one of the reserved cores, not a builder's
    assert all(cores.core_for(f"GPU-{i:04x}", allowed, 2) in {15, 14} for i in range(50))
    # too few cores left: builds wait for timings under the lock, as before
    assert cores.build_cores([0, 1], gpus=1, siblings=lambda c: {c}) is None
    assert cores.build_cores([0, 1, 2, 3], gpus=1, siblings=lambda c: {c, c ^ 1}) == {0, 1}
    assert cores.build_cores([0, 1, 2, 3], gpus=3, siblings=lambda c: {c, c ^ 1}) is None


def test_ninja_and_the_compilers_it_starts_run_on_the_build_cores(tmp_path):
    """The cores reach every process of the build (fork and exec inherit them), not only ninja."""
    import os

    from sandbox.build.compile import _run_ninja

    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "build.ninja").write_text("rule probe\n  command = grep Cpus_allowed_list /proc/self/status > $out\n"
                                          "build affinity.txt: probe\n")
    rc, log = _run_ninja(tmp_path, tmp_path / "log", 30, None, cpus={allowed[0]})
    assert rc == 0, log
    assert (tmp_path / "affinity.txt").read_text().split()[-1] == str(allowed[0])


def test_a_cuda_worker_keeps_every_thread_off_the_timing_cores():
    """keep_off_timing_cores moves the threads already running, not only the caller, and a thread started after
    inherits the set (a CUDA context's threads start after it, when the device opens)."""
    import subprocess
    import sys

    code = """
import os, threading, time
from sandbox.timing import cores
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
first = sorted(os.sched_getaffinity(0))[0]
applied = cores.keep_off_timing_cores({first})
late = threading.Thread(target=stop.wait); late.start()
print(applied, sorted({open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0]
                       for t in os.listdir("/proc/self/task")}))
stop.set()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import os

    first = sorted(os.sched_getaffinity(0))[0]
    assert out.stdout.split() == [f"{{{first}}}", f"['{first}']"], out.stdout


def test_builds_run_at_a_lower_priority_than_the_judging_beside_them(tmp_path):
    """A compiler that ninja starts runs at BUILD_NICE above the judge's own niceness, so verifies' and profiles'
    workers get contested cores first."""
    import os

    from sandbox.build.compile import BUILD_NICE, _run_ninja

    (tmp_path / "build.ninja").write_text("rule probe\n  command = cut -d' ' -f19 /proc/self/stat > $out\n"
                                          "build nice.txt: probe\n")
    before = os.nice(0)
    rc, log = _run_ninja(tmp_path, tmp_path / "log", 30, None)
    assert rc == 0, log
    assert int((tmp_path / "nice.txt").read_text()) == min(19, before + BUILD_NICE)
    assert os.nice(0) == before  # the judge's own priority is untouched


def test_the_reference_pays_the_spot_copies_but_keeps_none():
    """Both sides of a pairing copy the calls drawn for a spot check (like with like), but only the candidate's
    copies are held: the reference's doubled a timing's device memory (19_ReLU's 6 GiB outputs ran out of an H100)."""
    import torch

    from sandbox.worker import batches

    def fn(x):
        return x * 2

    counts = {}
    for candidate in (True, False):
        run = {"cuda": False, "inputs": None, "events": [], "hosts": [], "spots": [], "candidate": candidate}
        sets = [[torch.full((4,), float(i))] for i in range(6)]
        batches.synced(run, fn, sets, list(range(6)), 1.0, False, torch.device("cpu"), None, None)
        counts[candidate] = (run["spotted"], len(run["spots"]))
    assert counts[True] == (5, 5) and counts[False] == (5, 0)  # every call but the first drawn, at rate 1


def _stream_run(host_over_events_ms: float) -> dict:
    """A stream run of five batches of 256 calls of 0.02 ms, each batch's host time past its events by this."""
    ev = 256 * 0.02
    return {"stream": [(ev + host_over_events_ms, ev, 256)] * 5, "events": [0.02] * 1280, "hosts": [0.02] * 1280,
            "out_bytes": 0, "seed": 3}


def _per_call(gap_ms: float, calls: list, empty_ms: float = 0.03):
    """Sixteen calls timed one at a time, each `gap_ms` past its end event, and each after an empty call
    `empty_ms` past its own (the load of that moment)."""
    def fill(probe: dict) -> None:
        calls.append(probe)
        probe["events"].extend([0.02] * 16)
        probe["hosts"].extend([0.02 + gap_ms] * 16)
        probe["empty_gaps"].extend([empty_ms] * 16)
    return fill


def test_a_late_wakeup_after_a_stream_is_not_async_work_but_work_left_on_every_call_is(monkeypatch):
    """A stream batch ends in one synchronize: on a loaded host one late wake-up of the timer reads as work left
    running past the batch, and failed an honest kernel (async_work) twice with 16 episodes at a time. The timer
    then times calls one at a time: a late wake-up shows past few of them, work on another stream past all."""
    from sandbox.worker import clocks
    from sandbox.worker.protocol import Reply

    monkeypatch.setattr(clocks, "empty_call_gap", lambda dev: 0.03)
    monkeypatch.setattr(clocks.guards, "peak_bandwidth_bytes_per_s", lambda dev: 5e12)
    cpu = __import__("torch").device("cpu")
    # each batch 5 ms past its events: a late wake-up, and per call only the empty call's gap
    calls: list = []
    checks: dict = {}
    clocks.check_clocks(_stream_run(5.0), _per_call(0.03, calls), cpu, checks)
    assert len(calls) == 1 and checks["async_checked_per_call"] and checks["host_event_gap_ms"] < 0.1
    # the same batches, and every call timed alone 0.5 ms past its end event: work left on another stream
    with pytest.raises(Reply, match="past its end event") as e:
        clocks.check_clocks(_stream_run(5.0), _per_call(0.53, []), cpu, {})
    assert e.value.reason == "async_work"
    # a stream that kept within its allowance is not timed again
    calls = []
    clocks.check_clocks(_stream_run(0.5), _per_call(0.53, calls), cpu, {})
    assert calls == []


def test_the_per_call_probe_sets_each_call_against_an_empty_call_under_the_same_load(monkeypatch):
    """Load that lasts through a probe (a policy generating on the same GPU, workers opening it, none of them
    under the device lock) stretches every call's gap past the empty call's gap measured quietly a moment before,
    so that alone read as work left running. Each call is set against an empty call timed just before it: the same
    stretch on both is load; a stretch on the candidate's calls alone is still async_work."""
    from sandbox.worker import clocks
    from sandbox.worker.protocol import Reply

    monkeypatch.setattr(clocks, "empty_call_gap", lambda dev: 0.03)  # measured before the load came
    monkeypatch.setattr(clocks.guards, "peak_bandwidth_bytes_per_s", lambda dev: 5e12)
    cpu = __import__("torch").device("cpu")
    checks: dict = {}
    clocks.check_clocks(_stream_run(5.0), _per_call(0.53, [], empty_ms=0.5), cpu, checks)
    assert checks["empty_call_gap_ms"] == pytest.approx(0.5) and checks["host_event_gap_ms"] == pytest.approx(0.53)
    # the same loaded gaps with quiet empty calls beside them: 0.5 ms a call the empty call does not have
    with pytest.raises(Reply, match="past its end event") as e:
        clocks.check_clocks(_stream_run(5.0), _per_call(0.53, [], empty_ms=0.03), cpu, {})
    assert e.value.reason == "async_work"
    # a synced run (no stream) past its allowance is probed the same way before it is failed
    synced = {"stream": [], "events": [0.02] * 64, "hosts": [0.55] * 64, "out_bytes": 0, "seed": 3}
    calls: list = []
    clocks.check_clocks(synced, _per_call(0.53, calls, empty_ms=0.5), cpu, {})
    assert len(calls) == 1
    with pytest.raises(Reply, match="past its end event"):
        clocks.check_clocks(synced, _per_call(0.53, [], empty_ms=0.03), cpu, {})


def test_a_synced_loop_times_an_empty_call_before_each_call_only_for_the_probe(monkeypatch):
    """batches.synced puts an empty call before each timed call when the run asks for it (the probe), and not
    in a timing's own calls, whose loop stays as it was."""
    import torch

    from sandbox.worker import batches

    seen = []
    monkeypatch.setattr(batches, "empty_gap", lambda perf, dev: seen.append(dev) or 0.01, raising=False)
    monkeypatch.setattr(batches, "_EVENT", lambda enable_timing: object(), raising=False)
    monkeypatch.setattr(batches, "_RECORD", lambda ev: None, raising=False)
    monkeypatch.setattr(batches, "_ELAPSED", lambda a, b: 0.001, raising=False)
    monkeypatch.setattr(batches, "_SYNC", lambda dev: None, raising=False)
    monkeypatch.setattr(batches.guards, "reset_persisting_l2", lambda: False)
    dev = torch.device("cpu")
    for probe in (False, True):
        run = {"cuda": True, "inputs": None, "events": [], "hosts": [], "spots": [], "candidate": False,
               "flush": torch.zeros(4), "l2_reset": False, **({"empty_gaps": []} if probe else {})}
        sets = [[torch.full((4,), float(i))] for i in range(5)]
        batches.synced(run, lambda x: x * 2, sets, list(range(5)), 0.0, False, dev, None, None)
        assert len(run["events"]) == 5
        assert run.get("empty_gaps", []) == ([0.01] * 5 if probe else [])
    assert len(seen) == 5


def test_spot_copies_may_take_the_room_the_timer_s_own_allocator_holds_free(monkeypatch):
    """The driver counts what a process's caching allocator reserved as used; the timer's own freed outputs are
    room for its copies (19_ReLU's copy found none by the driver's count and took 5 s through host memory). Read
    through the captured C function: candidate code patching torch.cuda.memory_stats changes nothing."""
    import torch

    from sandbox.worker import batches

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(batches, "_MEM_INFO", lambda d: (300, 1000))  # free, total
    monkeypatch.setattr(batches, "SPOT_ROOM_RESERVE", 0.10)
    cache = {"reserved_bytes": {"all": {"current": 0}}, "allocated_bytes": {"all": {"current": 0}}}
    monkeypatch.setattr(batches, "_MEM_STATS", lambda index: cache)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: {"reserved_bytes.all.current": 10**12},
                        raising=False)

    def budget() -> tuple[int, int]:
        run = {"spots": [], "spot_budget": 50, "set_bytes": 100, "out_bytes": 100}  # need 100 + 300 + 100
        return batches.device_budget(run, dev), run["spot_device_room"]

    assert budget() == (50, -200)  # no room by the driver's count: the fixed budget
    cache["reserved_bytes"]["all"]["current"], cache["allocated_bytes"]["all"]["current"] = 700, 250
    assert batches.own_cached(dev) == 450
    assert budget() == (250, 250)  # 300 free + 450 held free by this process - 500 needed
    monkeypatch.setattr(batches, "_MEM_STATS", lambda index: {})  # CUDA not initialised: nothing counted
    assert budget() == (50, -200)
    monkeypatch.setattr(batches, "_MEM_STATS", None)  # a build without the function
    assert batches.own_cached(dev) == 0


def test_inputs_are_drawn_ahead_of_the_timing_only_within_their_share_of_free_device_memory(monkeypatch):
    """A timing's first inputs drawn while it queues stay held there: eight queued judgments must leave the verifies
    beside them memory. The inputs the run already holds (eager's pool, drawn once) need no new room."""
    import torch

    from sandbox.worker import batches

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(batches, "_MEM_INFO", lambda d: (800, 1000))  # free, total
    monkeypatch.setattr(batches, "_MEM_STATS", lambda index: {"reserved_bytes": {"all": {"current": 300}},
                                                               "allocated_bytes": {"all": {"current": 100}}})
    share = batches.AHEAD_SHARE * (800 + 200)  # the driver's free count and this process's allocator's free
    assert batches.room_ahead({}, int(share), dev)
    assert not batches.room_ahead({}, int(share) + 1, dev)
    held = {"pool": [[torch.empty(10, dtype=torch.uint8)], [torch.empty(10, dtype=torch.uint8)]]}  # 20 bytes held
    assert batches.room_ahead(held, int(share) + 20, dev) and not batches.room_ahead(held, int(share) + 21, dev)
    assert batches.room_ahead({}, 10**15, torch.device("cpu"))  # the CPU's timings draw into host memory
