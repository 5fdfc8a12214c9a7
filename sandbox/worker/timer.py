"""The timer role: times the reference (eager, torch.compile) or the candidate; lists top kernels.

(About 400 lines, kept whole: TimerRole's methods are pinned on the instance before candidate code loads
(guards.pin_methods, Judge IX), so its request handlers stay one class; the batch loops, clocks and audits it calls
live in batches.py, clocks.py and timer_audit.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from sandbox.worker import batches, clocks, guards, kernel_audit, thread_audit
from sandbox.worker.candidate import CandidateRole, check_counter
from sandbox.worker.exchange import export_tree, leaves, storage_bytes
from sandbox.worker.inputs import build_reference, load_module, make_init_inputs, make_inputs, refill_inputs
from sandbox.worker.protocol import CAPTURED, Reply, classify, describe
from sandbox.worker.recorder import RecorderTampered, make_recorder
from sandbox.worker.startup import confine_task, device_name, open_device, synchronize
from sandbox.worker.timer_audit import TimerAudit


def _call_seeds(base: int, n: int) -> list[int]:
    rng = random.Random(base)
    return [rng.getrandbits(62) for _ in range(n)]


def _check_recorder(recorder, cand: CandidateRole) -> None:
    try:
        cand.canary(recorder)
    except RecorderTampered as e:
        raise Reply("dispatch_tampered", f"{e}: the op recorder was patched") from None


class TimerRole(TimerAudit):
    """Times one model; every timed call gets freshly generated inputs."""

    TASK_ROLE = "timer"  # the role whose confinement a reference's timing takes (sandbox.worker.startup.confine_task)
    COMPILES = False  # torch.compile's compilers may start (the baseline's)

    def __init__(self):
        # made before its set-up loads any candidate code: what decides and keeps spot checks is bound now
        # (guards.pin_methods), so rebinding batches.spot or TimerRole._begin later changes nothing it calls
        guards.pin_methods(self, guards.sealed_views(batches))

    def setup(self, task: str, device: str, init_seed: int, which: str, compile_mode: str = "default",
              extension: str | None = None, model_new: str | None = None, shm_dir: str | None = None,
              source: str | None = None, checks: dict | None = None):
        """`checks`: the candidate's in-process checks beyond the timer's (CandidateRole.setup's record_ops,
        audit_ops, own_kernels), for a process that verifies before it times (sandbox/worker/judged.py)."""
        self.device = open_device(device)
        self._run = None  # a kept process's last timing (sandbox/worker/eager.py park): never this one's
        self.which = which
        self.keep: list = []
        self._spots: list = []  # the last timing's kept spot copies, for spot_outputs
        self.shm_dir = shm_dir or "/nonexistent"
        self.gen_kernels: set[str] = set()
        self.audit_canary: kernel_audit.Canary | None = None
        self.audit_setup_s = 0.0
        info = {"device_name": device_name(self.device), "torch_version": torch.__version__}
        if which == "reference":
            confine_task(self.TASK_ROLE, [task], compiles=self.COMPILES)
            self.mod = load_module(task, "cuda_agent_task", source)
            init_inputs = make_init_inputs(self.mod, init_seed, self.device)
            self.eager = build_reference(self.mod, init_inputs, init_seed, self.device)
            self.compile_mode = compile_mode
            self.compiled = None
            return info
        started = self._setup_candidate(task, device, init_seed, extension, model_new,
                                        **{"record_ops": False, **(checks or {})})
        return {**info, **{k: started[k] for k in ("confinement", "confinement_notes", "limits")}}

    def _setup_candidate(self, task: str, device: str, init_seed: int, extension: str | None, model_new: str | None,
                         **checks) -> dict:
        """The candidate's side: CandidateRole's set-up (`checks`: its record_ops, audit_ops, own_kernels), with the
        kernel audit's canary calibrated on CUDA before any candidate code runs. Its start-up times."""
        self.cand = CandidateRole()
        audit = (lambda cand: self._audit_setup(cand, init_seed)) if self.device.type == "cuda" else None
        if audit is not None and extension and not checks.get("own_kernels"):  # read before the extension loads
            from sandbox.scan.symbol_scan import own_kernels

            checks["own_kernels"] = own_kernels(Path(extension))
        started = self.cand.setup(task, device, init_seed, extension, model_new, shm_dir=self.shm_dir,
                                  before_candidate=audit, **checks)
        self.eager = self.cand.model
        self.mod = self.cand.mod
        return started

    def _fn(self, variant: str):
        if variant == "compiled":
            if self.compiled is None:
                kwargs = {} if self.compile_mode == "default" else {"mode": self.compile_mode}
                self.compiled = torch.compile(self.eager, **kwargs)
            return self.compiled
        return self.eager

    def warm(self, variant: str, seed: int):
        """One untimed call, before the timing: torch.compile compiles on the first call (seconds to minutes
        on every core), and the judge runs this holding the device lock shared, like a build, so that the
        exclusive timing which follows is not spent compiling while every other judgment waits."""
        fn = self._fn(variant)
        try:
            with torch.no_grad():
                fn(*make_inputs(self.mod, seed, self.device))
            synchronize(self.device)
        except Reply:
            raise
        except Exception as e:
            raise self._failed(variant, e) from e
        return {}

    # The timing protocol (sandbox/timing/timing_bound.py drives it from the judge's side): time_begin warms up
    # and estimates; each time_batch runs the number of calls the judge asks for and returns every call's
    # time, so the judge's own clock around the request bounds them; time_end runs the in-process checks
    # and exports the spot-checked outputs. A batch of zero calls is the judge's round-trip probe.

    def time_begin(self, variant: str, seed: int, cfg: dict):
        # a new timing (a pairing run again): the last one's deferred audit is given first (a judge that skipped
        # it still gets its verdict), and the spot copies exported from it are never read now
        self.time_audit()
        self.keep, self._spots = [], []
        self._fn_now = self._fn(variant)
        self._variant = variant
        try:
            with torch.no_grad():
                return self._begin(self._fn_now, seed, cfg, variant == "candidate")
        except Reply:
            raise
        except Exception as e:
            raise self._failed(variant, e) from e

    def time_prepare(self, calls: int, index: int, ahead: bool = False):
        """Draw a batch's inputs before it starts, when they fit the memory budget, into the tensors every batch of
        this timing uses (one set a call): inside the batch a call only runs, so the harness's per-call work (which the
        judge's clock cannot tell from the model's) stays small. The kernel audit's canary may launch here too. `ahead`:
        asked before the timing holds the device (paired.ahead); declined past batches.room_ahead."""
        run = self._run
        seeds = _call_seeds(run["seed"] + 7919 * (index + 1), calls)
        if ahead and not batches.room_ahead(run, run.get("set_bytes", 0) * calls, self.device):
            return {"prepared": False, "declined": True}  # asked again inside the timing, as before
        if run.get("canary") is not None:
            run["canary"].launch()
        if run["candidate"]:
            batches.offload_spots(run, self.device)
        first = make_inputs(self.mod, seeds[0], self.device)
        per_set = sum(t.numel() * t.element_size() for t in leaves(first))
        run["ready"] = None
        if per_set * calls > batches.prepare_budget(run, self.device):
            return {"prepared": False}
        try:
            pool = self._pool(run, calls)
        except Reply:
            raise
        except Exception as e:
            raise self._failed(self._variant, e) from e
        if not run["candidate"]:
            # the reference's sets are drawn once a timing (the pool's own draws), not again before every batch:
            # eager caches nothing by content, and its memory traffic stays the candidate's (the same tensors, a
            # set a call). Drawing them again was about half of the input drawing inside the exclusive section,
            # the largest part of a small kernel's timing left there (docs/history.md, ninth round)
            run["ready"] = (index, list(pool))
            return {"prepared": True}
        for i, sd in enumerate(seeds):
            pool[i] = refill_inputs(pool[i], first if i == 0 else make_inputs(self.mod, sd, self.device))
        synchronize(self.device)
        run["ready"] = (index, list(pool))
        return {"prepared": True}

    def _pool(self, run: dict, calls: int) -> list:
        """The timing's input tensors, a set per call, the same in every batch: a cache keyed by address hits on
        every call and one keyed by content never does, as when every call's values were copied into the same
        tensors. Made once, from draws of their own, and each set run through the model once with those values
        (untimed), so that even the first batch's calls find an address seen before, holding other values now."""
        pool = run.get("pool")
        if pool is not None and len(pool) == calls:
            return pool
        run["pool"] = None
        pool = [make_inputs(self.mod, sd, self.device) for sd in _call_seeds(run["seed"] ^ 0x5EED, calls)]
        with torch.no_grad():
            for p in pool:
                out = self._fn_now(*p)
                del out
        synchronize(self.device)
        run["pool"] = pool
        return pool

    def time_batch(self, calls: int, index: int = 0, spot_rate: float = 0.0, spot_floor: bool = False):
        """Each call but the batch's first is spot-checked with probability `spot_rate`, drawn once the call has
        returned (_batch); `spot_floor`: the batch's last call is, if no call of this timing has been yet."""
        if calls == 0:
            return {"times": [], "hosts": []}
        try:
            with torch.no_grad():
                return self._batch(calls, index, float(spot_rate), bool(spot_floor))
        except Reply:
            raise
        except Exception as e:
            raise self._failed(self._variant, e) from e

    def time_end(self, top: int = 0, defer_audit: bool = False):
        """The in-process checks of a timing and its spot copies. `defer_audit`: the kernel audit's profiler keeps
        running, and time_audit stops it and gives the audit's verdict later, once the judge has let the device go
        (stopping a profiler over thousands of calls, and reading its table, is host work that took a third of a
        small kernel's exclusive section on a loaded H100). The canary's last launch is made here either way."""
        run = self._run
        if run.get("prof") is not None:
            if run.get("canary") is not None:
                run["canary"].launch(final=True)
            if not defer_audit:
                self._stop_profiler(run)
        if run["cuda"]:
            # the batches' input sets (up to batches.PREPARE_BUDGET_BYTES) go back to the device, not to this
            # process's cache: other judgments' processes share the GPU
            run["ready"] = run["pool"] = None
            torch.cuda.empty_cache()
        if not run["candidate"]:
            run["flush"] = None
            return {"checks": {"end_profiler_s": run["end_profiler_s"]}} if "end_profiler_s" in run else {}
        try:
            return self._end(run, top, audit=not defer_audit)
        finally:
            # no call is timed after the end (a new timing has a buffer of its own): on an H200 a kept eager
            # process still held its 2 x 60 MiB once parked, the timing's state outliving it somewhere
            run["flush"] = None

    def _failed(self, variant: str, e: Exception) -> Reply:
        if variant == "compiled":
            return Reply("compile_failed", "torch.compile of the reference failed: " + describe(e, 1500))
        return Reply(classify(e, "runtime_error"), f"{variant} failed while timing: " + describe(e))

    def _begin(self, fn, seed: int, cfg: dict, candidate: bool) -> dict:
        perf = CAPTURED["perf_counter"]
        if getattr(self, "_run", None) and self._run.get("threads") is not None:  # a timing begun again
            self._run.pop("threads").discard()
        dev = self.device
        cuda = dev.type == "cuda"
        warm = make_inputs(self.mod, seed, dev)
        n = 0
        t0 = perf()
        # warm-up: compilation, autotuning and lazy initialisation stay out of the numbers
        while n < cfg["min_warmup_calls"] or (perf() - t0) * 1e3 < cfg["warmup_ms"]:
            fn(*warm)
            n += 1
            synchronize(dev)
            if n > 10000:
                break
        t0 = perf()
        for _ in range(3):
            fn(*warm)
        synchronize(dev)
        est_ms = max((perf() - t0) * 1e3 / 3, 1e-4)
        out_bytes = storage_bytes(fn(*warm))
        del warm
        synchronize(dev)
        run: dict = {"seed": seed, "candidate": candidate, "cuda": cuda, "out_bytes": out_bytes, "events": [],
                     "hosts": [], "spots": [], "l2_reset": False, "inputs": None, "calls": 0, "prof": None,
                     "recorder": None, "gen_kernels": self.gen_kernels, "flush": None, "canary": None, "stream": [],
                     "pool": None, "spot_budget": int(cfg.get("spot_device_bytes", batches.SPOT_DEVICE_BYTES)),
                     "host_spot_budget": int(cfg.get("spot_host_bytes", batches.SPOT_HOST_BYTES)),
                     "spot_room": bool(cfg.get("spot_device_room", True)),
                     "ahead_budget": cfg.get("ahead_bytes")}  # a memory admission's allowance (or None)
        if cuda:
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or (64 << 20)
            run["flush"] = torch.empty(2 * l2, dtype=torch.uint8, device=dev)
        if candidate and not cuda:
            run["recorder"] = make_recorder()()
            run["threads"] = thread_audit.EveryThread().start()  # ops on other threads pass the recorder (Judge IX)
        # the reference's calibration run (cfg "audited_calibration") carries the same profiler as the
        # candidate's audited calls: its CUPTI overhead on every CUDA call of the harness is part of o
        if cuda and cfg.get("audit_timed_calls", True) and (candidate or cfg.get("audited_calibration")):
            from torch.profiler import ProfilerActivity, profile

            t0 = perf()
            run["prof"] = profile(activities=[ProfilerActivity.CUDA])
            run["prof"].__enter__()
            run["profiler_start_s"] = perf() - t0
            if self.audit_canary is not None and not self.audit_canary.empty:
                run["canary"] = self.audit_canary.start()
                run["canary"].launch()
        run["calls_before"] = self.cand.counter.total if (candidate and self.cand.counter) else 0
        self._run = run
        run["set_bytes"], draw_ms = batches.draw_once(self.mod, seed, dev, perf)
        # prepare_calls: the sets time_prepare can draw ahead; the judge sizes batches to fit (fast calls then stream)
        return {"est_ms": est_ms, "warmup_calls": n, "profiler_start_s": run.get("profiler_start_s", 0.0),
                "prepare_calls": batches.prepare_budget(run, dev) // max(run["set_bytes"], 1), "draw_ms": draw_ms}

    def _batch(self, calls: int, index: int, spot_rate: float, spot_floor: bool = False) -> dict:
        run, fn, dev = self._run, self._fn_now, self.device
        seeds = _call_seeds(run["seed"] + 7919 * (index + 1), calls)
        ready = run.pop("ready", None)
        sets = ready[1] if ready is not None and ready[0] == index and len(ready[1]) == calls else None
        run["calls"] += calls
        if sets is not None and run["cuda"]:
            return batches.stream(run, fn, sets, seeds, spot_rate, spot_floor, dev)
        recorded = None if run["recorder"] is None else (lambda f, inputs: self._recorded(run["recorder"], f, inputs))
        return batches.synced(run, fn, sets, seeds, spot_rate, spot_floor, dev, self.mod, recorded)

    def _end(self, run: dict, top: int, audit: bool = True) -> dict:
        run["inputs"] = None
        trials, spots, recorder = run["calls"], run["spots"], run["recorder"]
        result: dict = {}
        checks: dict = {"timed_calls": trials, "spot_checks": run.get("spotted", 0), "l2_persisting_reset": run["l2_reset"]}
        check_counter(self.cand.counter)
        calls = (self.cand.counter.total - run["calls_before"]) if self.cand.counter else trials
        if calls < trials:
            raise Reply("no_kernel_launched", f"only {calls} of {trials} timed calls called cuda_extension: the "
                        "timed calls must run your kernels too")
        if run.get("threads") is not None:
            threads, run["threads"] = run["threads"], None
            threads.canary()
            threads.stop()
            threads.verdict("the timed calls")
        if recorder is not None:
            _check_recorder(recorder, self.cand)
            if recorder.forbidden:
                ops = ", ".join(f"{k} ({v}x)" for k, v in sorted(recorder.forbidden.items()))
                raise Reply("torch_op_used", f"the timed calls dispatched PyTorch compute ops: {ops}")
        perf = CAPTURED["perf_counter"]
        if "end_profiler_s" in run:
            checks["end_profiler_s"] = run["end_profiler_s"]
        if run["cuda"]:
            t0 = perf()
            clocks.check_clocks(run, self._per_call, self.device, checks)
            checks["end_clocks_s"] = perf() - t0
            if run["prof"] is not None and audit:
                result["kernels"] = self._audit(run, top, checks)
        t0 = perf()
        batches.offload_spots(run, self.device)
        host = run["host_spots"]
        checks["spots_on_host"] = len(host)
        checks["spot_device_bytes"] = run.get("spot_device_bytes", 0)
        if "spot_device_room" in run:  # CUDA with spot_device_room: the least room the copies were offered
            checks["spot_device_room"] = int(run["spot_device_room"])
        checks["spots_let_go"] = run.get("spots_let_go", 0)
        result["checks"] = checks
        # a copy in host memory is exported when the judge asks for it (spot_outputs), one on the device at a time
        result["spots"] = [{"seed": sd, "deferred": k} if k in host else
                           {"seed": sd, "outputs": export_tree(o, self.keep, self.shm_dir, f"spot{k}")}
                           for k, (sd, o) in enumerate(spots) if o is not None]
        self.keep.extend(o for _, o in spots if o is not None)
        self._spots = list(spots)
        checks["end_spots_s"] = perf() - t0  # offloading and exporting the spot copies
        return result

    def spot_outputs(self, index: int):
        """A spot copy that waited in host memory (batches.offload_spots), back on the device and exported; the
        one exported this way before it is let go."""
        _, snap = self._spots[int(index)]
        self._on_device: list = []  # the previous one's device copy goes with the list it was kept in
        return {"outputs": export_tree(batches.on_device(snap, self.device), self._on_device, self.shm_dir,
                                       f"spotd{int(index)}")}

    def _recorded(self, recorder, fn, inputs):
        with recorder:
            return fn(*inputs)

    def _per_call(self, probe: dict) -> None:
        """clocks.check_clocks's calls timed one at a time: the synced loop on inputs of their own, nothing
        spot-checked or kept."""
        try:
            with torch.no_grad():
                batches.synced(probe, self._fn_now, None, _call_seeds(probe["seed"] + 104729, clocks.PER_CALL_CHECKS),
                               0.0, False, self.device, self.mod, None)
        except Reply:
            raise
        except Exception as e:
            raise self._failed(self._variant, e) from e

    def kernels(self, seed: int, top: int, calls: int = 3, variant: str = "eager"):
        """Top kernels by device time (CUDA) or top ops by CPU time, over a few calls (of torch.compile's model in
        a baseline timer, `variant` "compiled").

        The profiler costs time of its own (on the CPU it records every op, and its first session starts
        Kineto), so the same calls are timed without it too: `profiler` says how much the rows are inflated.
        """
        from torch.profiler import ProfilerActivity, profile

        perf = CAPTURED["perf_counter"]
        inputs = make_inputs(self.mod, seed, self.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        fn = self._fn(variant)
        with torch.no_grad():
            fn(*inputs)
            synchronize(self.device)
            t0 = perf()
            for _ in range(calls):
                fn(*inputs)
            synchronize(self.device)
            plain_ms = (perf() - t0) * 1e3 / calls
            with profile(activities=activities):  # the profiler's one-time start-up, kept out of the rows
                fn(*inputs)
                synchronize(self.device)
            with profile(activities=activities) as prof:
                t0 = perf()
                for _ in range(calls):
                    # on the CPU the extension's own work shows as this range's self time
                    with torch.profiler.record_function("forward (outside ATen ops)"):
                        fn(*inputs)
                synchronize(self.device)
                profiled_ms = (perf() - t0) * 1e3 / calls
        rows = []
        for evt in prof.key_averages():
            if self.device.type == "cuda":
                if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
                    continue
                total = getattr(evt, "self_device_time_total", None)
                if total is None:
                    total = getattr(evt, "self_cuda_time_total", 0)
            else:
                total = evt.self_cpu_time_total
            if total and total > 0:
                rows.append((evt.key, total / 1000.0 / calls, max(1, evt.count // calls)))
        rows.sort(key=lambda r: -r[1])
        grand = sum(r[1] for r in rows) or 1.0
        return {"kernels": [{"name": n[:200], "total_ms": t, "calls": c, "percent": 100.0 * t / grand}
                            for n, t, c in rows[:top]],
                "profiler": {"calls": calls, "plain_ms_per_call": plain_ms, "profiled_ms_per_call": profiled_ms,
                             "rows_ms_per_call": sum(r[1] for r in rows),
                             "overhead_factor": profiled_ms / plain_ms if plain_ms > 0 else None}}

    def release(self):
        self.keep = []
        return {}

