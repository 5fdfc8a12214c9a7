"""MCP server for the cuda-agent sandbox: `cuda-agent serve` (stdio or streamable HTTP)."""

from mcp_server.app import CudaAgentServer
from mcp_server.config import ServerConfig

__all__ = ["CudaAgentServer", "ServerConfig"]
