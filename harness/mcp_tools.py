"""Connections to the sandbox's MCP servers, and the tools one episode's model may call.

A ToolServer is one MCP connection (a stdio server this process started, or an HTTP endpoint) that
many episodes share; JSON-RPC lets their calls interleave. EpisodeTools is one episode's view of
it: the model-facing tool list, names mapped back to MCP names, the workspace id bound into every
call, and every way a call can go wrong turned into a tool result the model can read.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import anyio
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, Tool
from pydantic import BaseModel

from harness.tool_schemas import (
    ArgumentError,
    ToolSpec,
    make_spec,
    parse_arguments,
    sanitize_name,
    validate_arguments,
)

# never handed to a spawned server: the model's keys and other secrets of this process
_SECRET_ENV = re.compile(r"(API_KEY|_TOKEN|SECRET|PASSWORD)$|^CUDA_AGENT_MCP_TOKEN$", re.I)


class ToolServerError(RuntimeError):
    """The connection to a tool server broke: the episode cannot go on."""


class ToolOutcome(BaseModel):
    text: str
    structured: dict[str, Any] | None = None
    is_error: bool = False
    duration_s: float = 0.0


def result_text(result: CallToolResult) -> str:
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} omitted]")
    return "\n".join(parts)


class ToolServer:
    """One MCP server shared by many episodes."""

    def __init__(self, alias: str, client: Client, tools: list[Tool], where: str, gpu: str | None = None):
        self.alias = alias
        self.client = client
        self.tools = tools
        self.where = where
        self.gpu = gpu

    async def call(self, name: str, args: dict[str, Any], timeout_s: float) -> ToolOutcome:
        t0 = time.perf_counter()
        try:
            result = await self.client.call_tool(name, args, read_timeout_seconds=timeout_s)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                raise ToolServerError(f"the tool server {self.alias} ({self.where}) closed the connection") from e
            text = (f"the call did not finish within {timeout_s:.0f} s and was cancelled" if e.code == REQUEST_TIMEOUT
                    else f"the tool server refused the call: {e.message}")
            return ToolOutcome(text=text, is_error=True, duration_s=time.perf_counter() - t0)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError) as e:
            raise ToolServerError(f"the tool server {self.alias} ({self.where}) is gone: {e!r}") from e
        return ToolOutcome(text=result_text(result), structured=result.structured_content,
                           is_error=bool(result.is_error), duration_s=time.perf_counter() - t0)


def _server_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k)}


@asynccontextmanager
async def _connected(alias: str, transport: Any, where: str, gpu: str | None,
                     startup_timeout_s: float) -> AsyncIterator[ToolServer]:
    # the client's default timeout bounds the handshake and the listing; tool calls set their own
    async with Client(transport, read_timeout_seconds=startup_timeout_s) as client:
        tools = (await client.list_tools()).tools
        yield ToolServer(alias, client, list(tools), where, gpu)


def serve_args(backend: str | None, root: Path | None, gpu: str | None, max_workspaces: int,
               max_compiles: int | None, extra: list[str]) -> list[str]:
    args = ["-m", "cuda_agent", "serve", "--max-workspaces", str(max_workspaces)]
    if backend:
        args += ["--backend", backend]
    if root is not None:
        args += ["--root", str(root)]
    if gpu is not None:
        args += ["--gpus", gpu]
    if max_compiles is not None:
        args += ["--max-compiles", str(max_compiles)]
    return args + list(extra)


@asynccontextmanager
async def spawn_stdio_server(alias: str, args: list[str], errlog: TextIO, gpu: str | None = None,
                             startup_timeout_s: float = 120.0) -> AsyncIterator[ToolServer]:
    """`python -m cuda_agent serve ...` over stdio; the server and its workspaces go when we leave."""
    params = StdioServerParameters(command=sys.executable, args=args, env=_server_env())
    async with _connected(alias, stdio_client(params, errlog=errlog), "stdio", gpu, startup_timeout_s) as server:
        yield server


@asynccontextmanager
async def connect_http_server(alias: str, url: str, token: str | None,
                              startup_timeout_s: float = 60.0) -> AsyncIterator[ToolServer]:
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with create_mcp_http_client(headers=headers) as http:
        async with _connected(alias, streamable_http_client(url, http_client=http), url, None,
                              startup_timeout_s) as server:
            yield server


class ToolCallOutcome(BaseModel):
    """What became of one tool call of the model: the text it reads back, and how it went."""

    text: str
    is_error: bool
    error_kind: str | None = None  # malformed_arguments, invalid_arguments, unknown_tool, tool_error
    mcp_name: str | None = None
    server: str | None = None
    arguments: dict[str, Any] | None = None  # as sent to the server (bound ones included)
    structured: dict[str, Any] | None = None
    duration_s: float = 0.0


class EpisodeTools:
    """The tools of one episode, as the model sees them."""

    def __init__(self, servers: list[ToolServer], bound_args: dict[str, Any], hidden: set[str],
                 timeout_s: float, max_chars: int, keep_structured: set[str] | None = None):
        self.servers = {s.alias: s for s in servers}
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.keep_structured = keep_structured if keep_structured is not None else {"compile", "verify", "profile", "analyze"}
        taken: set[str] = set()
        self.specs: list[ToolSpec] = []
        # the first server's names win; later servers' tools of the same name get a suffix
        for server in servers:
            for tool in server.tools:
                if tool.name in hidden:
                    continue
                name = sanitize_name(tool.name, taken)
                self.specs.append(make_spec(name, tool.name, server.alias, tool.description,
                                            tool.input_schema, bound_args))
        self.by_name = {s.name: s for s in self.specs}

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        return text[: self.max_chars - 100] + f"\n[... {len(text) - self.max_chars + 100} characters cut]"

    async def call(self, name: str, raw_arguments: str | dict[str, Any] | None) -> ToolCallOutcome:
        spec = self.by_name.get(name)
        if spec is None:
            known = ", ".join(s.name for s in self.specs)
            return ToolCallOutcome(text=f"error: there is no tool named {name!r}. The tools are: {known}.",
                                   is_error=True, error_kind="unknown_tool")
        try:
            args = parse_arguments(raw_arguments)
        except ArgumentError as e:
            return ToolCallOutcome(text=f"error: {e}", is_error=True, error_kind="malformed_arguments",
                                   mcp_name=spec.mcp_name, server=spec.server)
        try:
            full = validate_arguments(spec, args)
        except ArgumentError as e:
            return ToolCallOutcome(text=f"error: {e}", is_error=True, error_kind="invalid_arguments",
                                   mcp_name=spec.mcp_name, server=spec.server, arguments=args)
        outcome = await self.servers[spec.server].call(spec.mcp_name, full, self.timeout_s)
        keep = outcome.structured if spec.mcp_name in self.keep_structured else None
        return ToolCallOutcome(text=self._clip(outcome.text), is_error=outcome.is_error,
                               error_kind="tool_error" if outcome.is_error else None, mcp_name=spec.mcp_name,
                               server=spec.server, arguments=full, structured=keep, duration_s=outcome.duration_s)
