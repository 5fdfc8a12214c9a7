"""`cuda-agent serve`: the MCP server's command, mounted by `cuda_agent.cli`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def serve(
    task: Annotated[str | None, typer.Option(
        help="open a default workspace for this task (path or id); it belongs to the one token (refused with "
             "several: it would be every client's)")] = None,
    workdir: Annotated[Path | None, typer.Option(
        help="serve an existing workspace as the default one (one token at most, as for --task)")] = None,
    transport: Annotated[str, typer.Option(help="stdio or http (streamable HTTP)")] = "stdio",
    host: Annotated[str, typer.Option(help="HTTP bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port (0: any free port)")] = 8765,
    token: Annotated[list[str] | None, typer.Option(
        help="HTTP bearer token; repeat for several clients (or set CUDA_AGENT_MCP_TOKEN)")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="HTTP without a token (loopback only)")] = False,
    root: Annotated[Path | None, typer.Option(help="where workspaces live (default: a temp dir)")] = None,
    backend: Annotated[str | None, typer.Option(help="default backend: cuda or cpu")] = None,
    max_workspaces: Annotated[int | None, typer.Option(help="open workspaces at once, over all clients")] = None,
    max_workspaces_per_client: Annotated[int | None, typer.Option(
        help="open workspaces of one client (token); past it open_task is refused until the client closes one "
             "(default: half of --max-workspaces with several tokens, so one client cannot take every slot; "
             "all of them with one token)")] = None,
    idle_timeout: Annotated[float | None, typer.Option(help="seconds before an unused workspace is closed")] = None,
    max_file_bytes: Annotated[int | None, typer.Option(help="largest file a client may write")] = None,
    max_workspace_bytes: Annotated[int | None, typer.Option(
        help="one workspace's files, build output and kept objects together (default 64 MiB)")] = None,
    max_output_chars: Annotated[int | None, typer.Option(help="text returned by one tool call")] = None,
    compile_timeout: Annotated[float | None, typer.Option(help="seconds per compile call")] = None,
    verify_timeout: Annotated[float | None, typer.Option(help="seconds per verify call")] = None,
    profile_timeout: Annotated[float | None, typer.Option(help="seconds per profile call")] = None,
    trial_timeout: Annotated[float | None, typer.Option(
        help="seconds per input set of a verify: a kernel that never returns holds its GPU this long (default 120)")] = None,
    max_compiles: Annotated[int | None, typer.Option(help="concurrent compiles (default: CPU count)")] = None,
    max_compiles_per_client: Annotated[int | None, typer.Option(
        help="concurrent compiles of one client; more wait in a queue (default: half of --max-compiles with "
             "several tokens, so one client cannot hold every slot)")] = None,
    max_judgments_per_client: Annotated[int | None, typer.Option(
        help="concurrent verify/profile calls of one client; more wait in a queue (default with several tokens: "
             "2, or half the GPUs if more: verifies share a device, so one client's could crowd the others' "
             "off every GPU; no limit with one token)")] = None,
    gpus: Annotated[str | None, typer.Option(help="comma-separated GPU ids to use (default: all visible)")] = None,
    allow_task_files: Annotated[bool | None, typer.Option(
        "--allow-task-files/--no-task-files", help="let open_task read task files (default: stdio only)")] = None,
    prewarm: Annotated[bool | None, typer.Option(
        "--prewarm/--no-prewarm", help="keep a helper with torch loaded ready for the next verify/profile (default: on for cuda)")] = None,
    warm_helpers: Annotated[int | None, typer.Option(
        help="with prewarm, helpers kept ready per device, for bursts of judgments at once (default: "
             "$CUDA_AGENT_WARM_HELPERS, else 1)")] = None,
    process_threads: Annotated[int | None, typer.Option(min=0, help=(
        "limit: threads and processes of each process that runs a client's code (task check, verify, profile), "
        "in a cgroup pids group of its own, else RLIMIT_NPROC under a real uid of its own (a CUDA judgment's "
        "processes: one uid, twice the limit): both bind root "
        "(default 1024; 0: none)"))] = None,
    process_memory_mb: Annotated[int | None, typer.Option(min=0, help=(
        "limit: memory (RLIMIT_DATA) of each process that runs a client's code (default: half the host's, at "
        "most 32 GiB)"))] = None,
    process_file_mb: Annotated[int | None, typer.Option(min=0, help=(
        "limit: largest file a process that runs a client's code may write (default 4096)"))] = None,
    build_memory_mb: Annotated[int | None, typer.Option(min=0, help=(
        "limit: memory (RLIMIT_DATA) of each compiler, assembler and linker of a build (default: a quarter of "
        "the host's, at most 8 GiB)"))] = None,
    build_file_mb: Annotated[int | None, typer.Option(min=0, help=(
        "limit: largest file a build's tool may write, each object and the extension (default 64)"))] = None,
    build_tasks: Annotated[int | None, typer.Option(min=0, help=(
        "limit: threads and processes of one build, ninja's included, in a cgroup pids group where the host "
        "offers one (a build runs no client code; ninja's -j bounds its tools) (default 4096; "
        "the devices a compiler may open are /dev/null alone)"))] = None,
) -> None:
    """Serve the sandbox to MCP clients (Claude Code, Cursor, agents) over stdio or streamable HTTP."""
    import os

    from mcp_server.serve import main as serve_main

    # the judge hands its environment's limits to every confined process and every build it starts
    for name, value in (("CUDA_AGENT_LIMIT_THREADS", process_threads), ("CUDA_AGENT_LIMIT_DATA_MB", process_memory_mb),
                        ("CUDA_AGENT_LIMIT_FSIZE_MB", process_file_mb), ("CUDA_AGENT_BUILD_MEMORY_MB", build_memory_mb),
                        ("CUDA_AGENT_BUILD_FILE_MB", build_file_mb), ("CUDA_AGENT_BUILD_TASKS", build_tasks)):
        if value is not None:
            os.environ[name] = str(value)

    raise typer.Exit(serve_main(
        task=task, workdir=workdir, allow_task_files=allow_task_files, transport=transport, host=host, port=port,
        tokens=token, no_auth=no_auth, root=root, backend=backend, max_workspaces=max_workspaces,
        idle_timeout_s=idle_timeout, max_file_bytes=max_file_bytes, max_workspace_bytes=max_workspace_bytes,
        max_output_chars=max_output_chars,
        compile_timeout_s=compile_timeout, verify_timeout_s=verify_timeout, profile_timeout_s=profile_timeout,
        trial_timeout_s=trial_timeout,
        max_concurrent_compiles=max_compiles, prewarm=prewarm, warm_helpers=warm_helpers,
        max_workspaces_per_client=max_workspaces_per_client,
        max_compiles_per_client=max_compiles_per_client, max_judgments_per_client=max_judgments_per_client,
        gpus=[g.strip() for g in gpus.split(",") if g.strip()] if gpus is not None else None))
