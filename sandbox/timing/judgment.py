"""A judgment: verify, then profile where the verify passed, in one session with one candidate process.

`verify_workspace` and `profile_workspace` each start the task's process and the candidate's. The task's process is
kept between operations already (sandbox/confinement/kept.py); the candidate's never is, so a judgment that verifies
and then profiles created two candidate processes, and on a GPU two CUDA contexts, which under eight judgments at a
time queue in the driver beside everything else on the device. Here the candidate's process is started once, as the
`judged` role (sandbox/worker/judged.py: the candidate role inside the timer role, every canary calibrated before
any candidate code runs), verified, then timed.

What the profile gets is what profile_workspace would have measured. The processes are the same kinds set up the
same way; warm-up calls precede every timing, as they always did; the device lock is held as the two operations
held it (shared for set-up and trials, exclusive for the timing, shared for the spot checks), and the candidate is
stopped from before the shared lock is let go until the timing holds the device, as a profile stops its timer while
it waits. Only a verify that passed in full carries its processes on: one whose candidate failed a trial at other
sizes (reported, never the verdict) is profiled as before, in fresh processes. docs/judge.md, "One candidate
process per judgment", has the reasoning.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

from sandbox.build.compile import extension_path
from sandbox.config import ProfileConfig, VerifyConfig
from sandbox.confinement import proctree
from sandbox.confinement.processes import Session, WorkerError
from sandbox.correctness import oom
from sandbox.correctness.verify import (
    Carry,
    _reason,
    confinement_notes,
    footprint,
    new_seed,
    preflight,
    run_verification,
    verify_workspace,
)
from sandbox.results import ProfileResult, Reason, VerifyResult
from sandbox.timing import memory_admission, paired
from sandbox.timing.profile import ProfileRun, ahead, bounded, profile_workspace, scored, timed
from sandbox.workspace import Workspace


def judge_workspace(ws: Workspace, verify: VerifyConfig | None = None,
                    profile: ProfileConfig | None = None) -> tuple[VerifyResult, ProfileResult | None]:
    """verify_workspace, then profile_workspace if it passed, sharing their processes: the two results, as the two
    calls give them (the profile None where the verify failed)."""
    vcfg, pcfg = verify or VerifyConfig(), profile or ProfileConfig()
    if pcfg.static_checks and not vcfg.static_checks:  # the profile scans what this verify does not: two calls
        v = verify_workspace(ws, vcfg)
        return v, (profile_workspace(ws, pcfg) if v.ok else None)
    t0 = time.perf_counter()
    restored, _, err = preflight(ws, vcfg.static_checks)
    base = dict(backend=ws.backend, atol=vcfg.atol, rtol=vcfg.rtol, restored_files=restored)
    if err:
        reason, _, msg = err.partition(":")
        return VerifyResult(ok=False, reason=Reason(reason), message=msg, duration_s=time.perf_counter() - t0,
                            **base), None
    pr = ProfileRun(ws, pcfg, t0, restored)
    # one admission for the verify and the profile (timing/memory_admission.py), outside the device lock; let go with
    # the session's workers (hand_to, in run_verification)
    with memory_admission.admitted(pr.device, footprint(pr.task, ws.backend, pr.device)) as adm, \
            Session(pr.device) as s, ExitStack() as lock:
        carry = Carry(session=s, lock=lock, init_seed=new_seed(),
                      eager={"timing": True, "compile_mode": pcfg.compile_mode})
        v = run_verification(pr.task, str(extension_path(ws)), str(ws.root / "model_new.py"), pr.device, vcfg,
                             base, t0, carry=carry)
        if adm is not None:
            v.phases["memory_queued"] = adm.waited_s
        if not v.ok or carry.cand is None:
            # let go once the workers are gone, as a verify of its own lets its lock go (a dying context is work on
            # the device); a verify that passed without processes fit to time on is profiled as before, after that
            s.hold(lock.pop_all())
            again = v.ok
        else:
            again = False
            pairing = _profiled(pr, carry)
            if isinstance(pairing, ProfileResult):
                return v, pairing
    if oom.contended(v):  # out of memory beside other judgments' work: verified again alone, then profiled as before
        v = oom.settled(v, lambda: run_verification(pr.task, str(extension_path(ws)), str(ws.root / "model_new.py"),
                                                    pr.device, vcfg, base, time.perf_counter(), alone=True),
                        pr.task, pr.device, vcfg)
        again = v.ok
    if again:
        return v, profile_workspace(ws, pcfg)
    if not v.ok:
        return v, None
    pr.lap("teardown")
    return v, scored(pr, pairing)


def _profiled(pr: ProfileRun, carry: Carry) -> dict | ProfileResult:
    """The profile's timing in the verify's processes (`carry`): the pairing, or the verdict that ends it."""
    pr.restart()  # the profile's own duration and laps start at its verify's end
    bounded(pr)  # the footprint its verify measured bounds the timer's draws and copies
    try:
        if (failed := pr.identify()) is not None:
            return failed
        pr.out["sandbox_notes"] = confinement_notes(carry.cand_setup)
        pr.phases["eager_kept"] = float(carry.ref.reused)
        pr.phases["candidate_carried"] = 1.0  # timed in its verify's process (absent where a profile started its own)
        # the first pairing's untimed start, still under the verify's shared hold
        ready = ahead(pr, carry.ref, carry.cand)
        if isinstance(ready, ProfileResult):
            return ready
        # the candidate stopped before the shared lock goes, and held stopped until its timing holds the device
        # (timed() stops it again while it waits, and lets it run once the device is its): it never runs beside
        # another judgment's timing, as a profile's timer, set up under the shared lock, does not
        with paired.paused(carry.cand.proc.pid):
            proctree.wait_stopped([carry.cand.proc.pid])  # delivered, not only sent, before the lock goes
            carry.lock.close()
            if (failed := pr.baseline()) is not None:
                return failed
            pr.lap("baseline")
            return timed(pr, carry.ref, carry.cand, ready)
    except WorkerError as e:
        return pr.result(False, _reason(e.reason, Reason.crash), e.message)
