"""The server's state and operations: workspaces, scheduler, helper pool, task list.

The tools and resources receive a ServerState; they never import the module that builds the MCPServer.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

from mcp_server import usage
from mcp_server.auth import current_owner, principal
from mcp_server.config import ServerConfig
from mcp_server.isolated import HelperError, HelperPool, run_in_helper
from mcp_server.models import TaskEntry
from mcp_server.progress import Progress
from mcp_server.redact import Redactor
from mcp_server.runner import BUILD_PREFIX
from mcp_server.scheduling import Scheduler, visible_gpus
from mcp_server.workspaces import DEFAULT_ID, OpenWorkspace, WorkspaceRegistry
from sandbox.api import init_workspace
from sandbox.config import CompileConfig, cache_dir
from sandbox.confinement import template
from sandbox.confinement.environment import worker_env
from sandbox.results import InitResult
from sandbox.workspace import Workspace

log = logging.getLogger("cuda_agent.mcp")

ResultT = TypeVar("ResultT", bound=BaseModel)
T = TypeVar("T")
TASK_ID = re.compile(r"kernelbench[/:]level\d+/[\w.-]+|examples?/[\w.-]+|synth:(?:train|eval)/[\w.-]+")


# how long a server that keeps helpers warm waits at its start for its template's imports (seconds)
TEMPLATE_READY_WAIT_S = 60.0
OBJECTS_DIR = ".objects"  # under the server's root: each client's object cache (not a workspace id: see _ID)

DEFAULT_WITH_SEVERAL_TOKENS = (
    "--task and --workdir make a default workspace, which tools use when no workspace_id is given; with several "
    "tokens it would be every client's, each able to read and overwrite the others' files there. Give one token, "
    "or leave --task/--workdir out so that each client opens its own workspace with open_task (or run one server "
    "per client)")


class ServerState:
    """What the tools act on; mcp_server.app.CudaAgentServer adds the MCPServer that exposes them."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._temp_root = config.root is None
        self.root = Path(tempfile.mkdtemp(prefix="cuda-agent-mcp-")) if config.root is None else config.root
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        self.workspaces = WorkspaceRegistry(self.root, config.max_workspaces, config.max_workspaces_per_client)
        gpus = config.gpus if config.gpus is not None else visible_gpus()
        self.scheduler = Scheduler(config.max_concurrent_compiles, gpus,
                                   compiles_per_client=config.max_compiles_per_client,
                                   judgments_per_client=config.judgments_per_client(max(1, len(gpus))))
        self.redactor = Redactor.for_server(self.root, cache_dir())
        # each client's compiles keep objects in a cache of their own, so that neither a hit (CompileResult.reused,
        # a build's time) nor a name under the root says what another client compiled; named by a keyed digest
        # of the client, so that no one who can guess a client's id can look its folder up; gone with the server
        self.objects_root = self.root / OBJECTS_DIR
        shutil.rmtree(self.objects_root, ignore_errors=True)  # a dead server's, on a --root given again
        self._objects_key = secrets.token_bytes(16)
        self._tasks: list[TaskEntry] | None = None
        self.helpers = HelperPool(config.warm_helpers)

    # ---- workspaces -----------------------------------------------------------------------
    def workspace(self, workspace_id: str | None) -> OpenWorkspace:
        return self.workspaces.get(workspace_id, current_owner())

    def default_owner(self) -> str | None:
        """Who the default workspace (`serve --task` / `--workdir`) belongs to: the one token's client, or nobody
        where there is no token (stdio, --no-auth: one client). With several tokens there is no answer that keeps
        clients apart (MCP server III, item 4): such a server is refused at its start (serve.main)."""
        tokens = self.config.tokens
        if len(tokens) > 1:
            raise ValueError(DEFAULT_WITH_SEVERAL_TOKENS)
        return principal(tokens[0].get_secret_value()) if tokens else None

    def open_default(self, task: str | None = None, workdir: Path | None = None) -> OpenWorkspace:
        """The workspace that tools use when no id is given (`serve --task` / `serve --workdir`)."""
        owner = self.default_owner()
        if workdir is not None:
            ws = Workspace(workdir)
            self.redactor.add_workspace(ws.root)
            return self.workspaces.add(OpenWorkspace(DEFAULT_ID, ws, owner=owner, managed=False, default=True))
        assert task is not None
        spec = self.task_spec(task, allow_files=True)
        ws, _ = init_workspace(spec, self.root / DEFAULT_ID, self.config.backend, check=self.config.check_tasks)
        return self.workspaces.add(OpenWorkspace(DEFAULT_ID, ws, owner=owner, managed=True, default=True))

    # ---- what a client's workspaces hold (mcp_server.usage) -------------------------------------
    def object_cache_dir(self, owner: str | None) -> Path:
        digest = hashlib.sha256(self._objects_key + (owner or "").encode()).hexdigest()[:20]
        return self.objects_root / digest

    def compile_config(self, owner: str | None) -> CompileConfig:
        # a client's cache holds at most what its workspaces may: each entry also counts against the quota of the
        # workspace whose compile kept it, and goes when that workspace is closed
        limit = self.config.max_workspace_bytes * (self.config.max_workspaces_per_client or 1)
        return CompileConfig(timeout_s=self.config.compile_timeout_s, object_cache_dir=str(self.object_cache_dir(owner)),
                             object_cache_max_bytes=limit)

    def build_bytes(self, entry: OpenWorkspace) -> int:
        return usage.usage(entry.ws.root, self.objects_root).build

    def _check_build_output(self, entry: OpenWorkspace) -> None:
        """After a compile: the workspace with its build's output must fit its quota, or that output goes."""
        used = usage.usage(entry.ws.root, self.objects_root)
        limit = self.config.max_workspace_bytes
        if used.total <= limit:
            return
        usage.drop_build(entry.ws.root, self.objects_root)
        raise ToolError(f"the build's output brought the workspace to {used.total} bytes ({used.build} of them "
                        f"objects, the extension and the objects it kept), over its {limit}-byte limit, and was "
                        "removed: data with an initializer (a large array) goes into the object whole; make it "
                        "smaller or fill it at run time")

    def task_spec(self, task: str, allow_files: bool) -> str:
        if TASK_ID.fullmatch(task):
            return task
        if not allow_files:
            raise ToolError("this server does not open task files from its disk: pass a task id from list_tasks "
                            "(e.g. kernelbench/level1/19_ReLU) or the model's source text as `source`")
        path = Path(task).expanduser()
        # absolute, because the sandbox checks the task from another working directory
        path = path if path.is_absolute() else Path.cwd() / path
        if not path.is_file():
            raise ToolError(f"task {task!r} is neither a task id (see list_tasks) nor a file on the server")
        return str(path.resolve())

    async def open_workspace(self, ctx: Context, *, task: str | None, source: str | None, name: str | None,
                             backend: str | None) -> tuple[str, InitResult]:
        request: dict[str, Any] = {"op": "init", "backend": backend or self.config.backend,
                                   "check": self.config.check_tasks}
        if source is not None:
            request.update(source=source, task_id=f"custom/{name or 'model'}")
        else:
            assert task is not None
            request["task"] = self.task_spec(task, self.config.allow_task_files)
        owner = current_owner()
        # before the helper: it forks the task check's worker from this template, not from a daemon of its own
        self.start_template()
        with self.workspaces.reserve(owner):
            ws_id, path = self.workspaces.new_dir()
            request["workdir"] = str(path)
            progress = Progress(ctx, self.config.progress_interval_s)
            try:
                async with progress.heartbeat():
                    await progress.set("checking the task and creating the workspace")
                    data = await self._helper(request, self.config.open_timeout_s, "open_task")
                result = InitResult.model_validate(data)
                entry = OpenWorkspace(ws_id, Workspace(path), owner=owner)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))
                raise
            self.workspaces.add(entry)
        await self.prewarm(entry)
        return ws_id, result

    async def close_workspace(self, entry: OpenWorkspace) -> None:
        self.workspaces.detach(entry)

        def remove() -> None:
            usage.drop_kept(entry.ws.root, self.objects_root)  # before the list of them goes with the build folder
            if entry.managed:
                shutil.rmtree(entry.ws.root, ignore_errors=True)

        await anyio.to_thread.run_sync(remove)

    async def write_files(self, entry: OpenWorkspace, write: Callable[[], T]) -> T:
        """Run a write_file/edit_file in a thread, one at a time per workspace, and never on a closed one."""
        # concurrent edits of one file would each read the same text and the last write would drop the others'
        # changes; concurrent writes would each pass the workspace-size check against the same total
        entry.active += 1  # close_workspace waits: a write could re-create folders of a deleted workspace
        try:
            async with entry.write_lock:
                return await anyio.to_thread.run_sync(write)
        finally:
            entry.active -= 1
            entry.touch()

    async def sweep_idle(self) -> list[str]:
        closed = []
        for entry in self.workspaces.idle(self.config.idle_timeout_s):
            await self.close_workspace(entry)
            closed.append(entry.id)
            log.info("closed idle workspace %s", entry.id)
        return closed

    async def sweep_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.sweep_interval_s)
            await self.sweep_idle()

    def _warm_device(self, entry: OpenWorkspace) -> str | None:
        """The device kind whose helpers are kept warm for this workspace, or None.

        On by default for CUDA, where a cold verify pays two torch imports and two CUDA contexts
        (about 5 s on an H200 host); off by default for the CPU backend, whose users are tests and laptops.
        """
        return entry.ws.backend if self._prewarms(entry.ws.backend) else None

    def _prewarms(self, backend: str | None) -> bool:
        return self.config.prewarm if self.config.prewarm is not None else backend == "cuda"

    def start_template_early(self, wait_s: float = TEMPLATE_READY_WAIT_S) -> dict | None:
        """At the server's start, where it keeps helpers warm (CUDA, or --prewarm), and waited for (up to `wait_s`)
        before the server answers its first client: a pool's server is then ready when it is up. Started at the
        first open_task instead, sixteen concurrent first episodes on a 2 x H200 host spent 8-10 s each in open_task
        waiting for its torch import (later ones 0.5-2.5 s). What the ready template says of itself, or None."""
        if not self._prewarms(self.config.backend):
            return None
        self.start_template()
        own = template.owned()
        return own.wait_ready(wait_s) if own is not None and wait_s > 0 else None

    def start_template(self) -> None:
        """The template that the helpers' workers are forked from (sandbox.confinement.template), so that no
        call waits for a torch import: started when the first workspace opens (before its task check), so that
        it has imported torch by the first verify, and again if it died. Every helper gets a channel to it;
        CUDA_AGENT_FORK=off leaves it out (workers then start by exec)."""
        if template.mode() != "off":
            template.enable(worker_env())

    async def prewarm(self, entry: OpenWorkspace) -> None:
        self.start_template()  # first: the helpers started below get a channel to it
        warm = self._warm_device(entry)
        if warm is None:
            return
        await self.helpers.prefill(None, BUILD_PREFIX + warm)  # the next compile's
        for dev in self.scheduler.pool(entry.ws.backend).devices:
            await self.helpers.prefill(dev.env, warm)

    def shutdown(self) -> None:
        self.helpers.close()
        template.disable()
        self.workspaces.close_all()
        shutil.rmtree(self.objects_root, ignore_errors=True)
        if self._temp_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- tasks ----------------------------------------------------------------------------
    def all_tasks(self) -> list[TaskEntry]:
        if self._tasks is None:
            from tasks import TaskError, list_tasks
            from tasks.loader import EXAMPLES_DIR

            found = [TaskEntry(id=f"example/{p.stem}", name=p.stem) for p in sorted(EXAMPLES_DIR.glob("*.py"))]
            try:
                found += [TaskEntry(id=t.id, name=t.name) for t in list_tasks("kernelbench")]
            except TaskError as e:  # no KernelBench checkout: the examples still work
                log.warning("KernelBench tasks unavailable: %s", e)
            self._tasks = found
        return self._tasks

    # ---- sandbox operations ---------------------------------------------------------------
    async def _helper(self, request: dict[str, Any], limit_s: float, what: str,
                      env: dict[str, str] | None = None, warm_device: str | None = None) -> dict[str, Any]:
        try:
            return await run_in_helper(request, limit_s=limit_s, env=env, pool=self.helpers,
                                       warm_device=warm_device)
        except HelperError as e:
            if e.kind == "input":
                raise ToolError(e.message) from None
            if e.kind == "timeout":
                raise ToolError(f"{what} {e.message}") from None
            log.error("%s failed in the sandbox helper: %s", what, e.message)
            raise ToolError(f"{what} failed inside the sandbox (a server-side problem, not your code): "
                            f"{e.message[-1500:]}") from None

    async def run_op(self, ctx: Context, entry: OpenWorkspace, op: Literal["compile", "verify", "profile", "analyze"],
                     config: BaseModel, model: type[ResultT]) -> ResultT:
        """Queue for the workspace, then for a compile slot or a device, then run in a helper."""
        # the sandbox kills an overlong build itself and says so in the result; the server's limit is the
        # backstop for a compile that hangs anywhere else
        limits = {"compile": self.config.compile_timeout_s + 60, "verify": self.config.verify_timeout_s,
                  "profile": self.config.profile_timeout_s, "analyze": self.config.profile_timeout_s}
        progress = Progress(ctx, self.config.progress_interval_s)
        label = f"{op} of {entry.id}"
        entry.active += 1
        try:
            async with progress.heartbeat():
                if entry.lock.locked():
                    await progress.set(f"queued: {', '.join(entry.running)} is running on this workspace")
                async with entry.lock:
                    entry.running.append(op)
                    try:
                        data = await self._run_scheduled(progress, entry, op, config, limits[op], label)
                        if op == "compile":  # still under the workspace's lock: no write or build between
                            await anyio.to_thread.run_sync(self._check_build_output, entry)
                    finally:
                        entry.running.remove(op)
        finally:
            entry.active -= 1
            entry.touch()
        return model.model_validate(data)

    async def _run_scheduled(self, progress: Progress, entry: OpenWorkspace, op: str, config: BaseModel,
                             limit_s: float, label: str) -> dict[str, Any]:
        request = {"op": op, "workdir": str(entry.ws.root), "config": config.model_dump(mode="json")}
        owner = current_owner()  # the caller, who may not own the workspace: the default one is shared
        if op == "compile":
            # a verify follows a compile: its helper warms up while this builds (no-op if one waits)
            await self.prewarm(entry)
            warm = self._warm_device(entry)
            async with self.scheduler.compile_slot(progress.set, owner):
                await progress.set("compiling")
                return await self._helper(request, limit_s, op, warm_device=BUILD_PREFIX + warm if warm else None)
        self.start_template()
        # the pool picks the least busy GPU; the timing itself takes the device exclusively inside the judge
        # (sandbox.timing.device_lock), so a profile's set-up, spot checks and teardown overlap other calls on
        # the same GPU instead of holding it for the whole call. CPU timings still run one at a time: the
        # CPU's processes load the cores a timing runs on from the moment they start
        exclusive = op == "profile" and entry.ws.backend == "cpu"
        async with self.scheduler.judgment_slot(entry.ws.backend, owner, exclusive=exclusive, label=label,
                                                on_queued=progress.set) as dev:
            await progress.set(f"{op} running on {dev.name}")
            return await self._helper(request, limit_s, op, env=dev.env, warm_device=self._warm_device(entry))

