"""profile: time the reference (eager and torch.compile) and ModelNew on the same device.

Each model is timed in its own fresh process, one process at a time so timings stay clean. The
reference's times are cached per task content, device, torch version, compile mode and timing
protocol, so the tenth profile of an episode does not recompile the baseline.
"""

from __future__ import annotations

import contextlib
import os
import time

from sandbox.backend import cuda_visible_devices, device_for
from sandbox.build.compile import extension_path
from sandbox.config import ProfileConfig
from sandbox.confinement.processes import Session, WorkerError
from sandbox.correctness import task_process
from sandbox.correctness.verify import _reason, confinement_notes, footprint, new_seed, preflight
from sandbox.results import ProfileResult, Reason, Timing
from sandbox.timing import cores, early_stop, judge_clock, memory_admission, paired, timing_bound
from sandbox.timing.after_timing import (
    audited,
    candidate_audit,
    eager_audit,
    merge_audits,
    spot_checks,
    top_kernels,
)
from sandbox.timing.baseline import BaselineError, time_reference, timing_cfg
from sandbox.timing.device_lock import device_lock, timing_hold
from sandbox.timing.scoring import min_kept, paired_record, pairing_of, scored
from sandbox.workspace import Workspace


def device_identity(backend: str) -> tuple[str, str]:
    """(device name, torch version) without importing torch in this process: from the toolchain probe."""
    from sandbox.build.toolchain import get_toolchain

    tc = get_toolchain(backend)
    name = tc.device_name or ("cpu" if backend == "cpu" else "cuda")
    if backend == "cpu":
        import platform

        name = f"cpu:{platform.machine()}:{os.cpu_count()}"
    return name, tc.torch_version


class ProfileRun:
    """One profile as it is made: the workspace and settings, the device, the baseline, the result's fields and the
    phases' laps. profile_workspace makes one, and so does a judgment that profiles in its verify's processes
    (sandbox/timing/judgment.py)."""

    def __init__(self, ws: Workspace, cfg: ProfileConfig, t0: float, restored: list[str]):
        self.ws, self.cfg, self.t0 = ws, cfg, t0
        self.base = dict(backend=ws.backend, compile_mode=cfg.compile_mode, restored_files=restored)
        self.out: dict = {}
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()
        self.task = str(ws.reference_path)
        self.device = device_for(ws.backend)
        # the spot copies' device budget is not a timing setting: outside timing_cfg, so outside the baseline's key
        # and on the CPU, each batch's run-queue waits (sandbox/timing/waits.py: the machine's load on it)
        self.tcfg = {**timing_cfg(cfg), "measure_waits": ws.backend == "cpu", "spot_device_bytes": cfg.spot_device_bytes,
                     "spot_host_bytes": cfg.spot_host_bytes, "spot_device_room": cfg.spot_device_room}
        self.b = None

    def result(self, ok: bool, reason: Reason | None = None, message: str = "") -> ProfileResult:
        return ProfileResult(ok=ok, reason=reason, message=message, duration_s=time.perf_counter() - self.t0,
                             **self.out, **self.base)

    def restart(self) -> None:
        """The profile's duration and laps count from now (a judgment's profile starts where its verify ends)."""
        self.t0 = self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    def identify(self) -> ProfileResult | None:
        """The device's name and torch's version, into the result: None, or the failure to read them."""
        try:
            self.device_name, self.torch_version = device_identity(self.ws.backend)
        except RuntimeError as e:  # the machine's setup, not the agent's code
            return self.result(False, Reason.internal_error, str(e)[-3000:])
        self.out.update(device=self.device_name, torch_version=self.torch_version, phases=self.phases)
        return None

    def baseline(self, refresh: str | None = None) -> ProfileResult | None:
        """The reference's baseline (cached, or timed now): None, or the reference's failure."""
        try:
            self.b = time_reference(self.task, self.ws.meta.task_sha256, self.ws.backend, self.device_name,
                                    self.torch_version, self.cfg, **({"refresh": refresh} if refresh else {}))
        except BaselineError as e:
            return self.result(False, Reason.reference_error, str(e))
        self.out.update(compile_error=self.b.compile_error, baseline_cached=self.b.cached and not refresh)
        return None


