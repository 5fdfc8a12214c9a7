"""What a workspace holds on the server's disk, counted against its quota, and removed with it (MCP server III,
item 3).

A workspace's quota (`--max-workspace-bytes`, 64 MiB) counts everything a client makes with it: the files it
wrote, the build's output (objects, the extension, logs) and the object-cache entries its compiles kept in its
client's cache (sandbox/build/objcache.py lists each in the build folder's `.objcache-kept`). Only the judge's
own state (`.cuda_agent/`: the reference's copy, bounded by the task source's limit) is left out. Those kept
entries are removed when the workspace is closed, and with the whole cache when the server ends.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sandbox.build.objcache import KEPT_LIST
from sandbox.workspace import BUILD_DIR, STATE_DIR


@dataclass(frozen=True)
class Usage:
    files: int  # the agent's files
    build: int  # build/ and the object-cache entries its compiles kept

    @property
    def total(self) -> int:
        return self.files + self.build


def _tree_bytes(root: Path, skip: tuple[str, ...] = ()) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == str(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # gone meanwhile
                pass
    return total


def kept_entries(ws_root: Path, cache_root: Path | None) -> list[Path]:
    """The object-cache files the workspace's compiles kept that still exist, inside `cache_root` only: the list
    is in the build folder, and nothing outside the cache is counted or removed by what it says."""
    if cache_root is None:
        return []
    try:
        lines = (ws_root / BUILD_DIR / KEPT_LIST).read_text().splitlines()
    except OSError:
        return []
    root = cache_root.resolve()
    out = []
    for line in dict.fromkeys(lines):
        path = Path(line)
        if path.is_absolute() and root in path.parents and ".." not in path.parts and path.is_file():
            out.append(path)
    return out


def usage(ws_root: Path, cache_root: Path | None) -> Usage:
    files = _tree_bytes(ws_root, skip=(BUILD_DIR, STATE_DIR))
    build = _tree_bytes(ws_root / BUILD_DIR)
    build += sum(p.stat().st_size for p in kept_entries(ws_root, cache_root) if p.exists())
    return Usage(files=files, build=build)


def drop_kept(ws_root: Path, cache_root: Path | None) -> None:
    """Remove the cache entries the workspace's compiles kept (another workspace of the client that reused one
    compiles that source again)."""
    for path in kept_entries(ws_root, cache_root):
        path.unlink(missing_ok=True)
    (ws_root / BUILD_DIR / KEPT_LIST).unlink(missing_ok=True)


def drop_build(ws_root: Path, cache_root: Path | None) -> None:
    """Remove the build's output and the cache entries it kept: the next compile starts from nothing."""
    drop_kept(ws_root, cache_root)
    build = ws_root / BUILD_DIR
    if build.is_dir() and not build.is_symlink():
        for child in build.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
