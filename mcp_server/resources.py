"""Resources: the manual, and each workspace's reference model."""

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError

from mcp_server.state import ServerState
from sandbox.workspace import WorkspaceError
from skills import skill_text


def register_resources(mcp: MCPServer, state: ServerState) -> None:
    @mcp.resource("skill://cuda/SKILL.md", name="SKILL.md", mime_type="text/markdown",
                  description="The agent's operating manual: workspace layout, contract, optimisation guide")
    def skill() -> str:
        return skill_text()

    @mcp.resource("workspace://{workspace_id}/model.py", name="reference model", mime_type="text/x-python",
                  description="The reference PyTorch model of an open workspace (read-only)")
    def reference(workspace_id: str) -> str:
        try:
            entry = state.workspace(workspace_id)
        except ToolError as e:
            raise ResourceNotFoundError(state.redactor.text(str(e))) from None
        try:
            # the task's own text, as the agent must see it: not redacted
            return entry.ws.reference_source()
        except (WorkspaceError, OSError) as e:  # as the tools' errors: no server path in what the client reads
            raise ResourceError(state.redactor.text(str(e))) from None
