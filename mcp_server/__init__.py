"""MCP server for the cuda-agent sandbox: `cuda-agent serve` (stdio or streamable HTTP).

The names below load on first use, so that importing `mcp_server.commands` (which the CLI mounts on a
core install, without the `mcp` extra) does not import the MCP SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CudaAgentServer", "ServerConfig"]
_WHERE = {"CudaAgentServer": "mcp_server.app", "ServerConfig": "mcp_server.config"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mcp_server' has no attribute {name!r}")
