"""Compact text renderings of results, for people (CLI) and models (MCP tool text)."""

from __future__ import annotations

from sandbox.results import (
    INTEGRITY_REASONS,
    CompileResult,
    InitResult,
    ProfileResult,
    RewardResult,
    Timing,
    VerifyResult,
)

CAUGHT = "caught by the judge: this fails the episode (reward milestone `failed`) whatever else passed"


def _restored(files: list[str]) -> str:
    return f"\nnote: restored protected file(s) changed on disk: {', '.join(files)}" if files else ""


def compile_text(r: CompileResult) -> str:
    if r.ok:
        what = "up to date" if r.up_to_date else f"rebuilt {', '.join(r.rebuilt) or 'the extension'}"
        if r.steps:
            what += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in r.steps.items()) + ")"
        lines = [f"compile OK ({r.backend}, {r.duration_s:.1f} s): {what}"]
        if r.full_bindings:
            lines.append(f"  note: {', '.join(r.full_bindings)} compiled against the full pybind11 header (about a "
                         "second slower each): only m.def of functions of tensors and numbers builds thin (SKILL.md)")
        warns = [d for d in r.diagnostics if d.severity == "warning"]
        for d in warns[:5]:
            lines.append(f"  warning {d.file}:{d.line}: {d.message}")
        return "\n".join(lines) + _restored(r.restored_files)
    lines = [f"compile FAILED [{r.reason}] ({r.duration_s:.1f} s): {r.message}"]
    for d in r.diagnostics[:15]:
        loc = f"{d.file}:{d.line}" + (f":{d.column}" if d.column else "") if d.file else "(link/ptxas)"
        lines.append(f"  {d.severity} {loc}: {d.message}")
    if not r.diagnostics and r.log_tail:
        lines.append("log tail:\n" + r.log_tail[-1500:])
    if r.log_path:
        lines.append(f"full log: {r.log_path}")
    return "\n".join(lines) + _restored(r.restored_files)


def _generalization(r: VerifyResult) -> str:
    g = r.generalization
    if g is None:
        return ""
    if g.skipped:
        return f"\ngeneralization ({g.variant}): {g.message}"
    return f"\ngeneralization ({g.variant}): " + ("OK" if g.ok else f"FAILED [{g.reason}] {g.message[:500]}")


def verify_text(r: VerifyResult) -> str:
    if r.ok:
        worst = max((o.max_abs_error for t in r.trials for o in t.outputs), default=0.0)
        return (f"verify OK ({r.backend}, {r.duration_s:.1f} s): {r.message}; max abs error {worst:.3g}"
                + _generalization(r) + _restored(r.restored_files))
    lines = [f"verify FAILED [{r.reason}] ({r.duration_s:.1f} s): {r.message[:3000]}"]
    if r.reason in INTEGRITY_REASONS:
        lines.append(CAUGHT)
    if r.torch_ops:
        lines.append("PyTorch ops dispatched by ModelNew.forward: " + ", ".join(r.torch_ops))
    return "\n".join(lines) + _restored(r.restored_files)


def _t(t: Timing | None) -> str:
    if t is None:
        return "n/a"
    retimed = f", re-timed {t.retimed}x" if t.retimed else ""
    return f"{t.median_ms:.4g} ms (IQR {t.iqr_ms:.2g}, n={t.trials}{retimed})"


def _speedup(s: float | None, rng: tuple[float, float] | None) -> str:
    if s is None:
        return ""
    return f"   speedup {s:.3f}x" + (f" [{rng[0]:.2f}-{rng[1]:.2f}]" if rng else "")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "of unknown age"
    return f"{seconds / 3600:.1f} h old" if seconds >= 3600 else f"{seconds / 60:.0f} min old"


def _compile_source(r: ProfileResult) -> str:
    """Where torch.compile's figure comes from: it is not timed in the profile (docs/judge.md)."""
    p = r.paired
    if p is None or p.baseline_compiled_ms is None:
        return "cached baseline"
    why = {"age": ", re-measured: the cached one was too old", "drift": ", re-measured: eager had moved"}
    return (f"scaled from the baseline's {p.baseline_compiled_ms:.4g} ms beside eager {p.baseline_eager_ms:.4g} ms, "
            f"{_age(p.baseline_age_s)}{why.get(p.baseline_retimed or '', '')}")


