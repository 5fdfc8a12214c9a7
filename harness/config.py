"""Settings of the harness, one pydantic model per concern (the runners take them, they never read flags).

ModelConfig + SamplingConfig say who answers, AgentConfig how an episode runs, ToolServerConfig where
the tools come from, JudgeConfig how the final workspace is judged, RolloutConfig and EvalConfig
compose them for many episodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from sandbox.config import RewardConfig

DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


class SamplingConfig(BaseModel):
    temperature: float | None = Field(None, ge=0, description="None: the server's default")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="sent as an extra field; vLLM and Anthropic accept it")
    max_tokens: int | None = Field(8192, ge=1, description="per response; also capped by the context budget")
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = Field(False, description="ask for the sampled tokens' logprobs (OpenAI-compatible servers)")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="merged into every request as is")


class ModelConfig(BaseModel):
    provider: Literal["openai", "anthropic"] = "openai"
    model: str
    base_url: list[str] = Field(default_factory=list, description=(
        "one or more endpoints serving the same model (e.g. vLLM replicas); empty: the provider's default"))
    api_key: SecretStr | None = Field(None, exclude=True)
    api_key_env: str | None = Field(None, description="environment variable holding the key")
    return_token_ids: bool = Field(False, description="vLLM: ask for prompt and completion token ids")
    max_requests_per_endpoint: int = Field(64, ge=1, description="requests in flight per endpoint")
    request_timeout_s: float = Field(1800.0, gt=0)
    max_retries: int = Field(4, ge=0, description="the SDK's retries of failed or rate-limited requests")
    reasoning_in_history: bool = Field(False, description=(
        "send earlier turns' reasoning back to the model (most chat templates drop it)"))
    anthropic_thinking_budget: int | None = Field(None, ge=1024, description="Anthropic extended thinking tokens")

    def resolved_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        env = self.api_key_env or DEFAULT_KEY_ENV[self.provider]
        return os.environ.get(env)


class AgentConfig(BaseModel):
    max_turns: int = Field(200, ge=1, description="model calls per episode")
    context_budget_tokens: int = Field(128_000, ge=1024, description="prompt plus response, per model call")
    episode_timeout_s: float = Field(3 * 3600.0, gt=0, description="wall clock of the agent's part of an episode")
    tool_timeout_s: float = Field(2400.0, gt=0, description="one tool call (the server has its own limits)")
    max_tool_result_chars: int = Field(40_000, ge=1000, description="longer tool output is cut before the model")
    max_consecutive_truncations: int = Field(3, ge=1, description="responses cut at max_tokens in a row")
    backend: Literal["cuda", "cpu"] | None = Field(None, description="workspace backend; None: the server's")
    hidden_tools: list[str] = Field(default_factory=lambda: ["list_tasks", "open_task", "close_workspace"],
                                    description="the harness manages the workspace; the model never sees these")
    keep_workspaces: bool = Field(False, description="do not close workspaces at the end (for inspection)")
    system_prompt: str | None = Field(None, description=(
        "replaces the system prompt (SKILL.md behind a preamble); for tiny test models, whose short "
        "vocabularies make the manual thousands of tokens long"))


class ToolServerConfig(BaseModel):
    """Where the MCP tools come from: stdio servers this process starts, or running HTTP servers."""

    urls: list[str] = Field(default_factory=list, description="streamable HTTP endpoints; empty: spawn stdio")
    token: SecretStr | None = Field(None, exclude=True, description="bearer token for the HTTP endpoints")
    token_env: str = "CUDA_AGENT_MCP_TOKEN"
    gpus: list[str] | None = Field(None, description="stdio: one server per GPU; None: all visible, [] none")
    episodes_per_server: int | None = Field(None, ge=1, description=(
        "episodes at once per server (per GPU for spawned cuda servers); None: no limit beyond concurrency"))
    root: Path | None = Field(None, description="stdio: where the spawned servers keep workspaces")
    extra_args: list[str] = Field(default_factory=list, description="stdio: more `cuda-agent serve` flags")
    startup_timeout_s: float = Field(120.0, gt=0)
    ray: str | None = Field(None, description=(
        "a Ray cluster (local, auto or HOST:PORT): the tool servers run there as judge actors, one per GPU "
        "(harness.cluster); None: on this host"))
    ray_per_node: int | None = Field(None, ge=1, description="Ray, CPU-only cluster: judge actors per node (1)")
    ray_cpus_per_actor: float | None = Field(None, gt=0, description="Ray: cores each actor holds for its builds "
                                                                       "(default: its share of its node's)")
    ray_max_restarts: int = Field(3, ge=0, description="Ray: restarts of a judge actor that died")

    @model_validator(mode="after")
    def _one_place(self) -> ToolServerConfig:
        if self.ray and self.urls:
            raise ValueError("give --ray or --mcp-url, not both")
        return self

    def resolved_token(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        return os.environ.get(self.token_env) or None


class JudgeConfig(BaseModel):
    """The environment's final judgment of a workspace, whatever the model claimed."""

    verify_trials: int | None = Field(None, ge=1, le=100, description="None: the server's default (5)")
    compile_mode: Literal["default", "max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    reward: RewardConfig = Field(default_factory=RewardConfig)
    timeout_s: float = Field(3600.0, gt=0, description="the whole judgment of one workspace")


class RolloutConfig(BaseModel):
    tasks: list[str] = Field(default_factory=lambda: ["kernelbench"], description="task specs (see harness.specs)")
    samples: int = Field(1, ge=1, description="episodes per task")
    concurrency: int = Field(8, ge=1, description="episodes at once")
    out: Path
    resume: bool = False
    retry_errors: bool = Field(False, description="with resume: run again episodes that ended in an error")
    model: ModelConfig | None = Field(None, description="None when a replay policy answers")
    replay: Path | None = Field(None, description="replay solutions from this folder instead of asking a model")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    tools: ToolServerConfig = Field(default_factory=ToolServerConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    progress: bool = Field(True, description="show a progress bar on a terminal")

    @model_validator(mode="after")
    def _one_policy(self) -> RolloutConfig:
        if (self.model is None) == (self.replay is None):
            raise ValueError("give a model (--model/--base-url) or solutions to replay, not both and not neither")
        return self


class EvalConfig(BaseModel):
    rollout: RolloutConfig
    fast_p_thresholds: list[float] = Field(default_factory=lambda: [0.0, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0])
    plots: bool = True
