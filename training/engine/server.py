"""The engine's HTTP face (starlette on uvicorn):

    GET  /v1/models              the served model
    POST /v1/chat/completions    OpenAI chat completions; `policy_version` in the body and the
                                 X-Policy-Version header; token ids with return_token_ids; logprobs
    POST /v1/weights             {"path": checkpoint folder or file, "version": optional int}: load
                                 new weights without a restart; answers the new version
    GET  /v1/version             {"policy_version": n}

Bad requests get a 400 with an OpenAI-style error body; the server keeps serving.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from training.engine.chat import Backend, RequestError, chat_completion


def _error(status: int, message: str, kind: str = "BadRequestError") -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_app(backend: Backend, default_max_tokens: int = 1024) -> Any:
    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise RequestError(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def models(_: Request) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": backend.model_name, "object": "model",
                                                         "owned_by": "cuda-agent",
                                                         "policy_version": backend.version}]})

    async def version(_: Request) -> Any:
        return JSONResponse({"policy_version": backend.version})

    async def completions(request: Request) -> Any:
        try:
            body = await body_of(request)
            out = await anyio.to_thread.run_sync(chat_completion, backend, body, default_max_tokens)
        except RequestError as e:
            return _error(400, str(e))
        except Exception as e:  # an engine bug fails this request, not the server
            return _error(500, f"{type(e).__name__}: {e}", "InternalServerError")
        return JSONResponse(out, headers={"X-Policy-Version": str(out["policy_version"])})

    async def weights(request: Request) -> Any:
        try:
            body = await body_of(request)
            path = body.get("path")
            ver = body.get("version")
            if not isinstance(path, str) or (ver is not None and not isinstance(ver, int)):
                raise RequestError('send {"path": str, "version": int (optional)}')
            new = await anyio.to_thread.run_sync(backend.load_weights, path, ver)
        except RequestError as e:
            return _error(400, str(e))
        except Exception as e:
            return _error(500, f"{type(e).__name__}: {e}", "InternalServerError")
        return JSONResponse({"policy_version": new})

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/version", version),
                             Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/v1/weights", weights, methods=["POST"])])


def serve(backend: Backend, host: str = "127.0.0.1", port: int = 8000, default_max_tokens: int = 1024) -> None:
    import uvicorn

    uvicorn.run(build_app(backend, default_max_tokens), host=host, port=port, log_level="warning")


@contextmanager
def serve_in_thread(backend: Backend, host: str = "127.0.0.1", default_max_tokens: int = 1024) -> Iterator[str]:
    """Serves on a free port in a background thread; yields the base URL (…/v1). For tests and
    for a learner that hosts its own engine in-process."""
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(build_app(backend, default_max_tokens), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the engine server failed to start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
