"""ServerConfig: every limit and setting of the MCP server, validated once at startup."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

TOKEN_ENV = "CUDA_AGENT_MCP_TOKEN"
WARM_HELPERS_ENV = "CUDA_AGENT_WARM_HELPERS"  # warm_helpers' default, for servers a harness or a Ray actor starts


def _warm_helpers_default() -> int:
    try:
        return max(1, min(16, int(os.environ.get(WARM_HELPERS_ENV, "1"))))
    except ValueError:
        return 1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServerConfig(BaseModel):
    # ---- transport ------------------------------------------------------------------------
    transport: Literal["stdio", "http"] = "stdio"
    host: str = Field("127.0.0.1", description="HTTP bind address; loopback unless you mean otherwise")
    port: int = Field(8765, ge=0, le=65535)
    path: str = Field("/mcp", description="HTTP endpoint path")
    tokens: list[SecretStr] = Field(default_factory=list, description="bearer tokens accepted over HTTP")
    no_auth: bool = Field(False, description="serve HTTP without a token (loopback hosts only)")

    # ---- workspaces -----------------------------------------------------------------------
    root: Path | None = Field(None, description="where workspaces live (default: a fresh temp dir)")
    backend: Literal["cuda", "cpu"] | None = Field(None, description="default backend of new workspaces")
    max_workspaces: int = Field(16, ge=1, description="open workspaces at once, over all clients")
    max_workspaces_per_client: int | None = Field(
        None, ge=1, description="open workspaces of one client (token), so that one cannot take every slot; "
        "default: half of max_workspaces (at least 1) with several tokens, else max_workspaces")
    idle_timeout_s: float = Field(3600.0, gt=0, description="close workspaces unused for this long")
    sweep_interval_s: float = Field(60.0, gt=0, description="how often idle workspaces are looked for")
    check_tasks: bool = Field(True, description="execute a task on the meta device before opening it")
    prewarm: bool | None = Field(None, description="keep a helper with torch already imported and the device "
                                 "initialised ready for the next verify/profile (default: on for cuda workspaces)")
    warm_helpers: int = Field(default_factory=_warm_helpers_default, ge=1, le=16, description=(
        "with prewarm, helpers kept ready per device (and for compiles): a burst of judgments at once (an RL "
        "step's first wave) otherwise finds one ready and starts the rest cold, their workers opening the device "
        "under the burst. Each ready CUDA helper holds two workers with the device open. Default: "
        f"${WARM_HELPERS_ENV}, else 1"))
    allow_task_files: bool = Field(True, description="open_task may name a file on the server's disk")

    # ---- sizes ----------------------------------------------------------------------------
    max_file_bytes: int = Field(1 << 20, ge=1024, description="largest file write_file/edit_file accept")
    max_workspace_bytes: int = Field(64 << 20, ge=1 << 16, description="all of a workspace's files, its build's "
                                     "output and the objects its compiles kept in the object cache, together")
    max_read_bytes: int = Field(16 << 20, ge=1024, description="largest file read_file opens")
    max_output_chars: int = Field(40_000, ge=1000, description="text returned by one tool call")
    max_source_bytes: int = Field(256 << 10, ge=1024, description="largest model source open_task accepts")

    # ---- time -----------------------------------------------------------------------------
    open_timeout_s: float = Field(300.0, gt=0, description="open_task, task check included")
    compile_timeout_s: float = Field(600.0, gt=0, description="one compile (the build is killed past it)")
    verify_timeout_s: float = Field(900.0, gt=0, description="one verify call, all trials")
    profile_timeout_s: float = Field(1800.0, gt=0, description="one profile call, baselines included")
    progress_interval_s: float = Field(5.0, gt=0, description="heartbeat of long calls")

    # ---- judge settings the agent cannot change -------------------------------------------
    verify_trials: int = Field(5, ge=1, le=100, description="default input sets per verify")
    trial_timeout_s: float = Field(120.0, gt=0, le=3600, description=(
        "one input set of a verify (each of the first set's two calls has it too): a kernel that never returns is "
        "killed after this, and until then the verify holds its GPU's lock shared, so no profile there can time. "
        "An RL run whose kernels take milliseconds can set seconds. An upper bound: within it a candidate is given "
        "max(10 s, 100x the reference's time on the input set), VerifyConfig.trial_timeout_floor_s and _factor"))
    max_verify_trials: int = Field(20, ge=1, le=100)
    atol: float = Field(1e-2, ge=0)
    rtol: float = Field(1e-2, ge=0)

    # ---- scheduling -----------------------------------------------------------------------
    max_concurrent_compiles: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    max_compiles_per_client: int | None = Field(
        None, ge=1, description="compiles of one client running at once, more wait in a queue; default: half of "
        "max_concurrent_compiles (at least 1) with several tokens, so one client cannot hold every slot")
    max_judgments_per_client: int | None = Field(
        None, ge=1, description="verify and profile calls of one client running at once, more wait in a queue; "
        "default with several tokens: 2, or half the GPUs where that is more (a profile needs a device's timed "
        "calls to itself, and verifies share one: unbounded, one client's could fill every device's queue); "
        "no limit with one token")
    gpus: list[str] | None = Field(None, description="GPU ids to schedule on (default: all visible)")

    @model_validator(mode="after")
    def _check_auth(self) -> ServerConfig:
        if self.transport == "http":
            if self.no_auth and self.tokens:
                raise ValueError("--no-auth and a token exclude each other")
            if self.no_auth and not is_loopback(self.host):
                raise ValueError(f"--no-auth is allowed only on a loopback host, not {self.host}")
            if not self.no_auth and not self.tokens:
                raise ValueError(f"HTTP needs a bearer token: pass --token or set {TOKEN_ENV} "
                                 "(or --no-auth on a loopback host)")
        if any(len(t.get_secret_value()) < 16 for t in self.tokens):
            raise ValueError("tokens must be at least 16 characters")
        if not self.path.startswith("/"):
            raise ValueError("the HTTP path must start with '/'")
        self.max_verify_trials = max(self.max_verify_trials, self.verify_trials)
        self._default_client_shares()
        return self

    @property
    def several_clients(self) -> bool:
        # one token (or none: stdio, --no-auth) is one principal, who is starving nobody: per-client limits then
        # default to the global ones, so a single trainer's token can still fill --max-workspaces
        return len(self.tokens) >= 2

    def _default_client_shares(self) -> None:
        if self.max_workspaces_per_client is None:
            self.max_workspaces_per_client = (max(1, self.max_workspaces // 2) if self.several_clients
                                              else self.max_workspaces)
        self.max_workspaces_per_client = min(self.max_workspaces_per_client, self.max_workspaces)
        if self.max_compiles_per_client is None:
            self.max_compiles_per_client = (max(1, self.max_concurrent_compiles // 2) if self.several_clients
                                            else self.max_concurrent_compiles)
        self.max_compiles_per_client = min(self.max_compiles_per_client, self.max_concurrent_compiles)

    def judgments_per_client(self, devices: int) -> int | None:
        """The per-client limit on verify/profile calls for a pool of `devices` GPUs; None: no limit."""
        if self.max_judgments_per_client is not None:
            return self.max_judgments_per_client
        return max(2, devices // 2) if self.several_clients else None