def _took(r: ProfileResult) -> str:
    """The whole call's time, and how much of it went waiting for the device (other judgments' timing or verify)."""
    waited = r.queued_s + r.phases.get("setup_queued", 0.0)
    return f"{r.duration_s:.1f} s" + (f", {waited:.1f} s of it queued for the device" if waited >= 0.05 else "")


def profile_text(r: ProfileResult) -> str:
    if not r.ok:
        caught = f"\n{CAUGHT}" if r.reason in INTEGRITY_REASONS else ""
        return (f"profile FAILED [{r.reason}] ({_took(r)}): {r.message[:3000]}" + caught
                + _restored(r.restored_files))
    lines = [f"profile ({r.backend}, {r.device}, torch {r.torch_version}, {_took(r)}"
             + (", cached baseline" if r.baseline_cached else "") + ")",
             f"  ModelNew       {_t(r.candidate)}",
             f"  eager          {_t(r.eager)}{_speedup(r.speedup_vs_eager, r.speedup_vs_eager_range)}",
             ]
    if r.compiled is not None and r.speedup_vs_compile is not None:
        lines.append(f"  torch.compile  {_t(r.compiled)}{_speedup(r.speedup_vs_compile, r.speedup_vs_compile_range)}"
                     f" ({r.compile_mode}, {_compile_source(r)})")
        if r.compile_noise:  # shown, never a milestone (sandbox/reward.py)
            lines.append(f"  torch.compile's figure is noisy, no milestone rests on it: {r.compile_noise[:300]}")
    if r.paired is not None:
        pt = r.paired
        of = f" of {pt.max_rounds}" if pt.max_rounds else ""
        why = {"decided": ", stopped early: the milestone was decided", "tight": ", stopped early: the rounds agreed",
               "noisy": ", stopped early: eager already too noisy"}.get(pt.stopped or "", "")
        lines.append(f"  paired: {len(pt.rounds)}{of} rounds of ModelNew between eager batches{why}; eager moved "
                     f"{pt.eager_spread:.2f}x across them" + (f", pairing {pt.attempts}" if pt.attempts > 1 else "")
                     + (f"; {pt.disturbed_rounds} left out (eager moved inside them)" if pt.disturbed_rounds else ""))
    elif r.compile_error:
        lines.append(f"  torch.compile  failed: {r.compile_error.splitlines()[0][:200]}")
    if r.launch_bound:
        lines.append("  launch-bound: eager is below the floor, so the baselines time launch overhead; "
                     "the torch.compile milestone does not count, and faster-than-eager needs a margin "
                     "(RewardConfig.launch_bound_eager_margin)")
    if r.top_kernels and r.profiler is not None:
        p = r.profiler
        lines.append(f"  top kernels (under the profiler: {p.profiled_ms_per_call:.4g} ms/call, vs "
                     f"{p.plain_ms_per_call:.4g} ms/call without it, so each row's time is inflated by its overhead"
                     + (f", {p.overhead_factor:.2f}x" if p.overhead_factor else "") + "; read the percentages):")
    elif r.top_kernels:
        lines.append("  top kernels:")
    for k in r.top_kernels:
        lines.append(f"    {k.percent:5.1f}%  {k.total_ms:.4g} ms/call  x{k.calls}  {k.name[:100]}")
    return "\n".join(lines) + _restored(r.restored_files)


def reward_text(r: RewardResult) -> str:
    why = f", {r.reason}" if r.reason else ""
    caught = f"\n{CAUGHT}" if r.reason in INTEGRITY_REASONS else ""
    return f"reward {r.reward:g} ({r.milestone}{why}){caught}"


def demo_summary(r: RewardResult, backend: str) -> str:
    """One closing line for the demo: what the numbers above add up to."""
    where = "on this GPU" if backend == "cuda" else "on this CPU"
    legend = "(-1 failed, 1 correct, 2 faster than eager, 3 faster than torch.compile by 5%)"
    if r.speedup_vs_eager is None or r.speedup_vs_compile is None:
        return f"ModelNew was not timed {where}: milestone {r.milestone}, reward {r.reward:g} {legend}"
    return (f"ModelNew is {r.speedup_vs_eager:.2f}x eager and {r.speedup_vs_compile:.2f}x torch.compile {where}: "
            f"milestone {r.milestone}, reward {r.reward:g} {legend}")


def init_text(r: InitResult) -> str:
    return (f"workspace {r.workdir} for task {r.task.id} ({r.backend} backend)\n"
            f"files: {', '.join(r.files)}\nnext: write kernels/ and model_new.py (see SKILL.md), then compile")
