"""The agent harness: ReAct episodes over the sandbox's MCP tools, parallel rollouts, trajectories,
and KernelBench-style evaluation. `harness.cli:app` holds the `rollout`, `eval` and `export` commands."""

from harness.config import (
    AgentConfig,
    EvalConfig,
    JudgeConfig,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    ToolServerConfig,
)
from harness.trajectory import EpisodeRecord, iter_records, latest_records, load_records

__all__ = ["AgentConfig", "EpisodeRecord", "EvalConfig", "JudgeConfig", "ModelConfig", "RolloutConfig",
           "SamplingConfig", "ToolServerConfig", "iter_records", "latest_records", "load_records"]
