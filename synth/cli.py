"""`cuda-agent synth ...`: the synthesis pipeline's commands. Heavy imports happen inside commands."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Synthesize training tasks: crawl operators, compose, filter by execution, decontaminate.")

Backend = typer.Option("cpu", "--backend", help="cpu or cuda: sizes the tasks and runs the filter there")
Resume = typer.Option(False, "--resume", help="continue an interrupted run in the same output folder")
Json = typer.Option(False, "--json", help="print the summary as JSON")
EvalFraction = typer.Option(None, "--eval-fraction", min=0.0, max=1.0,
                            help="the share of tasks held out as the eval split, by id hash (default 0.05; a "
                                 "resumed build keeps its first run's)")


def _emit(summary: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    for st in summary.get("stages", [summary]):
        reasons = ", ".join(f"{k} {v}" for k, v in st.get("reasons", {}).items()) or "none"
        typer.echo(f"{st['stage']}: {st['kept']} kept, {st['dropped']} dropped ({reasons})")
        for note in st.get("notes", []):
            typer.echo(f"  note: {note}")
        for t in st.get("tasks", []):
            typer.echo("  " + _nearest_line(t))
    if summary.get("complete") is False:
        typer.echo("incomplete (time limit): run the same command with --resume to continue")
    if summary.get("report"):
        from synth.report import report_lines

        for line in report_lines(summary["report"]):
            typer.echo(line)
    if summary.get("export", {}).get("note"):
        typer.echo(f"note: {summary['export']['note']}")
    if summary.get("export", {}).get("parquet"):
        typer.echo(f"dataset: {summary['export']['rows']} rows at {summary['export']['dataset']} "
                   f"and {summary['export']['parquet']}")
    elif summary.get("export", {}).get("dataset"):
        typer.echo(f"dataset: {summary['export']['rows']} rows at {summary['export']['dataset']}")
    if summary.get("export", {}).get("splits"):
        typer.echo("splits: " + ", ".join(f"{k} {v}" for k, v in summary["export"]["splits"].items()))
    if summary.get("package"):
        pk = summary["package"]
        typer.echo(f"packaged {pk['rows']} tasks at {pk['dest']} ({pk['bytes'] / 1e6:.2f} MB)")


def _nearest_line(t: dict) -> str:
    """One decontaminated task: its verdict, nearest problem, score, what matched, and the textual opinion."""
    line = f"{t['id']}: {t['status']}, nearest {t.get('problem')} at {t.get('score', 0):.2f} by {t.get('by')}"
    shared = (t.get("matched") or {}).get("paths") or (t.get("matched") or {}).get("ops") or []
    if shared:
        line += f" (shared: {'; '.join(shared[:3])})"
    if t.get("text"):
        line += f"; text: {t['text']['problem']} at {t['text']['score']:.2f}"
    return line


def _guard(fn):
    from harness.cluster.connect import ClusterError
    from synth.manifest import StageError

    try:
        return fn()
    except (StageError, FileNotFoundError, ValueError, ClusterError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _check_backend(backend: str) -> None:
    if backend not in ("cpu", "cuda"):
        typer.echo("error: --backend is cpu or cuda", err=True)
        raise typer.Exit(2)


Ray = typer.Option(None, "--ray", help="probe on a Ray cluster's judge actors: local, auto or HOST:PORT "
                                      "(--jobs per actor; needs the ray extra)")


PerWorker = typer.Option(8, "--per-worker", min=1, help="tasks one probe worker runs in turn (torch.compile's "
                         "start paid once, not per task; a drop an earlier task could have caused is decided again in "
                         "a fresh process); 1: a fresh process per task")


def _filter_cfg(backend: str, band: str | None, jobs: int, gpus: str | None, no_compile: bool,
                ray: str | None = None, per_worker: int = 8):
    from synth.filter import FilterConfig

    band_ms = None
    if band:
        try:
            lo, hi = (float(v) for v in band.split(","))
        except ValueError:
            typer.echo("error: --band is LOW,HIGH in milliseconds, e.g. 1,100", err=True)
            raise typer.Exit(2) from None
        band_ms = (lo, hi)
    gpu_list = [int(g) for g in gpus.split(",")] if gpus else None
    return FilterConfig(backend=backend, band_ms=band_ms, jobs=jobs, gpus=gpu_list, compile=not no_compile, ray=ray,
                        per_worker=per_worker)


def _llm(model: str | None, base_url: list[str] | None, provider: str, temperature: float | None):
    if not model:
        return None
    from harness.config import ModelConfig, SamplingConfig

    return (ModelConfig(provider=provider, model=model, base_url=base_url or []),
            SamplingConfig(temperature=temperature, max_tokens=4096))


@app.command("crawl")
def crawl_cmd(out: Path = typer.Option(..., "--out"), backend: str = Backend, resume: bool = Resume,
              no_transformers: bool = typer.Option(False, "--no-transformers", help="torch operators only"),
              as_json: bool = Json) -> None:
    """Seed operators from torch and transformers, one single-operator task each."""
    from synth.stages import crawl_stage

    _check_backend(backend)
    _emit(_guard(lambda: crawl_stage(out, backend, resume, not no_transformers)), as_json)


@app.command("compose")
def compose_cmd(inp: Path = typer.Option(..., "--in"), out: Path = typer.Option(..., "--out"),
                count: int = typer.Option(100, "--count"), seed: int = typer.Option(0, "--seed"),
                max_ops: int = typer.Option(5, "--max-ops", min=2, max=5), backend: str = Backend,
                model: str | None = typer.Option(None, "--model", help="compose with this LLM instead of by rules"),
                base_url: list[str] | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint(s)"),
                provider: str = typer.Option("openai", "--provider", help="openai or anthropic"),
                temperature: float | None = typer.Option(None, "--temperature"),
                resume: bool = Resume, as_json: bool = Json) -> None:
    """Fuse up to 5 operators into tasks, by shape rules (default) or with an LLM (--model)."""
    from synth.stages import compose_stage

    _check_backend(backend)
    llm = _llm(model, base_url, provider, temperature)
    _emit(_guard(lambda: compose_stage(inp, out, count, seed, max_ops, backend, resume, llm)), as_json)


@app.command("filter")
def filter_cmd(inp: Path = typer.Option(..., "--in"), out: Path = typer.Option(..., "--out"), backend: str = Backend,
               band: str | None = typer.Option(None, "--band", help="eager time band LOW,HIGH ms "
                                               "(default 1,100 on cuda, 0.01,1000 on cpu)"),
               jobs: int = typer.Option(1, "--jobs", help="tasks probed at once (on cuda: spread over --gpus)"),
               gpus: str | None = typer.Option(None, "--gpus", help="GPU indices, e.g. 0,1,2,3 (default: all)"),
               no_compile: bool = typer.Option(False, "--no-compile", help="skip the torch.compile check"),
               per_worker: int = PerWorker, resume: bool = Resume, as_json: bool = Json) -> None:
    """Run each task in an isolated worker; keep deterministic, input-sensitive, compilable, in-band ones."""
    from synth.stages import filter_stage

    _check_backend(backend)
    cfg = _filter_cfg(backend, band, jobs, gpus, no_compile, per_worker=per_worker)
    _emit(_guard(lambda: filter_stage(inp, out, cfg, resume)), as_json)


@app.command("decontaminate")
def decontaminate_cmd(inp: Path = typer.Option(..., "--in"), out: Path = typer.Option(..., "--out"),
                      threshold: float | None = typer.Option(None, "--threshold", help="drop at this similarity "
                                                             "or above (default 0.8, by computation or text)"),
                      by: str = typer.Option("computation", "--by", help="computation (trace each task's ATen ops "
                                             "in a worker; text is reported as a second opinion) or text"),
                      kernelbench: Path | None = typer.Option(None, "--kernelbench", help="KernelBench root"),
                      backend: str = Backend, resume: bool = Resume, as_json: bool = Json) -> None:
    """Drop tasks that compute what a KernelBench level 1-3 problem computes; record the nearest for every task."""
    from synth.stages import decontaminate_stage, export_dataset

    _check_backend(backend)
    if by not in ("computation", "text"):
        typer.echo("error: --by is computation or text", err=True)
        raise typer.Exit(2)

    def run() -> dict:
        summary = decontaminate_stage(inp, out, threshold, resume, kernelbench, by)
        summary["export"] = export_dataset(out, backend)
        return summary

    _emit(_guard(run), as_json)


@app.command("build")
def build_cmd(out: Path = typer.Option(..., "--out"), count: int = typer.Option(100, "--count"),
              seed: int = typer.Option(0, "--seed"), max_ops: int = typer.Option(5, "--max-ops", min=2, max=5),
              backend: str = Backend, band: str | None = typer.Option(None, "--band"),
              jobs: int = typer.Option(1, "--jobs"), gpus: str | None = typer.Option(None, "--gpus"),
              no_compile: bool = typer.Option(False, "--no-compile"), per_worker: int = PerWorker,
              threshold: float | None = typer.Option(None, "--threshold"),
              no_transformers: bool = typer.Option(False, "--no-transformers"),
              model: str | None = typer.Option(None, "--model"), base_url: list[str] | None = typer.Option(None, "--base-url"),
              provider: str = typer.Option("openai", "--provider"),
              time_limit: float | None = typer.Option(None, "--time-limit", help="seconds: start no task after "
                                                      "this; continue later with --resume"),
              kernelbench: Path | None = typer.Option(None, "--kernelbench", help="KernelBench root"),
              eval_fraction: float | None = EvalFraction,
              package_to: Path | None = typer.Option(None, "--package", help="once complete, also write the set's "
                                                     "shipped form here (see `synth package`)"),
              resume: bool = Resume, as_json: bool = Json, ray: str | None = Ray) -> None:
    """All five stages into OUT/1-crawl .. OUT/5-selfcheck, then OUT/dataset: the set in train and eval splits,
    its report and card. OUT may be carried to another machine and resumed there."""
    from synth.stages import build

    _check_backend(backend)
    cfg = _filter_cfg(backend, band, jobs, gpus, no_compile, ray, per_worker)
    llm = _llm(model, base_url, provider, None)
    _emit(_guard(lambda: build(out, cfg, count, seed, max_ops, threshold, resume, not no_transformers, llm,
                               time_limit_s=time_limit, kernelbench=kernelbench, eval_fraction=eval_fraction,
                               package_to=package_to)), as_json)


@app.command("card")
def card_cmd(out: Path = typer.Option(..., "--out", help="a build folder"),
             backend: str | None = typer.Option(None, "--backend", help="default: the build's"),
             eval_fraction: float | None = EvalFraction, as_json: bool = Json) -> None:
    """Rewrite OUT/dataset from a finished build: both splits, report.json, README.md card, and the save_to_disk
    files where `datasets` is installed (converts a set built where it was not)."""
    from synth.dataset import write_dataset
    from synth.package import dataset_params

    def run() -> dict:
        be, band, threshold, frac = dataset_params(out, backend)
        exp = write_dataset(out, be, band, threshold, frac if eval_fraction is None else eval_fraction)
        return {"stages": [], "export": {k: v for k, v in exp.items() if k != "report"}, "report": exp["report"]}

    _emit(_guard(run), as_json)


@app.command("package")
def package_cmd(out: Path = typer.Option(..., "--out", help="a finished build folder"),
                to: Path | None = typer.Option(None, "--to", help="default: tasks/synth_set, the set the project "
                                                                 "ships (`cuda-agent tasks synth`)"),
                eval_fraction: float | None = EvalFraction, as_json: bool = Json) -> None:
    """Write a finished build's set in the shipped form: both splits compressed, the datasets files, report, card;
    checked to load before it replaces what was there."""
    from synth.package import package

    res = _guard(lambda: package(out, to, eval_fraction))
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    typer.echo(f"packaged {res['rows']} tasks (train {res['splits']['train']}, eval {res['splits']['eval']}) at "
               f"{res['dest']}: {res['bytes'] / 1e6:.2f} MB in {len(res['files'])} files")
    if res.get("note"):
        typer.echo(f"note: {res['note']}")
