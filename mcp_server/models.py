"""Structured results of the tools that have no sandbox result model (files, tasks, workspaces).

compile/verify/profile return the sandbox's own models (sandbox.results); these cover the rest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sandbox.results import InitResult


class TaskEntry(BaseModel):
    id: str = Field(description="pass this to open_task")
    name: str


class TaskList(BaseModel):
    total: int = Field(description="tasks matching the filter")
    offset: int
    tasks: list[TaskEntry]
    next_offset: int | None = Field(None, description="offset of the next page, if there is one")


class OpenedWorkspace(InitResult):
    workspace_id: str = Field(description="pass this to every workspace tool")


class ClosedWorkspace(BaseModel):
    workspace_id: str
    closed: bool


class FileEntry(BaseModel):
    path: str
    bytes: int
    writable: bool = Field(description="false for protected infrastructure and the reference")


class FileList(BaseModel):
    workspace_id: str
    files: list[FileEntry]
    total_bytes: int = Field(description="size of the agent's files, counted against the workspace limit")
    build_bytes: int = Field(0, description="the build's output and the object-cache entries it kept, counted "
                             "against the same limit")


class FileChunk(BaseModel):
    path: str
    unit: Literal["lines", "chars"]
    offset: int = Field(description="first line (0-based) or character returned")
    returned: int = Field(description="lines or characters returned")
    total: int = Field(description="lines or characters in the whole file")
    next_offset: int | None = Field(None, description="where to continue reading, if the file goes on")
    content: str


class FileWritten(BaseModel):
    path: str
    bytes: int
    created: bool = Field(description="the file did not exist before")
    replacements: int = Field(0, description="edit_file: how many times old_text was replaced (always 1)")
