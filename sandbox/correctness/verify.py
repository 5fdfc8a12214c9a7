"""verify: does ModelNew compute what Model computes, on fresh inputs, without PyTorch compute?

Two fresh processes per call. The reference process builds Model, draws each input set from a
new seed, computes the reference outputs and later compares; the candidate process draws the
same inputs from the same seed, runs ModelNew, and exports only its outputs and post-call inputs.
"""

from __future__ import annotations

import secrets
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.backend import device_for
from sandbox.build.compile import extension_path, is_stale
from sandbox.config import VerifyConfig
from sandbox.confinement.filesystem import shared_caches_trusted
from sandbox.confinement.processes import Session, Worker, WorkerError
from sandbox.correctness import oom, task_process
from sandbox.correctness.trial_timeout import TrialClock
from sandbox.results import Reason, TensorCheck, TrialResult, VerifyResult
from sandbox.scan import symbol_scan
from sandbox.scan.static_scan import refusal, shape_overrides
from sandbox.timing import memory_admission
from sandbox.timing.device_lock import device_lock
from sandbox.workspace import Workspace, WorkspaceError


def new_seed() -> int:
    return secrets.randbits(62)


@dataclass
class Carry:
    """A verify whose processes go on to a profile (sandbox/timing/judgment.py): it runs in the caller's session,
    holds the device's shared lock on the caller's stack (let go by the caller, who stops the candidate first), sets
    the task's process up to time too (`eager`: its extra set-up) and starts the candidate in the `judged` role
    (sandbox/worker/judged.py). When the verify passes, `ref`, `cand` and `cand_setup` are the two processes, set
    up, and the candidate's set-up reply."""

    session: Session
    lock: ExitStack
    init_seed: int
    eager: dict = field(default_factory=dict)
    ref: Worker | None = None
    cand: Worker | None = None
    cand_setup: dict = field(default_factory=dict)


def _tolerances(cfg: VerifyConfig) -> dict:
    tol = {"default": (cfg.atol, cfg.rtol), "rel_norm": (cfg.rel_norm_tol,)}
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        tol[dtype] = cfg.tolerance(dtype)
    return tol


def confinement_notes(setup_reply: dict) -> list[str]:
    """What sandbox_notes says about the confinement and limits a candidate process reported."""
    applied = setup_reply.get("confinement")
    if not applied:
        notes = ["filesystem: not confined (no Landlock here, or CUDA_AGENT_CONFINE=off): the candidate can write "
                 "where the user can"]
    else:
        notes = [f"filesystem: confined by {applied}: the candidate writes only its scratch and exchange "
                 "directories"]
    notes += [f"filesystem: {n}" for n in setup_reply.get("confinement_notes", [])]
    if not shared_caches_trusted():
        notes.append("baselines: without Landlock no shared cache is trusted: baseline timings only from this "
                     "judge process's own runs, and torch.compile's baseline compiled from an empty cache")
    return notes + list(setup_reply.get("limits", []))


def preflight(ws: Workspace, static_checks: bool = True) -> tuple[list[str], VerifyResult | None, str | None]:
    """Protected files, a fresh build and the static scan of model_new.py, shared by verify and profile.
    Returns (restored, _, error)."""
    try:
        restored = ws.ensure_protected()
    except WorkspaceError as e:
        return [], None, f"{Reason.protected_file_tampered.value}:{e}"
    if not extension_path(ws).is_file():
        return restored, None, f"{Reason.not_compiled.value}:no built extension: run compile first"
    if is_stale(ws):
        return restored, None, f"{Reason.not_compiled.value}:kernels/ changed since the last successful compile: run compile"
    refused = symbol_scan.scan(extension_path(ws))  # the .so may be newer than the compile that refused it
    if refused:
        return restored, None, f"{Reason.forbidden_symbol.value}:{refused}"
    if not (ws.root / "model_new.py").is_file():
        return restored, None, f"{Reason.import_error.value}:model_new.py is missing"
    if static_checks and (refused := refusal((ws.root / "model_new.py").read_text(errors="replace"))):
        return restored, None, f"{Reason.forbidden_construct.value}:{refused}"
    return restored, None, None