def profile_workspace(ws: Workspace, config: ProfileConfig | None = None) -> ProfileResult:
    cfg = config or ProfileConfig()
    t0 = time.perf_counter()
    restored, _, err = preflight(ws, cfg.static_checks)
    pr = ProfileRun(ws, cfg, t0, restored)
    if err:
        reason, _, msg = err.partition(":")
        return pr.result(False, Reason(reason), msg)
    if (failed := pr.identify()) is not None:
        return failed
    # the device's memory first (timing/memory_admission.py), its lock inside (baseline, set-up, timing)
    with memory_admission.admitted(pr.device, footprint(pr.task, ws.backend, pr.device)) as adm:
        p = _admitted(pr)
    if adm is not None:
        p.phases["memory_queued"] = adm.waited_s
    return p


def bounded(pr: ProfileRun) -> None:
    """Under a memory admission for a measured footprint, the timer's inputs drawn ahead and its spot copies on the
    device stay within the footprint's allowance for them (memory_admission.allowance), copies past it go to host
    memory: the device's free memory belongs to the other judgments admitted there, not to this one's spare room.
    Where the profile may use the device's room (ProfileConfig.spot_device_room), the room is the allowance (at least
    one copy of the outputs), past spot_device_bytes, and copies past it are let go rather than sent through host
    memory: the ones on the device check the timing already, and a 6.4 GB copy's trip out and back cost 4-5 s of an
    8 s judgment on an H200 (KernelBench's level-1 activations, 2026-12-03; checks.spots_let_go counts them)."""
    if memory_admission.current(pr.device) is None:
        return
    if (rec := memory_admission.record(task_process.task_source(pr.task)[1], pr.ws.backend)) is None:
        return  # admitted alone (the whole device)
    ahead, spots = memory_admission.allowance(rec.get("input_bytes") or 0, rec.get("output_bytes") or 0)
    if pr.tcfg.get("spot_device_room", True):
        pr.tcfg.update(spot_device_bytes=spots, spot_host_bytes=0)
    else:
        pr.tcfg.update(spot_device_bytes=min(pr.tcfg["spot_device_bytes"], spots))
    pr.tcfg.update(ahead_bytes=ahead, spot_device_room=False)


