"""File tools over a Workspace: paged reads, size-limited writes, exact-match edits.

Path confinement and protection are the Workspace's; this adds the server's size limits and turns
every refusal into a ToolError the model can act on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from mcp.server.mcpserver.exceptions import ToolError

from mcp_server.models import FileChunk, FileEntry, FileList, FileWritten
from sandbox.build.ninja_file import object_name
from sandbox.workspace import Workspace, WorkspaceError

# a source's object gets a name of its folders joined (sandbox/build/ninja_file.object_name), and files beside it
# named after it: its depfile ($out.d) and a thin compile's output ($out.thin). Each name must fit in one
# directory entry, 255 bytes on Linux's file systems: a .thin name that does not makes the thin compile fail and the
# build fall back to the slow full one, a depfile's makes ninja fail with a bare "File name too long"
SOURCE_SUFFIXES = (".cu", ".cpp", ".cc")
LONGEST_BESIDE = ".thin"
NAME_MAX = 255
MAX_SOURCE_PATH = NAME_MAX - len(LONGEST_BESIDE) - len(object_name("kernels/")) + len("kernels/")


def build_name_problem(rel: str) -> str | None:
    """Why the build could never make the files of source `rel`, a name the file-name rule allows; or None."""
    if not rel.startswith("kernels/") or not rel.endswith(SOURCE_SUFFIXES):
        return None
    longest = object_name(rel) + LONGEST_BESIDE
    if len(longest.encode()) <= NAME_MAX:
        return None
    return (f"{rel!r} cannot be built: the build names its object after its path ({len(longest)} characters with "
            f"its {LONGEST_BESIDE} file, over the {NAME_MAX} a file name may have), so a source's path may be at "
            f"most {MAX_SOURCE_PATH} characters; use shorter folder or file names")


@contextmanager
def refusals() -> Iterator[None]:
    try:
        yield
    except WorkspaceError as e:
        msg = str(e)
        if "protected" in msg or "belongs to the sandbox" in msg:
            msg += "; write ModelNew in model_new.py and your sources under kernels/"
        raise ToolError(msg) from None
    except OSError as e:
        raise ToolError(f"{e.filename or 'file'}: {e.strerror}") from None


def _writable(ws: Workspace, rel: str) -> bool:
    try:
        ws.resolve(rel, for_write=True)
        return True
    except WorkspaceError:
        return False


def list_files(ws: Workspace, workspace_id: str, build_bytes: int = 0) -> FileList:
    entries = []
    with refusals():
        for rel in ws.list_files():
            size = (ws.root / rel).stat().st_size
            entries.append(FileEntry(path=rel, bytes=size, writable=_writable(ws, rel)))
    return FileList(workspace_id=workspace_id, files=entries, total_bytes=sum(e.bytes for e in entries),
                    build_bytes=build_bytes)


def _total_bytes(ws: Workspace) -> int:
    total = 0
    for rel in ws.list_files():
        try:
            total += (ws.root / rel).stat().st_size
        except OSError:
            pass
    return total


def read_file(ws: Workspace, path: str, *, offset: int, limit: int | None, unit: Literal["lines", "chars"],
              max_chars: int, max_read_bytes: int) -> FileChunk:
    with refusals():
        full = ws.resolve(path)
        if full.is_dir():
            raise ToolError(f"{path} is a directory; list_files shows what is inside")
        if full.is_file() and full.stat().st_size > max_read_bytes:
            raise ToolError(f"{path} is {full.stat().st_size} bytes, over the server's {max_read_bytes}-byte "
                            "read limit")
        text = ws.read_text(path)
        rel = ws.rel(full)
    if unit == "chars":
        total = len(text)
        if offset > total:
            raise ToolError(f"offset {offset} is past the end of {rel} ({total} characters)")
        n = min(limit if limit is not None else max_chars, max_chars)
        content = text[offset: offset + n]
        end = offset + len(content)
    else:
        lines = text.splitlines(keepends=True)
        total = len(lines)
        if offset > total:
            raise ToolError(f"offset {offset} is past the end of {rel} ({total} lines)")
        want = lines[offset: offset + limit] if limit is not None else lines[offset:]
        taken: list[str] = []
        size = 0
        for line in want:
            if size + len(line) > max_chars:
                if not taken:  # a single line longer than the cap: return its start
                    taken.append(line[:max_chars])
                break
            taken.append(line)
            size += len(line)
        content = "".join(taken)
        end = offset + len(taken)
    return FileChunk(path=rel, unit=unit, offset=offset, returned=end - offset, total=total,
                     next_offset=end if end < total else None, content=content)


def chunk_text(c: FileChunk) -> str:
    if c.offset == 0 and c.next_offset is None:
        return c.content
    what = "lines" if c.unit == "lines" else "characters"
    if c.returned == 0:
        return f"[{c.path}: nothing at offset {c.offset}; the file has {c.total} {what}]"
    more = f"; continue with offset={c.next_offset}" if c.next_offset is not None else ""
    return (f"{c.content}\n[{c.path}: {what} {c.offset} to {c.offset + c.returned - 1} (0-based) of "
            f"{c.total}{more}]")


def write_file(ws: Workspace, path: str, content: str, *, max_file_bytes: int,
               max_workspace_bytes: int, build_bytes: int = 0) -> FileWritten:
    """`build_bytes`: the build's output and kept objects (mcp_server.usage), under the same limit."""
    data_len = len(content.encode())
    with refusals():
        full = ws.resolve(path, for_write=True)
        problem = build_name_problem(ws.rel(full))
        if problem:
            raise ToolError(problem)
        if full.is_dir():
            raise ToolError(f"{path} is a directory")
        existed = full.is_file()
        if data_len > max_file_bytes:
            raise ToolError(f"{path}: {data_len} bytes is over the server's {max_file_bytes}-byte file limit; "
                            "split the code into several files")
        old = full.stat().st_size if existed else 0
        total = _total_bytes(ws) - old + data_len + build_bytes
        if total > max_workspace_bytes:
            built = f" ({build_bytes} of them the build's output)" if build_bytes else ""
            raise ToolError(f"writing {path} would bring the workspace to {total} bytes{built}, over its "
                            f"{max_workspace_bytes}-byte limit; delete or shrink files you do not need")
        ws.write_text(path, content, max_bytes=max_file_bytes)
        rel = ws.rel(full)
    return FileWritten(path=rel, bytes=data_len, created=not existed)


def edit_file(ws: Workspace, path: str, old_text: str, new_text: str, *, max_file_bytes: int,
              max_workspace_bytes: int, build_bytes: int = 0) -> FileWritten:
    if old_text == "":
        raise ToolError("old_text is empty; to create or overwrite a whole file use write_file")
    with refusals():
        ws.resolve(path, for_write=True)  # refuse protected files before reading them
        text = ws.read_text(path)
    count = text.count(old_text)
    if count == 0:
        hint = " (it matches if trailing whitespace is ignored)" if old_text.strip() and old_text.strip() in text else ""
        raise ToolError(f"old_text was not found in {path}{hint}; read the file again and copy the text exactly, "
                        "including indentation and line breaks")
    if count > 1:
        raise ToolError(f"old_text occurs {count} times in {path}; include more of the surrounding lines so that "
                        "it matches exactly once")
    written = write_file(ws, path, text.replace(old_text, new_text, 1), max_file_bytes=max_file_bytes,
                         max_workspace_bytes=max_workspace_bytes, build_bytes=build_bytes)
    return written.model_copy(update={"replacements": 1})