def verify_workspace(ws: Workspace, config: VerifyConfig | None = None) -> VerifyResult:
    cfg = config or VerifyConfig()
    t0 = time.perf_counter()
    restored, _, err = preflight(ws, cfg.static_checks)
    base = dict(backend=ws.backend, atol=cfg.atol, rtol=cfg.rtol, restored_files=restored)
    if err:
        reason, _, msg = err.partition(":")
        return VerifyResult(ok=False, reason=Reason(reason), message=msg, duration_s=time.perf_counter() - t0, **base)
    model_new = ws.root / "model_new.py"
    device = device_for(ws.backend)
    # the device's memory first (timing/memory_admission.py), its lock inside: never the other way round
    with memory_admission.admitted(device, footprint(str(ws.reference_path), ws.backend, device)) as adm:
        v = run_verification(str(ws.reference_path), str(extension_path(ws)), str(model_new), device, cfg, base, t0)
    if adm is not None:
        v.phases["memory_queued"] = adm.waited_s
    return v


def footprint(task_path: str, backend: str, device: str) -> int | None:
    """The task's footprint on `device`, where measured (memory_admission.known_footprint)."""
    if memory_admission.capacity(device) is None:
        return None
    return memory_admission.known_footprint(task_process.task_source(task_path)[1], backend, device)


def run_verification(task_path: str, extension: str | None, model_new: str, device: str, cfg: VerifyConfig,
                     base: dict, t0: float, check_determinism: bool = False, carry: Carry | None = None,
                     alone: bool = False) -> VerifyResult:
    """`carry`: run in a judgment's session, its processes kept for the profile that follows (Carry), as it ran;
    `alone`: with the device's lock held exclusively. Otherwise an out-of-memory failure beside other judgments is run
    again alone before it is the verdict (correctness/oom.py); a judgment does that once its session is over."""
    v = _attempt(task_path, extension, model_new, device, cfg, base, t0, check_determinism, carry, alone)
    if carry is not None or alone:
        return v
    return oom.settled(v, lambda: _attempt(task_path, extension, model_new, device, cfg, base, time.perf_counter(),
                                           check_determinism, None, True), task_path, device, cfg)


