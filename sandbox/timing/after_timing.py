"""What follows a profile's paired timing: the spot-checked timed calls against the reference, the kernel audits of
both sides (given once the device is let go on CUDA) and the candidate's top kernels. sandbox/timing/profile.py's
`timed` calls them, for a profile of its own and for a judgment's (sandbox/timing/judgment.py)."""

from __future__ import annotations

import time

from sandbox.config import ProfileConfig, VerifyConfig
from sandbox.correctness.verify import _reason, _tolerances, new_seed
from sandbox.results import KernelStat, ProfilerCost, Reason
from sandbox.timing import paired, timing_bound


def top_kernels(w, r: dict, cfg: ProfileConfig, out: dict) -> None:
    """The top kernels: from the timed calls' own trace (CUDA), or profiled calls of their own (CPU), which
    need the device to themselves as the timing does."""
    if "kernels" in r:
        out["top_kernels"] = [KernelStat(**k) for k in r["kernels"]]
        return
    k = w.request("kernels", cfg.timing_timeout_s, "profiling ModelNew's kernels", seed=new_seed(), top=cfg.top_kernels)
    if k["ok"]:
        out["top_kernels"] = [KernelStat(**x) for x in k["kernels"]]
        out["profiler"] = ProfilerCost(**k["profiler"])


def spot_checks(eg, w, spots: list[dict], cfg: ProfileConfig, steps: dict | None = None) -> tuple[Reason, str] | None:
    """Each spot-checked timed call against the reference, run again in the eager process on the call's seed:
    the failure's reason and message, or None. A copy the timer kept in host memory ("deferred": large outputs)
    comes back to the device from the timer (`w`) when its turn comes. `steps`: seconds spent running the
    reference ("run"), fetching deferred copies ("fetch") and comparing ("compare") are added to it."""
    steps = {} if steps is None else steps

    def step(name: str, t0: float) -> None:
        steps[name] = steps.get(name, 0.0) + time.perf_counter() - t0

    for i, spot in enumerate(spots):
        what = f"spot check {i + 1} of the timed calls"
        t0 = time.perf_counter()
        rr = eg.request("run", cfg.timing_timeout_s, f"the reference for {what}", seed=spot["seed"])
        step("run", t0)
        if not rr["ok"]:
            return Reason.reference_error, rr["message"]
        outputs = spot.get("outputs")
        if outputs is None:
            t0 = time.perf_counter()
            got = w.request("spot_outputs", cfg.timing_timeout_s, f"the outputs of {what}", index=int(spot["deferred"]))
            step("fetch", t0)
            if not got["ok"]:
                return _reason(got.get("reason", ""), Reason.runtime_error), got.get("message", "")
            outputs = got["outputs"]
        t0 = time.perf_counter()
        cmp = eg.request("compare", cfg.timing_timeout_s, what, outputs=outputs, inputs={"kind": "none"},
                         tolerances=_tolerances(VerifyConfig()))
        step("compare", t0)
        if cmp.get("open_s") is not None:  # of it, opening the copies the timer exported (CUDA IPC, files)
            steps["open"] = steps.get("open", 0.0) + float(cmp["open_s"])
        bad = [c for c in cmp.get("checks", []) if not c.get("ok")] if cmp["ok"] else [cmp]
        if bad:
            return (Reason.spot_check_failed, f"a timed call returned a wrong answer ({bad[0].get('message', '')}): "
                    "the timed calls must compute the same thing as the verified ones")
    return None


def audited(eg, w, cfg: ProfileConfig, r: dict, out: dict) -> None:
    """A deferred pairing's audits (paired.finish) into the candidate's end reply `r` and the profile's checks."""
    merge_audits(*paired.finish(eg, w, cfg.timing_timeout_s, cfg.top_kernels), r, out)


def candidate_audit(w, cfg: ProfileConfig, asked: bool = False) -> dict | timing_bound.TimingFailed:
    if not asked:
        paired.ask_audit(w, cfg.top_kernels)
    try:
        return paired.audit_reply(w, cfg.timing_timeout_s, False)
    except timing_bound.TimingFailed as e:
        return e


def eager_audit(eg, cfg: ProfileConfig) -> dict | timing_bound.TimingFailed:
    paired.ask_audit(eg)
    try:
        return paired.audit_reply(eg, cfg.timing_timeout_s, True)
    except timing_bound.TimingFailed as e:
        return e


def merge_audits(e_end: dict, c_end: dict, r: dict, out: dict) -> None:
    out["checks"].update(c_end.get("checks", {}))
    if "kernels" in c_end:
        r["kernels"] = c_end["kernels"]
    if "end_profiler_s" in e_end.get("checks", {}):
        out["checks"]["eager_end_profiler_s"] = e_end["checks"]["end_profiler_s"]