def _admitted(pr: ProfileRun) -> ProfileResult:
    """profile_workspace's work on the device, under its memory admission."""
    ws, cfg = pr.ws, pr.cfg
    bounded(pr)
    source, sha = task_process.task_source(pr.task)
    init_seed = new_seed()
    try:
        if (failed := pr.baseline()) is not None:
            return failed
        pr.lap("baseline")
        with Session(pr.device) as s:
            memory_admission.hand_to(s, pr.device)  # the admitted memory goes with the workers
            # the set-up loads the host as a verify does (processes, the extension, the models, inputs), and a
            # timing beside it reads that load (on CUDA through launch latency): so beside verifies and builds
            # (the shared lock), never during another judgment's timing
            w = s.spawn("timer")
            # the reference: timed as eager beside ModelNew, then checks the spot-checked timed outputs
            eg = task_process.spawn(s, sha)  # kept from an earlier judgment of this task (its verify's, often)
            # both started (under load: the device's initialisation, seconds) before the lock is asked for
            w.wait_ready(cfg.setup_timeout_s, "starting the timer's process")
            eg.wait_ready(cfg.setup_timeout_s, "starting the eager timer's process")
            pr.lap("ready")
            with device_lock(pr.device, exclusive=False):
                pr.lap("setup_queued")
                eg_setup = dict(task=pr.task, device=pr.device, init_seed=init_seed, shm_dir=str(s.dir),
                                compile_mode=cfg.compile_mode, source=source)
                task_process.ask(eg, **eg_setup)
                r = w.request("setup", cfg.setup_timeout_s, "loading the extension and building ModelNew",
                              task=pr.task, device=pr.device, init_seed=init_seed, which="candidate",
                              shm_dir=str(s.dir), extension=str(extension_path(ws)),
                              model_new=str(ws.root / "model_new.py"))
                pr.out["sandbox_notes"] = confinement_notes(r) if "confinement" in r else []
                if not r["ok"]:
                    eg.stop()  # its set-up (and the work after it) may still use the device: ended before the hold goes
                    return pr.result(False, _reason(r["reason"], Reason.init_error), r["message"])
                eg, rr = task_process.setup_reply(s, eg, cfg.setup_timeout_s, "building the reference", **eg_setup)
                if not rr["ok"]:
                    return pr.result(False, Reason.reference_error, rr["message"])
                pr.phases["eager_kept"] = float(eg.reused)
                pr.phases.update(s.ready_waits())
                pr.lap("setup")
                ready = ahead(pr, eg, w)
                if isinstance(ready, ProfileResult):
                    return ready
                if ready is None and not (settled := task_process.settle(eg, cfg.setup_timeout_s))["ok"]:
                    return pr.result(False, Reason.reference_error, settled["message"])
            pairing = timed(pr, eg, w, ready)
            if isinstance(pairing, ProfileResult):
                return pairing
        pr.lap("teardown")
        return scored(pr, pairing)
    except WorkerError as e:
        return pr.result(False, _reason(e.reason, Reason.crash), e.message)


def ahead(pr: ProfileRun, eg, w) -> paired.Ahead | ProfileResult | None:
    """The first pairing's untimed start (paired.ahead), run while the caller holds the device shared: the runs for
    timed(), or the verdict that ends the profile (the candidate failed its warm-up: as it would have inside). None
    where ProfileConfig.timing_ahead is off."""
    cfg = pr.cfg
    if not cfg.timing_ahead:
        return None
    try:
        return paired.ahead(eg, w, new_seed(), pr.tcfg, cfg.timing_timeout_s, cfg.spot_checks,
                            early_stop.guaranteed_rounds(cfg) if cfg.early_stop else None)
    except timing_bound.TimingFailed as e:
        return pr.result(False, _reason(e.reply.get("reason", ""), Reason.runtime_error), e.reply.get("message", ""))
    finally:
        pr.lap("ahead")


def timed(pr: ProfileRun, eg, w, ready: paired.Ahead | None = None) -> dict | ProfileResult:
    """The paired timing of two processes set up (eager's `eg`, the candidate's `w`), its audits and spot checks:
    the pairing, or the verdict that ends the profile. Entered with no device lock held; the candidate's processes
    are stopped while the timing waits for the device. `ready`: the first pairing's runs, from ahead()."""
    # the judge's clock process starts before the timing queues for the device, not inside its exclusive hold
    with judge_clock.attached([eg, w], pr.cfg.judge_clock_process) as clock:
        return _timed(pr, eg, w, ready, clock)