def _attempt(task_path: str, extension: str | None, model_new: str, device: str, cfg: VerifyConfig, base: dict,
             t0: float, check_determinism: bool, carry: Carry | None, alone: bool) -> VerifyResult:
    init_seed = carry.init_seed if carry else new_seed()
    generalization: TrialResult | None = None
    source, sha = task_process.task_source(task_path)
    overrides = shape_overrides(source) if cfg.generalize else {}
    plan = [(new_seed(), "original") for _ in range(cfg.trials)] + [(new_seed(), "signed") for _ in range(cfg.signed_trials)]
    trials: list[TrialResult] = []
    torch_ops: dict[str, int] = {}
    device_name = None
    phases: dict[str, float] = {}
    notes: list[str] = []
    clock = TrialClock(cfg)  # the candidate's timeout on an input set, from the reference's time on it

    def result(ok: bool, reason: Reason | None = None, message: str = "") -> VerifyResult:
        if alone and reason in oom.OOM_REASONS:  # the verdict: each process's peak beside it (`s`: the session below)
            message = oom.with_peaks(s, reason, message)
        return VerifyResult(ok=ok, reason=reason, message=message, trials=trials, device=device_name, phases=phases,
                            sandbox_notes=notes, generalization=generalization, shape_overrides=overrides,
                            torch_ops=[f"{k} x{v}" for k, v in sorted(torch_ops.items())],
                            trial_timeout=clock.record() if clock.reference_s is not None else None,
                            duration_s=time.perf_counter() - t0, **base)

    phases["preflight"] = time.perf_counter() - t0  # protected files, build freshness, the scans
    with nullcontext(carry.session) if carry else Session(device) as s:
        if alone:  # an out-of-memory failure's second run: the device's whole memory, not only its lock
            phases["memory_queued_alone"] = memory_admission.take_whole(s, device)
        else:
            memory_admission.hand_to(s, device)  # the admitted memory goes with the workers, as the device lock does
        t_spawn = time.perf_counter()
        ref = task_process.spawn(s, sha)  # kept from an earlier judgment of this task, where this process keeps one
        cand = s.spawn("judged" if carry else "candidate")
        phases["spawn"] = time.perf_counter() - t_spawn
        try:
            # started (under load: the device's initialisation, seconds) before the device's lock is asked for,
            # so that no timing waits for a worker's start
            ref.wait_ready(cfg.setup_timeout_s, "starting the reference's process")
            cand.wait_ready(cfg.setup_timeout_s, "starting the candidate's process")
            phases["ready"] = time.perf_counter() - t_spawn - phases["spawn"]
            # shared: verifies run side by side, but never while a profile times on the device (device_lock);
            # let go only once the workers are gone, in the background (processes.Session)
            lock = device_lock(device, exclusive=alone)  # alone: an out-of-memory failure's second run
            if alone:
                phases["alone"] = 1.0  # not a duration: this verify had the device to itself
            phases["queued"] = carry.lock.enter_context(lock) if carry else s.hold(lock)
            # both processes start (import torch, init the device) concurrently
            t_sent = time.perf_counter()
            ref_setup = {**dict(task=task_path, device=device, init_seed=init_seed, shm_dir=str(s.dir), source=source,
                                timing=False), **(carry.eager if carry else {})}
            task_process.ask(ref, **ref_setup)
            cand.send("setup", task=task_path, device=device, init_seed=init_seed, extension=extension,
                      model_new=model_new, shm_dir=str(s.dir), record_ops=cfg.forbid_torch_ops,
                      audit_ops=cfg.audit_ops,
                      own_kernels=symbol_scan.own_kernels(Path(extension)) if extension and device != "cpu" else None)
            ref, r = task_process.setup_reply(s, ref, cfg.setup_timeout_s, "building the reference", **ref_setup)
            if not r["ok"]:
                return result(False, _reason(r["reason"], Reason.reference_error), r["message"])
            phases["reference_kept"] = float(ref.reused)
            device_name = r.get("device_name")
            c = c_setup = cand.recv(cfg.setup_timeout_s, "loading the extension and building ModelNew")
            if not c["ok"]:
                notes.extend(confinement_notes(c) if "confinement" in c else [])
                return result(False, _reason(c["reason"], Reason.init_error), c["message"])
            # 0 for workers forked from a template, which imported torch before they were asked for
            phases["import_torch"] = max(r.get("import_torch_s", 0.0), c.get("import_torch_s", 0.0))
            # from asking for each process to its being ready to serve: what a template or a pool saves
            phases.update(s.ready_waits({"eager": "reference", "judged": "candidate"}))
            # when each process was ready (from its start), and what its start-up steps cost
            for who, reply in (("reference", r), ("candidate", c)):
                phases[f"{who}_ready"] = reply.get("ready_s", 0.0)
                # the set-up request: from its sending to the worker taking it up (its wait for the worker, or
                # for a core), and the worker's own handling of it
                if isinstance(reply.get("started_at"), float):
                    phases[f"{who}_setup_start"] = max(0.0, reply["started_at"] - t_sent)
                phases[f"{who}_setup_work"] = reply.get("elapsed_s", 0.0)
                for step in ("device_init", "device_runtime", "device_context", "preload", "confine", "task", "canaries", "extension", "model"):
                    if f"{step}_s" in reply:
                        phases[f"{who}_{step}"] = reply[f"{step}_s"]
            if not c.get("network_isolated", False):
                notes.append("network: the candidate shares the host's network (no permission for a network "
                             "namespace here)")
            notes.extend(confinement_notes(c))
            phases["setup"] = time.perf_counter() - t0
            t_trials = time.perf_counter()
            for i, (seed, variant) in enumerate(plan):
                what = f"input set {i + 1} of {len(plan)}" + ("" if variant == "original" else f" ({variant} values)")
                repeat = cfg.repeat_first and i == 0
                ref.send("run", seed=seed, check_determinism=check_determinism, variant=variant)
                cand.send("run", seed=seed, variant=variant, repeat=repeat)
                r = ref.recv(cfg.trial_timeout_s, f"the reference on {what}")
                if not r["ok"]:
                    return result(False, _reason(r["reason"], Reason.reference_error), r["message"])
                if i == 0:  # the task's footprint, kept; a judgment that took the device alone shrinks to it
                    memory_admission.measured(device, sha, base.get("backend", device.partition(":")[0]), r)
                for job, sec in r.get("after_reply", {}).items():  # the reference's warm-up after its set-up
                    phases[f"reference_{job}"] = phases.get(f"reference_{job}", 0.0) + sec
                wait = clock.reference_took(r)  # what the candidate's waits on this set are allowed
                c = cand.recv(wait, f"ModelNew.forward on {what}")
                if c["ok"] and repeat:  # the second call, with a timeout of its own (candidate.py, `again`)
                    c2 = cand.request("again", wait, f"ModelNew.forward again on {what}")
                    c = _merge_again(c, c2) if c2["ok"] else c2
                if not c["ok"]:
                    reason = _reason(c["reason"], Reason.runtime_error)
                    trials.append(TrialResult(seed=seed, variant=variant, ok=False, reason=reason, message=c["message"][:500]))
                    return result(False, reason, c["message"])
                if variant != "original" and not r.get("finite", True):
                    # the task's semantics do not allow this distribution (log, sqrt, ...): not a test
                    cand.request("release", wait, "releasing outputs")
                    trials.append(TrialResult(seed=seed, variant=variant, ok=True, skipped=True,
                                              message="skipped: the reference is not finite on these inputs"))
                    continue
                for k, v in c["torch_ops"].items():
                    torch_ops[k] = torch_ops.get(k, 0) + v
                cmp = ref.request("compare", cfg.trial_timeout_s, f"comparing {what}", outputs=c["outputs"],
                                  inputs=c["inputs"], tolerances=_tolerances(cfg), repeat=c.get("repeat"))
                for name, reply in (("reference_runs", r), ("candidate_runs", c), ("comparisons", cmp)):
                    phases[name] = phases.get(name, 0.0) + reply.get("elapsed_s", 0.0)
                phases["comparisons_open"] = phases.get("comparisons_open", 0.0) + cmp.get("open_s", 0.0)
                for step, sec in c.get("steps", {}).items():
                    phases[f"candidate_{step}"] = phases.get(f"candidate_{step}", 0.0) + sec
                cand.request("release", wait, "releasing outputs")
                if not cmp["ok"]:
                    return result(False, _reason(cmp["reason"], Reason.output_structure), cmp["message"])
                trial = _trial(seed, variant, cmp)
                trials.append(trial)
                if not trial.ok:
                    return result(False, trial.reason, f"{what}: {trial.message}")
                if torch_ops:
                    ops = ", ".join(f"{k} ({v}x)" for k, v in sorted(torch_ops.items()))
                    return result(False, Reason.torch_op_used,
                                  f"ModelNew.forward dispatched PyTorch compute ops: {ops}. All compute must run in "
                                  "your kernels; only allocation (empty*, zeros*), views and metadata are allowed. "
                                  "Ops called from C++ (at::/torch:: functions) count too.")
            phases["trials"] = time.perf_counter() - t_trials
            if cfg.generalize and overrides:
                generalization = _generalization_trial(ref, cand, cfg, overrides, check_determinism, clock)
            if carry and (generalization is None or generalization.ok):
                # carried on only where every call in it went right: a candidate that faulted at other sizes (its
                # failure reported there, never the verify's) may have left its context broken, and is timed, as
                # before, in a process of its own
                try:
                    cand.request("release", cfg.trial_timeout_s, "releasing outputs")  # the other sizes' outputs
                    carry.ref, carry.cand, carry.cand_setup = ref, cand, c_setup
                except WorkerError:
                    pass
        except WorkerError as e:
            if e.reason == "timeout" and e.message.startswith(CANDIDATE_WAITS):  # which rule set its time
                e.message = e.message.replace(" and was killed", f" and was killed ({clock.explain()})", 1)
            return result(False, _reason(e.reason, Reason.crash), e.message)
    phases["teardown"] = time.perf_counter() - t0 - phases.get("setup", 0.0) - phases.get("trials", 0.0)
    n = sum(1 for t in trials if not t.skipped)
    return result(True, None, f"correct on {n} input set{'s' if n != 1 else ''} (atol={cfg.atol:g}, rtol={cfg.rtol:g})")


