"""Out of memory: whose fault it is, and when it is one at all (issue 65, item 2).

A verify holds the device's lock shared: other judgments' verifies, set-ups and kept processes share the GPU's memory
with it. On an H200 eight judgments at a time of 6.4 GB-input tasks failed 13 of 16 verifies `oom` (reward -1) while
each kernel fitted alone. So an out-of-memory failure under the shared lock is no verdict: the verify is run again
once, alone (the lock held exclusively, so that no other judge of this host works on the device), and only what that
run finds is the verdict:

- ModelNew's process runs out of memory alone: `oom`, the candidate's, with its process's peak beside the reference's
  (`torch.cuda.max_memory_allocated` in each; on the CPU backend each process's peak resident memory, which counts
  Python and torch too: no allocator counts a CPU tensor's bytes);
- the task's code runs out (the reference's process, or the task's model in the candidate's process before any
  candidate code): `reference_oom`, the task's, which costs the policy nothing (sandbox/reward.py) unless it came
  from ModelNew's share: where the reference ran out during the trials, beside ModelNew's running forward, the task
  is run once more with no candidate process at all. It fits then: the candidate's memory pushed it over (`oom`); it
  does not: the task's own footprint is too large for the device (`reference_oom`).

"Alone" is the judge's lock and, where memory admission runs (sandbox/timing/memory_admission.py), the whole of the
device's admitted memory (take_whole); a kept task process (parked, its cache given back) still holds its context and
its model: the message says how much of the device was free.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from sandbox.config import VerifyConfig
from sandbox.confinement.processes import Session, Worker, WorkerError
from sandbox.correctness import task_process
from sandbox.results import Reason, VerifyResult
from sandbox.timing.device_lock import device_lock

OOM_REASONS = frozenset({Reason.oom, Reason.reference_oom})
PEAK_TIMEOUT_S = 30.0  # a worker asked for its peak may first finish the request it is on (bounded: then killed)
CANDIDATE_ROLES = ("candidate", "judged")


def contended(v: VerifyResult) -> bool:
    """An out-of-memory failure of a verify that did not have the device to itself."""
    return not v.ok and v.reason in OOM_REASONS and not v.phases.get("alone")


def settled(first: VerifyResult, again: Callable[[], VerifyResult], task_path: str, device: str,
            cfg: VerifyConfig) -> VerifyResult:
    """`first`, or, where it ran out of memory under contention, the verdict of `again` (the same verify with the
    device's lock held exclusively), its reference_oom during the trials checked against the task alone."""
    if not contended(first):
        return first
    v = again()
    v.duration_s += first.duration_s
    v.phases["oom_shared_attempt"] = first.duration_s
    v.sandbox_notes.append(
        f"out of memory beside other judgments' work on the device ({first.reason}: {_head(first.message)}): "
        "verified again alone (the device's lock held exclusively); the verdict is that verify's")
    if not v.ok and v.reason == Reason.reference_oom and "setup" in v.phases:
        v = _blame(v, *task_alone(task_path, device, cfg))
    return v


def _blame(v: VerifyResult, fits: bool, detail: str) -> VerifyResult:
    if fits:
        return v.model_copy(update={"reason": Reason.oom, "message": (
            "the reference ran out of memory beside ModelNew's process with the device to itself, and runs every "
            f"input set with no candidate process ({detail}): ModelNew's memory left it too little. " + v.message)})
    return v.model_copy(update={"message": (
        "the task's reference runs out of memory on this device with no candidate process at all "
        f"({detail}): the task's footprint, not ModelNew's. " + v.message)})


def task_alone(task_path: str, device: str, cfg: VerifyConfig) -> tuple[bool, str]:
    """Whether the task's reference runs as many input sets as a verify draws with no candidate process and the
    device's lock held exclusively; and what it found (its peak, or its failure)."""
    source, sha = task_process.task_source(task_path)
    try:
        with Session(device) as s:
            ref = task_process.spawn(s, sha)
            ref.wait_ready(cfg.setup_timeout_s, "starting the reference's process")  # before the lock, as verify does
            s.hold(device_lock(device, exclusive=True))
            setup = dict(task=task_path, device=device, init_seed=secrets.randbits(62), shm_dir=str(s.dir),
                         source=source, timing=False)
            task_process.ask(ref, **setup)
            ref, r = task_process.setup_reply(s, ref, cfg.setup_timeout_s, "building the reference alone", **setup)
            plan = ["original"] * cfg.trials + ["signed"] * cfg.signed_trials
            for i, variant in enumerate(plan):
                if not r["ok"]:
                    break
                r = ref.request("run", cfg.trial_timeout_s, f"the reference alone on input set {i + 1}",
                                seed=secrets.randbits(62), variant=variant)
            peak = _peaks(ref)
            if r["ok"]:
                return True, f"alone its peak was {peak}"
            return False, f"alone it failed {r.get('reason')}, peak {peak}: {_head(r.get('message', ''))}"
    except WorkerError as e:  # inconclusive: never the candidate's
        return False, f"alone its process failed {e.reason}: {_head(e.message)}"


def with_peaks(s: Session, reason: Reason, message: str) -> str:
    """An out-of-memory message of a verify that had the device to itself, with each process's peak."""
    cand = next((w for w in s.workers if w.role in CANDIDATE_ROLES), None)
    ref = next((w for w in s.workers if w.role not in CANDIDATE_ROLES), None)
    whose = "ModelNew's process" if reason == Reason.oom else "the task's code"
    return (f"{whose} ran out of memory with the device to itself (no other judgment working on it: its lock held "
            f"exclusively). Peaks: ModelNew's process {_peaks(cand)}; the reference's process {_peaks(ref)}. "
            + message)


def _peaks(w: Worker | None) -> str:
    """A worker's memory peaks in words ("memory" request: sandbox/worker/protocol.py), or why they are unknown."""
    if w is None or w._killed or w.proc.poll() is not None:
        return "unknown (its process is gone)"
    try:
        while w.outstanding > 0:  # a request sent beside the one that failed: its answer first
            w.recv(PEAK_TIMEOUT_S, "the request before the memory query")
        m = w.request("memory", PEAK_TIMEOUT_S, "the process's memory peaks")
    except WorkerError as e:
        return f"unknown ({e.reason})"
    if not m.get("ok"):
        return "unknown"
    return describe_peaks(m)


def describe_peaks(m: dict) -> str:
    """The words for a worker's "memory" reply."""
    if "device_peak_bytes" in m:
        text = (f"{gib(m['device_peak_bytes'])} allocated by PyTorch (torch.cuda.max_memory_allocated; "
                f"{gib(m.get('device_reserved_peak_bytes', 0))} reserved)")
        if "device_free_bytes" in m:
            text += f", the device {gib(m['device_free_bytes'])} free of {gib(m['device_total_bytes'])} now"
        return text
    return (f"{gib(m.get('host_peak_bytes', 0))} resident at most (the CPU backend: the whole process's peak, Python "
            "and torch included; no allocator counts a CPU tensor's bytes)")


def gib(n: int | float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


def _head(text: str, limit: int = 300) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line[:limit]
