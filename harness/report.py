"""The evaluation report: report.json for machines, report.md for people, plots/*.png.

Everything in it is computed from the episode records, so a report can be rebuilt from
episodes.jsonl at any time (`cuda-agent eval --resume` on a finished run does just that).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from harness.metrics import (
    DEFAULT_THRESHOLDS,
    Metrics,
    ProblemResult,
    best_of_samples,
    by_level,
    compute_metrics,
    curve,
    p_grid,
    result_of,
)
from harness.trajectory import EpisodeRecord


class Report(BaseModel):
    created: float
    policy: dict[str, Any]
    sampling: dict[str, Any]
    judge: dict[str, Any] = Field(description="judge settings, device and torch version the judgments used")
    samples: int
    thresholds: list[float]
    overall: Metrics
    levels: dict[str, Metrics]
    best_of_k: dict[str, Metrics] | None = Field(None, description="with several samples: 'overall' and per level")
    problems: list[ProblemResult]


def _judge_info(records: list[EpisodeRecord]) -> dict[str, Any]:
    devices: Counter[str] = Counter()
    torch_versions: Counter[str] = Counter()
    settings: dict[str, Any] = {}
    for rec in records:
        j = rec.judgment
        if j is None:
            continue
        for k, v in j.settings.items():
            if k not in ("device", "torch_version", "verify_device") and v is not None:
                settings.setdefault(k, v)
        if j.profile is not None and j.profile.device:
            devices[j.profile.device] += 1
            if j.profile.torch_version:
                torch_versions[j.profile.torch_version] += 1
        elif j.verify is not None and j.verify.device:
            devices[j.verify.device] += 1
    backends = Counter(r.backend for r in records if r.backend)
    return {**settings, "devices": dict(devices), "torch_versions": dict(torch_versions),
            "backends": dict(backends),
            "device": devices.most_common(1)[0][0] if devices else None,
            "torch_version": torch_versions.most_common(1)[0][0] if torch_versions else None}


def build_report(records: list[EpisodeRecord], thresholds: list[float] | None = None) -> Report:
    ps = thresholds if thresholds is not None else DEFAULT_THRESHOLDS
    records = sorted(records, key=lambda r: (r.task.id, r.sample))
    rows = [result_of(r) for r in records]
    samples = max((r.sample for r in rows), default=0) + 1
    best = None
    if samples > 1:
        top = best_of_samples(rows)
        best = {"overall": compute_metrics(top, ps), **{lv: compute_metrics(g, ps) for lv, g in by_level(top).items()}}
    first = records[0] if records else None
    return Report(created=time.time(), policy=first.policy if first else {}, sampling=first.sampling if first else {},
                  judge=_judge_info(records), samples=samples, thresholds=ps, overall=compute_metrics(rows, ps),
                  levels={lv: compute_metrics(g, ps) for lv, g in by_level(rows).items()}, best_of_k=best,
                  problems=rows)


def _f(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def _metrics_table(groups: dict[str, Metrics], thresholds: list[float]) -> list[str]:
    key = [f"{p:g}" for p in thresholds]
    head = ["group", "n", "compiled", "correct"] + [f"fast_{k} eager" for k in key if k in ("0", "1")] + \
        [f"fast_{k} compile" for k in key if k in ("1",)] + \
        ["geomean eager (correct)", "geomean eager (all)", "geomean compile (correct)", "geomean compile (all)",
         "mean reward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in groups.items():
        cells = [name, str(m.problems), _f(m.compile_rate, True), _f(m.pass_rate, True)]
        cells += [_f(m.fast_p_eager[k], True) for k in key if k in ("0", "1")]
        cells += [_f(m.fast_p_compile[k], True) for k in key if k in ("1",)]
        cells += [_f(m.geomean_speedup_eager_correct), _f(m.geomean_speedup_eager_all),
                  _f(m.geomean_speedup_compile_correct), _f(m.geomean_speedup_compile_all), _f(m.mean_reward)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fast_p_table(groups: dict[str, Metrics], thresholds: list[float]) -> list[str]:
    key = [f"{p:g}" for p in thresholds]
    lines = ["| group | baseline | " + " | ".join(f"p={k}" for k in key) + " |", "|" + "---|" * (len(key) + 2)]
    for name, m in groups.items():
        lines.append(f"| {name} | eager | " + " | ".join(_f(m.fast_p_eager[k], True) for k in key) + " |")
        lines.append(f"| {name} | torch.compile | " + " | ".join(_f(m.fast_p_compile[k], True) for k in key) + " |")
    return lines


def markdown(report: Report) -> str:
    groups = {"overall": report.overall, **report.levels}
    j = report.judge
    pol = report.policy
    lines = [
        "# Evaluation report", "",
        f"- policy: {pol.get('provider', '?')} / {pol.get('model', '?')}"
        + (f" ({pol['solutions']})" if pol.get("solutions") else ""),
        f"- sampling: {report.sampling or '-'}; samples per problem: {report.samples}",
        f"- device: {j.get('device') or '-'}; torch: {j.get('torch_version') or '-'}; backends: {j.get('backends')}",
        f"- judge: verify trials {j.get('verify_trials') or 'server default'}, atol {j.get('atol', '-')}, "
        f"rtol {j.get('rtol', '-')}, torch.compile mode {j.get('compile_mode', '-')}, "
        f"reward {j.get('reward', {})}",
        "", "fast_p: share of problems that are correct and faster than the baseline by more than p "
        "(fast_0 = pass rate). Geomean (all) counts failed problems as 1x.", "",
        "## Summary", "", *_metrics_table(groups, report.thresholds), "",
        "## fast_p", "", *_fast_p_table(groups, report.thresholds), "",
    ]
    if report.best_of_k:
        lines += [f"## Best of {report.samples} samples per problem", "",
                  *_metrics_table(report.best_of_k, report.thresholds), ""]
    reasons = report.overall.failure_reasons
    if reasons:
        lines += ["## Failures", "", "| reason | count |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])] + [""]
    lines += ["## Problems", "",
              "| task | sample | result | speedup vs eager | vs torch.compile | ModelNew ms | eager ms | "
              "compile ms | turns | ended |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.problems:
        result = r.milestone if r.correct else f"failed ({r.reason})"
        if r.launch_bound:
            result += " (launch-bound)"
        if r.profile_reason:
            result += f" (untimed: {r.profile_reason})"
        lines.append(f"| {r.task_id} | {r.sample} | {result} | {_f(r.speedup_vs_eager)} | {_f(r.speedup_vs_compile)} "
                     f"| {_f(r.candidate_ms)} | {_f(r.eager_ms)} | {_f(r.compiled_ms)} | {r.turns} | {r.ended} |")
    lines += ["", "Plots: plots/fast_p.png, plots/speedups.png", ""]
    return "\n".join(lines)


def plot(report: Report, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, NullFormatter

    folder.mkdir(parents=True, exist_ok=True)
    rows = report.problems
    groups = {"overall": rows, **by_level(rows)}
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    ps = p_grid(rows)
    for ax, baseline, title in ((axes[0], "eager", "vs PyTorch eager"), (axes[1], "compile", "vs torch.compile")):
        for name, g in groups.items():
            ax.plot(ps, curve(g, baseline, ps), label=f"{name} (n={len(g)})", lw=2 if name == "overall" else 1.2)
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        ax.set_title(f"fast_p {title}")
        ax.set_xlabel("speedup threshold p")
        ax.set_xlim(0, ps[-1])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of problems correct and faster than p")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = folder / "fast_p.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    levels = by_level(rows) or {"overall": rows}
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 4), squeeze=False)
    for ax, (name, g) in zip(axes[0], levels.items(), strict=True):
        eager = [r.speedup_vs_eager for r in g if r.correct and r.speedup_vs_eager]
        comp = [r.speedup_vs_compile for r in g if r.correct and r.speedup_vs_compile]
        if eager or comp:
            lo, hi = min(eager + comp + [0.5]), max(eager + comp + [2.0])
            bins = np.geomspace(lo * 0.9, hi * 1.1, 25)
            ax.hist([eager, comp], bins=bins, label=["vs eager", "vs torch.compile"], alpha=0.8)
            ax.set_xscale("log")
            # plain numbers at powers of two on the log axis: 0.5, 1, 2 rather than 5x10^-1
            ax.set_xticks([2.0 ** k for k in range(-10, 11) if lo * 0.9 <= 2.0 ** k <= hi * 1.1])
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.legend(fontsize=8)
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        ax.set_title(f"{name}: {sum(r.correct for r in g)}/{len(g)} correct")
        ax.set_xlabel("speedup (log scale)")
    axes[0][0].set_ylabel("correct problems")
    fig.tight_layout()
    path = folder / "speedups.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def write_report(report: Report, out: Path, plots: bool = True) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.model_dump_json(indent=2))
    (out / "report.md").write_text(markdown(report))
    written = [out / "report.json", out / "report.md"]
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("note: matplotlib is not installed, so the report has no plots "
                  "(pip install 'cuda-agent[harness]')", file=sys.stderr)
            return written
        written += plot(report, out / "plots")
    return written