def _timed(pr: ProfileRun, eg, w, ready: paired.Ahead | None, clock: judge_clock.Clock | None) -> dict | ProfileResult:
    ws, cfg, b, tcfg, out, phases, device = pr.ws, pr.cfg, pr.b, pr.tcfg, pr.out, pr.phases, pr.device
    lap, result = pr.lap, pr.result
    # on CUDA the kernel audits (stopping each side's profiler, reading the candidate's table: host work)
    # are given after the device is let go (paired.finish), not inside the exclusive section
    defer = ws.backend == "cuda" and cfg.audit_timed_calls

    def failed(e: timing_bound.TimingFailed) -> ProfileResult:
        return result(False, _reason(e.reply.get("reason", ""), Reason.runtime_error), e.reply.get("message", ""))

    # timing runs alone on the device: no verify, baseline or other timing beside it (device_lock)
    with timing_hold(device, waiting=lambda: paired.paused(w.proc.pid)) as hold:
        held = time.perf_counter()
        out["queued_s"] = hold.queued_s
        phases["queued_reaper"] = hold.drain_s  # of the queueing: this process's ended workers collected first
        lap("queued")
        try:
            try:
                # the clock process on the timing's core too: it wakes there as the side that replied waits
                pids = [eg.proc.pid, w.proc.pid, *([clock.pid] if clock else [])]
                pin = cores.one_core(pids, cuda_visible_devices()) \
                    if ws.backend == "cuda" and cfg.pin_core else contextlib.nullcontext()
                with pin as core:
                    run, bound, attempts = _paired(eg, w, b, tcfg, cfg, ws.backend, defer, ready)
                clock_read = "process" if clock is not None and clock.requests else "thread"
                out["timing_core"] = core
            except timing_bound.TimingFailed as e:
                return result(False, _reason(e.reply.get("reason", ""), Reason.runtime_error),
                              e.reply.get("message", ""))
            lap("timing")
            phases.update({f"timing_{k}": v for k, v in run.pop("steps", {}).items()})
            r = run["candidate"].pop("end")
            e_end = run["eager"].pop("end") or {}
            out["candidate"] = Timing(**run["candidate"])
            out["eager"] = Timing(**run["eager"])
            out["checks"] = r.get("checks", {})
            out["checks"]["judge_clock"] = clock_read  # where the batches' wall times were read (judge_clock)
            if "end_profiler_s" in e_end.get("checks", {}):  # eager's side of the timing's end
                out["checks"]["eager_end_profiler_s"] = e_end["checks"]["end_profiler_s"]
            out["timing_bound"] = bound
            pairing = pairing_of(run, attempts, b, cfg, ws.backend)
            out["paired"] = paired_record(pairing, b)
            if not bound.ok:
                # an audit's verdict (torch_op_used, ...) comes first, as when time_end gave it
                if defer:
                    try:
                        audited(eg, w, cfg, r, out)
                    except timing_bound.TimingFailed as e:
                        return failed(e)
                best = min(bound.batches, key=lambda x: x.implied_ms - x.reported_mean_ms - x.allowed_ms)
                return result(False, Reason.timing_unverified,
                              f"by the judge's own clock the timed calls took at least {bound.implied_ms:.4g} "
                              f"ms each (best batch: {best.implied_ms:.4g} ms, {best.calls} calls in "
                              f"{best.wall_ms:.1f} ms), but the timer reported {best.reported_mean_ms:.4g} ms: "
                              "the reported times cannot be true")
            if cfg.top_kernels and pairing["noise"] is None and not defer:
                top_kernels(w, r, cfg, out)
            lap("kernels")
        finally:
            out["exclusive_s"] = time.perf_counter() - held
        # the spot checks re-run the reference and compare in its process: work on the device, but nothing
        # a timing measures, so beside other judgments' verifies (the lock stepped down to shared, as
        # verify's trials hold it), and without queueing again behind every timing that arrived meanwhile.
        # Unless the copies took the device's spare room (ProfileConfig.spot_device_room): a verify
        # starting beside them could find its memory gone, so they are checked and freed first. Under a memory
        # admission the bound is the footprint's allowance (bounded()), which the admission counted: no spare room
        past_budget = out["checks"].get("spot_device_bytes", 0) > tcfg["spot_device_bytes"]
        out["checks"]["spots_checked_exclusive"] = past_budget
        if not past_budget:
            hold.share()
        # the candidate's audit runs in its process while eager's checks the spot copies (unless a spot
        # check needs the candidate's process: a copy waiting in its host memory), before the lock goes: a
        # process running candidate code never runs beside another judgment's timing
        beside = defer and not any("deferred" in sp for sp in r.get("spots", []))
        if beside:
            paired.ask_audit(w, cfg.top_kernels)
        elif defer:
            c_audit = candidate_audit(w, cfg)
        spot_steps: dict = {}
        bad = spot_checks(eg, w, r.get("spots", []), cfg, spot_steps)
        phases.update({f"spot_checks_{k}": v for k, v in spot_steps.items()})
        if beside:
            c_audit = candidate_audit(w, cfg, asked=True)
        lap("spot_checks")
    if defer:
        # eager's profiler is stopped once the device is let go, the candidate's processes stopped meanwhile
        with paired.paused(w.proc.pid):
            e_audit = eager_audit(eg, cfg)
        if isinstance(c_audit, timing_bound.TimingFailed):
            return failed(c_audit)
        if isinstance(e_audit, timing_bound.TimingFailed):
            return failed(e_audit)
        merge_audits(e_audit, c_audit, r, out)
        if cfg.top_kernels and pairing["noise"] is None:
            top_kernels(w, r, cfg, out)
        lap("audit")
    if bad is not None:
        return result(False, *bad)
    if pairing["noise"] is not None:
        return result(False, Reason.timing_noisy,
                      f"the machine was too noisy to time a speedup: {pairing['noise']}, in "
                      f"{attempts} pairing(s) with ModelNew; nothing is scored from this run: profile "
                      "again (other processes on the machine, or a GPU shared with other work, move "
                      "the times)")
    return pairing


