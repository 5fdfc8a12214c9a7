"""Open workspaces by id: who owns each, limits on how many, and cleanup of idle ones."""

from __future__ import annotations

import re
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from mcp.server.mcpserver.exceptions import ToolError

from sandbox.workspace import Workspace

DEFAULT_ID = "default"
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(eq=False)
class OpenWorkspace:
    id: str
    ws: Workspace
    owner: str | None
    managed: bool = True  # made by the server under its root: deleted on close
    default: bool = False
    last_used: float = field(default_factory=time.monotonic)
    running: list[str] = field(default_factory=list)  # operations holding the workspace lock
    active: int = 0  # calls running or queued on this workspace
    _lock: anyio.Lock | None = None
    _write_lock: anyio.Lock | None = None

    @property
    def lock(self) -> anyio.Lock:
        # made lazily: anyio primitives belong to the event loop that first uses them
        if self._lock is None:
            self._lock = anyio.Lock()
        return self._lock

    @property
    def write_lock(self) -> anyio.Lock:
        """Held by every write_file/edit_file of the workspace: an edit's read-modify-write and the
        workspace-size check before a write both need the files to stay as they read them."""
        if self._write_lock is None:
            self._write_lock = anyio.Lock()
        return self._write_lock

    def touch(self) -> None:
        self.last_used = time.monotonic()


class WorkspaceRegistry:
    def __init__(self, root: Path, max_workspaces: int, per_client: int | None = None):
        self.root = root
        self.max_workspaces = max_workspaces
        self.per_client = per_client if per_client is not None else max_workspaces
        self._open: dict[str, OpenWorkspace] = {}
        self._pending: dict[str | None, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    @property
    def default(self) -> OpenWorkspace | None:
        return self._open.get(DEFAULT_ID)

    def new_dir(self) -> tuple[str, Path]:
        while True:
            ws_id = "ws-" + secrets.token_hex(6)
            path = self.root / ws_id
            if ws_id not in self._open and not path.exists():
                return ws_id, path

    def owned_by(self, owner: str | None) -> int:
        """The client's open workspaces and those it is creating (the server's default one is nobody's)."""
        return self._pending.get(owner, 0) + sum(1 for e in self._open.values() if e.owner == owner and not e.default)

    @contextmanager
    def reserve(self, owner: str | None = None) -> Iterator[None]:
        """Hold a place for a workspace being created, so concurrent opens cannot overshoot the limits."""
        # refused rather than queued: a slot frees only when a workspace is closed, maybe an hour from now
        mine = self.owned_by(owner)
        # a per-client limit equal to the server's is no share of it: the server's limit is what to name then
        if mine >= self.per_client and self.per_client < self.max_workspaces:
            raise ToolError(f"your client has {mine} open workspaces, its limit on this server: close one you no "
                            "longer need with close_workspace (workspace ids are in open_task's replies)")
        if len(self._open) + sum(self._pending.values()) >= self.max_workspaces:
            raise ToolError(f"the server's limit of {self.max_workspaces} open workspaces is reached: "
                            "close one you no longer need with close_workspace")
        self._pending[owner] = self._pending.get(owner, 0) + 1
        try:
            yield
        finally:
            self._pending[owner] -= 1
            if not self._pending[owner]:
                del self._pending[owner]

    def add(self, entry: OpenWorkspace) -> OpenWorkspace:
        self._open[entry.id] = entry
        return entry

    def get(self, workspace_id: str | None, owner: str | None) -> OpenWorkspace:
        if workspace_id is None or workspace_id == "":
            if self.default is None:
                raise ToolError("workspace_id is required: open a workspace with open_task and pass the "
                                "workspace_id it returns")
            workspace_id = DEFAULT_ID
        entry = self._open.get(workspace_id) if _ID.fullmatch(workspace_id) else None
        # a workspace of another client reads exactly like one that does not exist
        if entry is None or (entry.owner is not None and entry.owner != owner):
            raise ToolError(f"unknown workspace {workspace_id[:64]!r}: it does not exist, was closed (idle "
                            "workspaces are closed after a while) or belongs to another client; "
                            "open one with open_task")
        entry.touch()
        return entry

    def detach(self, entry: OpenWorkspace) -> None:
        """Forget a workspace (its files are the caller's to delete)."""
        if entry.active:
            busy = ", ".join(entry.running) or "a queued call"
            raise ToolError(f"workspace {entry.id} is busy ({busy}); wait for the call to finish or cancel it, "
                            "then close the workspace")
        if entry.default:
            raise ToolError("the default workspace belongs to the server and stays open")
        self._open.pop(entry.id, None)

    def busy(self) -> bool:
        """A call is running or queued somewhere, or a workspace is being created."""
        return bool(self._pending) or any(e.active for e in self._open.values())

    def idle(self, idle_timeout_s: float, now: float | None = None) -> list[OpenWorkspace]:
        now = time.monotonic() if now is None else now
        return [e for e in self._open.values()
                if not e.default and not e.active and now - e.last_used > idle_timeout_s]

    def close_all(self) -> None:
        for entry in list(self._open.values()):
            self._open.pop(entry.id, None)
            if entry.managed:
                shutil.rmtree(entry.ws.root, ignore_errors=True)
