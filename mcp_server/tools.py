"""The tools: typed arguments with limits, a structured result and a compact text for the model.

No `from __future__ import annotations` here: the SDK builds each tool's schema from its
annotations, and some of them close over the server's configuration.
"""

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from mcp_server import files
from mcp_server.auth import current_owner
from mcp_server.models import (
    ClosedWorkspace,
    FileChunk,
    FileList,
    FileWritten,
    OpenedWorkspace,
    TaskEntry,
    TaskList,
)
from mcp_server.state import ServerState
from sandbox import present
from sandbox.analyze.analysis import AnalyzeConfig
from sandbox.analyze.present import analyze_text
from sandbox.analyze.result import AnalyzeResult
from sandbox.config import ProfileConfig, VerifyConfig
from sandbox.results import CompileResult, ProfileResult, VerifyResult
from skills import skill_text

WorkspaceId = Annotated[str | None, Field(
    description="the workspace_id open_task returned; may be omitted when the server was started for one task")]
FilePath = Annotated[str, Field(min_length=1, max_length=512,
                                description="path relative to the workspace, e.g. kernels/relu.cu or model_new.py")]

READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True, openWorldHint=False)
# compile writes only build/, and the same sources build to the same extension
BUILDS = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=False)
OVERWRITES = ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=False)
EDITS = ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False, openWorldHint=False)
CREATES = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=False)
# verify and profile only read the workspace (they restore protected files an agent tampered with)
JUDGES = ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True, openWorldHint=False)


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 80] + f"\n[... {len(text) - limit + 80} more characters cut by the server's output limit]"


def reply(result: BaseModel, text: str, limit: int) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=clip(text, limit))],
                          structured_content=result.model_dump(mode="json"))


ToolFn = Callable[..., Awaitable[CallToolResult]]


@functools.cache
def shipped_eval_tasks() -> tuple[TaskEntry, ...]:
    """The eval split of the synthesized set shipped with the project (`synth:eval/...`): open_task takes those
    ids; empty where no set is shipped."""
    from tasks import TaskError, list_tasks

    try:
        return tuple(TaskEntry(id=t.id, name=t.name) for t in list_tasks("synth:eval"))
    except TaskError:
        return ()


def redacting_tool(mcp: MCPServer, state: ServerState, **options: Any) -> Callable[[ToolFn], ToolFn]:
    """`mcp.tool(**options)` for a tool whose every reply and ToolError leaves through the server's redactor, so
    no server path reaches a client whatever the sandbox, the compiler or the OS put into a text."""
    def register(fn: ToolFn) -> ToolFn:
        @functools.wraps(fn)  # the SDK reads the signature, the annotations and the docstring through this
        async def run(*args: Any, **kwargs: Any) -> CallToolResult:
            try:
                result = await fn(*args, **kwargs)
            except ToolError as e:
                raise ToolError(clip(state.redactor.text(str(e)), state.config.max_output_chars)) from None
            result = state.redactor.result(result)
            # a placeholder may be longer than the path it replaced
            return result.model_copy(update={"content": [
                c.model_copy(update={"text": clip(c.text, state.config.max_output_chars)})
                if isinstance(c, TextContent) else c for c in result.content]})
        return mcp.tool(**options)(run)
    return register