# the candidate's waits (their `what`), whose timeout is the relative rule's (TrialClock)
CANDIDATE_WAITS = ("ModelNew.forward", "releasing outputs")


def _merge_again(first: dict, again: dict) -> dict:
    """The first input set's two calls as one trial's answer: the second call's output as the repeat, the inputs
    after both, their PyTorch ops and steps summed."""
    def summed(key: str) -> dict:
        out = dict(first.get(key, {}))
        for k, v in again.get(key, {}).items():
            out[k] = out.get(k, 0) + v
        return out

    return {**first, "repeat": again["repeat"], "inputs": again["inputs"], "torch_ops": summed("torch_ops"),
            "steps": summed("steps"), "elapsed_s": first.get("elapsed_s", 0.0) + again.get("elapsed_s", 0.0)}


def _generalization_trial(ref, cand, cfg: VerifyConfig, overrides: dict, check_determinism: bool,
                          clock: TrialClock) -> TrialResult:
    """One input set at other sizes. Its failure is reported, never turned into the main result."""
    seed = new_seed()
    variant = "shapes " + ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    try:
        ref.send("run", seed=seed, check_determinism=False, shapes=overrides)
        cand.send("run", seed=seed, shapes=overrides)
        r = ref.recv(cfg.trial_timeout_s, "the reference at other sizes")
        c = cand.recv(clock.reference_took(r) if r["ok"] else clock.seconds, "ModelNew.forward at other sizes")
        if not r["ok"]:
            return TrialResult(seed=seed, variant=variant, ok=True, skipped=True,
                               message="skipped: the reference does not run at these sizes")
        if not c["ok"]:
            return TrialResult(seed=seed, variant=variant, ok=False, reason=_reason(c["reason"], Reason.runtime_error),
                               message=c["message"][:1500])
        if c["torch_ops"]:
            return TrialResult(seed=seed, variant=variant, ok=False, reason=Reason.torch_op_used,
                               message="PyTorch compute ops at other sizes: " + ", ".join(sorted(c["torch_ops"])))
        cmp = ref.request("compare", cfg.trial_timeout_s, "comparing at other sizes", outputs=c["outputs"],
                          inputs=c["inputs"], tolerances=_tolerances(cfg))
        if not cmp["ok"]:
            return TrialResult(seed=seed, variant=variant, ok=False, reason=_reason(cmp["reason"], Reason.output_structure),
                               message=cmp["message"][:1500])
        return _trial(seed, variant, cmp)
    except WorkerError as e:
        return TrialResult(seed=seed, variant=variant, ok=False, reason=_reason(e.reason, Reason.crash),
                           message=e.message[:1500])