def _paired(eg, w, b, tcfg: dict, cfg: ProfileConfig, backend: str, defer: bool = False,
            ready: paired.Ahead | None = None):
    """Pair; pair again with fresh calibrations when the candidate failed the bound, at most bound_retries times
    (after the first, with a growing pause: a burst of another process's device work lasts seconds); pair again as
    the first time when the rounds were noisy, at most noise_retries times. Returns the last pairing, its bound
    and the count. `ready`: the first pairing's runs, set up ahead (a later pairing sets its own up inside)."""
    seed, timeout = new_seed(), cfg.timing_timeout_s
    # a pairing after a failed bound times the full budget (on CUDA its bound takes a calibration measured after
    # it, which a stop rule could not check beforehand); the first pairing, and one after noise, may stop early
    rule = early_stop.stop_rule(b, cfg, backend)
    run = paired.pair(eg, w, seed, tcfg, timeout, cfg.spot_checks, cfg.top_kernels, rule, defer, ready)
    bound = paired.first_bound(run, b, backend)
    attempts, noise_left, why_again = 1, cfg.noise_retries, []
    bound_tries = 0
    while True:
        if not bound.ok:
            if bound_tries >= cfg.bound_retries:
                break
            bound_tries += 1
            if bound_tries > 1:
                time.sleep(cfg.bound_retry_pause_s * (bound_tries - 1))
            why_again.append("timing bound")
        else:
            why = paired.noise(run, b, cfg.noise_max_spread, cfg.baseline_max_drift, paired.drift_counts(b, cfg, backend),
                               paired.spread_is_local(backend), cfg.candidate_max_spread, min_kept(cfg, backend))
            if why is None or noise_left == 0:
                break
            noise_left -= 1
            why_again.append(why)
        if defer:  # the pairing run again is judged on, but this one's audit counts too, and first
            paired.finish(eg, w, timeout, 0)
        if bound.ok:
            # noise: paired again as the first time, bound included. The recalibrations of paired.again (two
            # audited eager timings, about 1 s on a loaded H100) answer a failed bound, which follows if this
            # pairing's bound fails; a stream pairing calibrates o on its own eager batches anyway (first_bound)
            nxt = paired.pair(eg, w, new_seed(), tcfg, timeout, cfg.spot_checks, cfg.top_kernels, rule, defer)
            paired.add_steps(run, nxt)
            run, bound = nxt, paired.first_bound(nxt, b, backend)
        else:
            run, bound = paired.again(eg, w, run, tcfg, timeout, backend, cfg.spot_checks, cfg.top_kernels)
        attempts += 1
    run["rule"], run["paired_again_for"] = rule, why_again
    return run, bound, attempts


