"""`cuda-agent analyze WORKDIR [--json]`, mounted by cuda_agent.cli beside the sandbox's other commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


@app.command()
def analyze(workdir: Annotated[Path, typer.Argument(help="a workspace made by `cuda-agent init`")],
            max_kernels: Annotated[int, typer.Option(help="kernels ncu profiles at most, both sides together")] = 48,
            timeout: Annotated[float, typer.Option(help="seconds before the analysis is killed")] = 180.0,
            cache: Annotated[bool, typer.Option(help="reuse an earlier analysis of the same build and task")] = True,
            as_json: Annotated[bool, typer.Option("--json", help="print exactly the result model as JSON")] = False,
            ) -> None:
    """Run ModelNew's forward under Nsight Compute: roofline, occupancy, stalls, ranked bottlenecks (advice, not a
    timing; the torch profiler's table where ncu cannot run)."""
    from sandbox.analyze.analysis import AnalyzeConfig, analyze_workspace
    from sandbox.analyze.present import analyze_text
    from sandbox.commands import _bad_input, _emit, _open

    ws = _open(workdir, as_json)
    try:
        cfg = AnalyzeConfig(max_kernels=max_kernels, timeout_s=timeout, use_cache=cache)
    except ValueError as e:
        _bad_input(str(e), as_json)
    _emit(analyze_workspace(ws, cfg), analyze_text, as_json)