def _reason(value: str, default: Reason) -> Reason:
    try:
        return Reason(value)
    except ValueError:
        return default


def _trial(seed: int, variant: str, cmp: dict) -> TrialResult:
    checks = []
    first_bad = None
    for c in cmp["checks"]:
        tc = TensorCheck(**{k: v for k, v in c.items() if k in TensorCheck.model_fields})
        checks.append(tc)
        if not tc.ok and first_bad is None:
            first_bad = c
    if first_bad is not None:
        return TrialResult(seed=seed, variant=variant, ok=False, outputs=checks,
                           reason=_reason(first_bad.get("reason", "value_mismatch"), Reason.value_mismatch),
                           message=first_bad.get("message", ""))
    if cmp["mutated_inputs"]:
        idx = ", ".join(str(i) for i in cmp["mutated_inputs"])
        return TrialResult(seed=seed, variant=variant, ok=False, reason=Reason.input_mutated, outputs=checks,
                           message=f"ModelNew.forward modified its input(s) {idx} in place; inputs must stay unchanged")
    bad_repeat = next((c for c in cmp.get("repeat_checks", []) if not c.get("ok")), None)
    if bad_repeat is not None:
        return TrialResult(seed=seed, variant=variant, ok=False, reason=Reason.nondeterministic_output, outputs=checks,
                           message="the first call was right but a second call on the same inputs was not: "
                                   + bad_repeat.get("message", "") + " (unwritten output elements, a race, or "
                                   "state carried between calls?)")
    return TrialResult(seed=seed, variant=variant, ok=True, outputs=checks)
