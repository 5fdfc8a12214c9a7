"""CudaAgentServer: the MCPServer over the server's state (mcp_server.state), with its tools and resources."""

from __future__ import annotations

from typing import Any

from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer

from mcp_server.auth import StaticTokenVerifier
from mcp_server.config import ServerConfig
from mcp_server.resources import register_resources
from mcp_server.state import ServerState
from mcp_server.tools import register_tools

INSTRUCTIONS = """\
Write CUDA kernels that replace a PyTorch model's forward pass, then build, check and time them.
Episode: list_tasks -> open_task (returns a workspace_id) -> read_skill (the operating manual) and
read_file model.py -> write_file kernels/... and model_new.py -> compile -> verify -> profile;
repeat until verify passes and profile shows a speedup, then close_workspace.
compile, verify and profile can take minutes; they report progress while they run."""


class CudaAgentServer(ServerState):
    def __init__(self, config: ServerConfig):
        super().__init__(config)
        auth: dict[str, Any] = {}
        if config.transport == "http" and config.tokens:
            host = f"[{config.host}]" if ":" in config.host else config.host
            auth = dict(auth=AuthSettings(issuer_url=f"http://{host}:{config.port}", resource_server_url=None),
                        token_verifier=StaticTokenVerifier([t.get_secret_value() for t in config.tokens]))
        self.mcp: MCPServer = MCPServer("cuda-agent", title="cuda-agent sandbox", instructions=INSTRUCTIONS,
                                        version=_version(), log_level="WARNING", **auth)
        register_tools(self.mcp, self)
        register_resources(self.mcp, self)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-agent")
    except Exception:
        return "0"