def register_tools(mcp: MCPServer, state: ServerState) -> None:
    cfg = state.config
    out = cfg.max_output_chars

    def tool(**options: Any) -> Callable[[ToolFn], ToolFn]:
        return redacting_tool(mcp, state, **options)

    @tool(annotations=READ_ONLY)
    async def list_tasks(
        query: Annotated[str | None, Field(max_length=200, description="case-insensitive substring of the task id")]
        = None,
        level: Annotated[int | None, Field(ge=1, le=9, description="KernelBench level (1, 2 or 3)")] = None,
        offset: Annotated[int, Field(ge=0, description="index of the first task to return")] = 0,
        limit: Annotated[int, Field(ge=1, le=500, description="tasks per page")] = 50,
    ) -> Annotated[CallToolResult, TaskList]:
        """List the tasks open_task accepts: the bundled examples, the shipped synthesized eval set (synth:eval/...)
        and KernelBench where the server has it; filterable and paged."""
        found = await anyio.to_thread.run_sync(state.all_tasks)
        found = found + list(await anyio.to_thread.run_sync(shipped_eval_tasks))
        if level is not None:
            found = [t for t in found if t.id.startswith(f"kernelbench/level{level}/")]
        if query:
            q = query.lower()
            found = [t for t in found if q in t.id.lower()]
        page = found[offset: offset + limit]
        nxt = offset + len(page) if offset + len(page) < len(found) else None
        result = TaskList(total=len(found), offset=offset, tasks=page, next_offset=nxt)
        lines = [f"{len(page)} of {len(found)} matching tasks, from offset {offset}:"] + [t.id for t in page]
        if nxt is not None:
            lines.append(f"more: call list_tasks with offset={nxt}")
        return reply(result, "\n".join(lines), out)

    @tool(annotations=CREATES)
    async def open_task(
        ctx: Context,
        task: Annotated[str | None, Field(max_length=500, description=(
            "a task id from list_tasks (example/swish_bias, synth:eval/fused_04a929bf790c, "
            "kernelbench/level1/19_ReLU)"
            + (" or a task file path on the server" if cfg.allow_task_files else "")))] = None,
        source: Annotated[str | None, Field(max_length=cfg.max_source_bytes, description=(
            "instead of `task`: the full source of a KernelBench-style model.py "
            "(class Model, get_inputs(), get_init_inputs())"))] = None,
        name: Annotated[str | None, Field(max_length=64, pattern=r"^[\w.-]+$",
                                          description="a name for a task given as source")] = None,
        backend: Annotated[Literal["cuda", "cpu"] | None, Field(
            description="cuda or cpu; default: the server's (cuda where a GPU is visible)")] = None,
    ) -> Annotated[CallToolResult, OpenedWorkspace]:
        """Create a workspace for a task and return its workspace_id. The task is checked first (it must
        define Model, get_inputs and get_init_inputs and run). Next: read_skill, read_file model.py."""
        if (task is None) == (source is None):
            raise ToolError("give exactly one of `task` (a task id) or `source` (the text of a model.py)")
        ws_id, init = await state.open_workspace(ctx, task=task, source=source, name=name, backend=backend)
        # the workspace is the client's root: every path it is shown or passes is relative to it
        init = init.model_copy(update={"workdir": "."})
        result = OpenedWorkspace(workspace_id=ws_id, **init.model_dump())
        text = present.init_text(init.model_copy(update={"workdir": ws_id}))
        return reply(result, f"workspace_id: {ws_id}\n{text}", out)

    @tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                                      openWorldHint=False))
    async def close_workspace(workspace_id: Annotated[str, Field(max_length=64, description=(
            "the workspace to delete with all its files"))]) -> Annotated[CallToolResult, ClosedWorkspace]:
        """Delete a workspace and its files. Idle workspaces are closed by the server after a while anyway."""
        entry = state.workspace(workspace_id)
        await state.close_workspace(entry)
        return reply(ClosedWorkspace(workspace_id=entry.id, closed=True), f"closed workspace {entry.id}", out)

    @tool(annotations=READ_ONLY)
    async def list_files(workspace_id: WorkspaceId = None) -> Annotated[CallToolResult, FileList]:
        """List the workspace's files (build/ and the judge's state are left out)."""
        entry = state.workspace(workspace_id)
        result = await anyio.to_thread.run_sync(
            lambda: files.list_files(entry.ws, entry.id, build_bytes=state.build_bytes(entry)))
        lines = [f"{f.path}  {f.bytes} B" + ("" if f.writable else "  (read-only)") for f in result.files]
        return reply(result, "\n".join(lines) or "(no files)", out)

    @tool(annotations=READ_ONLY)
    async def read_file(
        path: FilePath,
        workspace_id: WorkspaceId = None,
        offset: Annotated[int, Field(ge=0, description="first line (0-based) or character to return")] = 0,
        limit: Annotated[int | None, Field(ge=1, description="lines or characters to return (default: as many "
                                                             "as the output limit allows)")] = None,
        unit: Annotated[Literal["lines", "chars"], Field(description="what offset and limit count")] = "lines",
    ) -> Annotated[CallToolResult, FileChunk]:
        """Read a text file of the workspace, or a page of it. build/compile.log holds the last build's log."""
        entry = state.workspace(workspace_id)
        chunk = await anyio.to_thread.run_sync(lambda: files.read_file(
            entry.ws, path, offset=offset, limit=limit, unit=unit, max_chars=out - 200,
            max_read_bytes=cfg.max_read_bytes))
        return reply(chunk, files.chunk_text(chunk), out)

    @tool(annotations=OVERWRITES)
    async def write_file(
        path: FilePath,
        content: Annotated[str, Field(description="the whole new content of the file")],
        workspace_id: WorkspaceId = None,
    ) -> Annotated[CallToolResult, FileWritten]:
        """Create or overwrite a file: your kernels under kernels/ and model_new.py. model.py, binding.cpp,
        binding_registry.h and SKILL.md are protected; build/ and .cuda_agent/ belong to the sandbox."""
        entry = state.workspace(workspace_id)
        result = await state.write_files(entry, lambda: files.write_file(
            entry.ws, path, content, max_file_bytes=cfg.max_file_bytes, max_workspace_bytes=cfg.max_workspace_bytes,
            build_bytes=state.build_bytes(entry)))
        verb = "created" if result.created else "wrote"
        return reply(result, f"{verb} {result.path} ({result.bytes} bytes)", out)

    @tool(annotations=EDITS)
    async def edit_file(
        path: FilePath,
        old_text: Annotated[str, Field(description="text to replace; must occur exactly once in the file")],
        new_text: Annotated[str, Field(description="the replacement")],
        workspace_id: WorkspaceId = None,
    ) -> Annotated[CallToolResult, FileWritten]:
        """Replace one exact occurrence of old_text in a file (whitespace and indentation must match)."""
        entry = state.workspace(workspace_id)
        result = await state.write_files(entry, lambda: files.edit_file(
            entry.ws, path, old_text, new_text, max_file_bytes=cfg.max_file_bytes,
            max_workspace_bytes=cfg.max_workspace_bytes, build_bytes=state.build_bytes(entry)))
        return reply(result, f"edited {result.path} ({result.bytes} bytes)", out)

    @tool(name="compile", annotations=BUILDS)
    async def compile_(ctx: Context, workspace_id: WorkspaceId = None) -> Annotated[CallToolResult, CompileResult]:
        """Build kernels/ into the cuda_extension module (incremental). Returns compiler diagnostics with file
        and line on failure. Can take minutes; reports progress."""
        entry = state.workspace(workspace_id)
        # the caller's object cache: the default workspace's compiles run with its one client's
        result = await state.run_op(ctx, entry, "compile", state.compile_config(current_owner()), CompileResult)
        return reply(result, present.compile_text(result), out)

    @tool(annotations=JUDGES)
    async def verify(
        ctx: Context,
        workspace_id: WorkspaceId = None,
        trials: Annotated[int | None, Field(ge=1, le=cfg.max_verify_trials, description=(
            f"input sets, each from a fresh random seed (default {cfg.verify_trials})"))] = None,
    ) -> Annotated[CallToolResult, VerifyResult]:
        """Check ModelNew against the reference on fresh random inputs, in isolated processes. Fails on wrong
        values, shapes or dtypes, mutated inputs, crashes, timeouts, and PyTorch compute ops in forward."""
        entry = state.workspace(workspace_id)
        vcfg = VerifyConfig(trials=trials or cfg.verify_trials, atol=cfg.atol, rtol=cfg.rtol,
                            trial_timeout_s=cfg.trial_timeout_s)
        result = await state.run_op(ctx, entry, "verify", vcfg, VerifyResult)
        return reply(result, present.verify_text(result), out)

    @tool(annotations=JUDGES)
    async def profile(
        ctx: Context,
        workspace_id: WorkspaceId = None,
        compile_mode: Annotated[Literal["default", "max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs"],
                                Field(description="torch.compile mode of the baseline")] = "default",
    ) -> Annotated[CallToolResult, ProfileResult]:
        """Time ModelNew against PyTorch eager and torch.compile on a device of its own, with the top kernels.
        Run verify first: a speedup of an incorrect kernel counts for nothing."""
        entry = state.workspace(workspace_id)
        result = await state.run_op(ctx, entry, "profile", ProfileConfig(compile_mode=compile_mode), ProfileResult)
        return reply(result, present.profile_text(result), out)

    @tool(annotations=JUDGES)
    async def analyze(ctx: Context, workspace_id: WorkspaceId = None) -> Annotated[CallToolResult, AnalyzeResult]:
        """Why is my kernel slow? Runs ModelNew's forward once under Nsight Compute and returns, for the kernels that
        take most of the time, ranked bottleneck sentences first (memory-, compute- or latency-bound, uncoalesced
        loads, occupancy and its limiter, the top warp stall), then the numbers: DRAM bandwidth and its share of
        peak, the roofline, cache hit rates, registers, shared memory; PyTorch eager's kernels beside them. Call
        it after verify passes and before rewriting a kernel for speed. Advice, not a timing (ncu replays each
        kernel): profile gives the speedup. Cached per build; without a GPU or ncu, says why and gives the torch
        profiler's table."""
        entry = state.workspace(workspace_id)
        result = await state.run_op(ctx, entry, "analyze", AnalyzeConfig(), AnalyzeResult)
        return reply(result, analyze_text(result), out)

    @mcp.tool(annotations=READ_ONLY, structured_output=False)
    def read_skill() -> str:
        """The operating manual (SKILL.md): workspace layout, the ModelNew contract, how to write, bind and
        optimise kernels. Read it once before writing code."""
        return skill_text()
