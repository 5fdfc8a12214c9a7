"""Running the server: stdio or streamable HTTP, the idle sweeper beside it, cleanup after."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from pydantic import ValidationError

from mcp_server.app import CudaAgentServer
from mcp_server.config import TOKEN_ENV, ServerConfig
from mcp_server.state import DEFAULT_WITH_SEVERAL_TOKENS


def tokens_from_env() -> list[str]:
    # taken out of the environment so no process we start can read it
    raw = os.environ.pop(TOKEN_ENV, "")
    return [t.strip() for t in raw.split(",") if t.strip()]


async def _stop_on_signals(app: CudaAgentServer, scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for _ in signals:
            scope.cancel()  # running calls stop and kill their helpers
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(10):
                    while app.workspaces.busy():
                        await anyio.sleep(0.05)
                app.shutdown()
            # the SDK reads stdin in a thread that only returns at EOF: do not wait for it
            os._exit(0)


def _uvicorn_server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal after shutting down, which would kill us before the
            # workspaces are cleaned up; this one only asks the server to exit
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server(config)


async def _serve_http(app: CudaAgentServer) -> None:
    import uvicorn

    cfg = app.config
    starlette = app.mcp.streamable_http_app(
        streamable_http_path=cfg.path, host=cfg.host,
        # a file of max_file_bytes may double in size as JSON-escaped text
        max_request_body_size=max(DEFAULT_MAX_REQUEST_BODY_SIZE, 2 * cfg.max_file_bytes + (1 << 16)))
    server = _uvicorn_server(uvicorn.Config(starlette, host=cfg.host, port=cfg.port, log_level="warning",
                                            timeout_graceful_shutdown=5))
    failed: list[int | str | None] = []

    async def run() -> None:
        try:
            await server.serve()
        except SystemExit as e:  # uvicorn's way of saying it could not bind; it has logged why
            failed.append(e.code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not server.started:
            if failed or server.should_exit:
                break
            await anyio.sleep(0.05)
        else:
            _announce(app, server)
    if failed:
        raise RuntimeError(f"the HTTP server could not start on {cfg.host}:{cfg.port}")


def _announce(app: CudaAgentServer, server: Any) -> None:
    # the real port (--port 0 picks a free one): clients and tests read it from this line
    cfg = app.config
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else cfg.port
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    auth = "no auth" if cfg.no_auth else "bearer token required"
    print(f"cuda-agent MCP server on http://{host}:{port}{cfg.path} ({auth}); workspaces in {app.root}",
          file=sys.stderr, flush=True)


async def serve(app: CudaAgentServer) -> None:
    try:
        await anyio.to_thread.run_sync(app.start_template_early)
        async with anyio.create_task_group() as tg:
            tg.start_soon(app.sweep_forever)
            if app.config.transport == "stdio":
                # uvicorn handles signals itself; for stdio we do, so workspaces are cleaned up
                tg.start_soon(_stop_on_signals, app, tg.cancel_scope)
                await app.mcp.run_stdio_async()
            else:
                await _serve_http(app)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # the sweeper and the signal watcher do not fail: this is the transport's own error
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    finally:
        app.shutdown()


def main(task: str | None = None, workdir: Path | None = None, allow_task_files: bool | None = None,
         **settings: Any) -> int:
    """`cuda-agent serve`: exit status 0 after a clean shutdown, 2 for bad settings."""
    if task is not None and workdir is not None:
        print("error: give --task or --workdir, not both", file=sys.stderr)
        return 2
    settings["tokens"] = list(settings.get("tokens") or []) + tokens_from_env()
    if allow_task_files is None:
        # over HTTP a task path would let a client read any .py file on this machine
        allow_task_files = settings.get("transport", "stdio") == "stdio"
    try:
        config = ServerConfig(allow_task_files=allow_task_files,
                              **{k: v for k, v in settings.items() if v is not None})
    except ValidationError as e:
        from sandbox.commands import option_error

        print(f"error: {option_error(e)}", file=sys.stderr)  # each option named, with its rule
        return 2
    if (task is not None or workdir is not None) and len(config.tokens) > 1:
        print(f"error: {DEFAULT_WITH_SEVERAL_TOKENS}", file=sys.stderr)
        return 2
    app = CudaAgentServer(config)
    try:
        if task is not None or workdir is not None:
            app.open_default(task=task, workdir=workdir)
    except Exception as e:  # a bad task or workspace given on the command line
        app.shutdown()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        anyio.run(serve, app)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
