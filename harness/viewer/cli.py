"""`cuda-agent view RUN_DIR`: the HTML report of a rollout, eval or training run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False)


@app.command("view")
def view(
    run: Annotated[Path, typer.Argument(help="a rollout or eval output folder (or its episodes.jsonl)")],
    out: Annotated[Path | None, typer.Option(help="where to write the page [default: RUN/report.html]")] = None,
    metrics: Annotated[Path | None, typer.Option(help="training metrics JSONL [default: RUN/metrics.jsonl]")] = None,
    title: Annotated[str | None, typer.Option(help="the page title [default: the folder's name]")] = None,
    serve: Annotated[bool, typer.Option(help="serve the page on loopback after writing it")] = False,
    port: Annotated[int, typer.Option(help="port for --serve (0: any free one)")] = 8000,
) -> None:
    """Write one self-contained HTML page (no network needed to open it) showing a run: overview and
    charts, a sortable episode table, each episode turn by turn, and training curves."""
    from harness.viewer.data import ViewerError
    from harness.viewer.html import write_html

    try:
        target = write_html(run, out, metrics, title)
    except (ViewerError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(target))
    if serve:
        _serve(target, port)


def _serve(target: Path, port: int) -> None:
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(target.parent))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        typer.echo(f"serving http://127.0.0.1:{server.server_address[1]}/{target.name} (Ctrl-C to stop)", err=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
