"""verl's tool class for cuda-agent (named in the tool_config.yaml that `cuda-agent export --format
verl` writes; imported by verl's tool registry, so it needs verl installed, unlike the rest of
the package). One instance per tool; the workspace of an episode is keyed by verl's request id and
lives in harness.verl.WorkspaceSessions, shared by all tools of the process. verl calls
create/execute/release per tool call (ToolAgentLoop._call_tool) and has no end-of-episode hook, so
the workspace is named in the episode's extra_fields, and the reward closes it."""

from __future__ import annotations

import os
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from harness.verl import WORKSPACE_FIELD, WorkspaceSessions

_SESSIONS: dict[tuple[str, ...], WorkspaceSessions] = {}


class CudaAgentTool(BaseTool):
    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        urls = tuple(config["mcp_urls"])
        if urls not in _SESSIONS:
            _SESSIONS[urls] = WorkspaceSessions(list(urls), os.environ.get(config.get("token_env",
                                                                                       "CUDA_AGENT_MCP_TOKEN")),
                                                config.get("timeout_s", 2400.0), config.get("max_result_chars", 40_000))
        self.sessions = _SESSIONS[urls]
        self.tasks: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id)
        self.tasks[instance_id] = kwargs.get("create_kwargs") or {}
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse,
                                                                                                  float, dict]:
        agent_data = kwargs.get("agent_data")
        request_id = getattr(agent_data, "request_id", None) or instance_id
        try:
            text = await self.sessions.call(request_id, self.tasks[instance_id], self.name, parameters)
        except Exception as e:  # the episode goes on; the model reads what went wrong
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # anyio task groups wrap it
                e = e.exceptions[0]
            text = f"error: the tool server failed: {type(e).__name__}: {e}"
        if agent_data is not None and request_id in self.sessions.open:
            # verl hands the episode's extra_fields to the reward (extra_info): it judges and closes this
            url, ws_id = self.sessions.open[request_id]
            agent_data.extra_fields[WORKSPACE_FIELD] = {"url": url, "workspace_id": ws_id}
        return ToolResponse(text=text), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.tasks.pop(instance_id, None)
