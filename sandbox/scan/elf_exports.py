"""Which libraries could define the symbols a built extension leaves undefined.

The symbol scan refuses an import that is on no list only if something the extension loads defines it: a
name nothing defines is the agent's own missing function (a declaration whose definition was forgotten or
mangled differently), which fails at import with the loader's own message, as it always did. "Something the
extension loads" is over-approximated on purpose: every shared object in the extension's RUNPATH folders
(torch's lib/, the CUDA toolkit's lib64/) and in the RUNPATH folders of those objects, transitively, so the
libraries torch loads globally (cuBLAS, cuDNN, NCCL from site-packages/nvidia/*/lib) count too. System
folders are left out: the C and C++ runtime there is the allow-list's own business (symbol_allowlist), and
nothing links other system libraries into an extension's process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

from sandbox.scan.elf_read import elf_info, read_uncached

_SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
_MAX_DIRS = 64


def _search_path(elf_path: Path) -> list[Path]:
    """The object's DT_RUNPATH and DT_RPATH folders, $ORIGIN expanded."""
    from elftools.common.exceptions import ELFError

    try:  # its dynamic tags alone: a library's 400 MB are not read for them
        dynamic = read_uncached(elf_path, ()).dynamic
    except (OSError, ELFError, ValueError):
        return []
    out: list[Path] = []
    for tag, value in dynamic:
        if tag in ("DT_RUNPATH", "DT_RPATH"):
            for part in value.split(":"):
                part = part.replace("$ORIGIN", str(elf_path.parent)).replace("${ORIGIN}", str(elf_path.parent))
                if part:
                    out.append(Path(part))
    return out


def _system(folder: Path) -> bool:
    return any(str(folder) == d or str(folder).startswith(d + "/") for d in _SYSTEM_DIRS)


def _shared_objects(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if ".so" in p.name and p.is_file())
    except OSError:
        return []


def library_folders(extension: Path) -> list[Path]:
    """The extension's RUNPATH folders and, transitively, those of every shared object in them."""
    queue = [d.resolve() for d in _search_path(extension)]
    found: list[Path] = []
    while queue and len(found) < _MAX_DIRS:
        folder = queue.pop(0)
        if folder in found or _system(folder) or not folder.is_dir():
            continue
        found.append(folder)
        for lib in _shared_objects(folder):
            queue += [d.resolve() for d in _search_path(lib)]
    return found


def symbol_entries(path: Path, tables: tuple[str, ...] = (".dynsym", ".symtab")) -> Iterator[tuple[str, bool, bool]]:
    """(name, undefined, a function) for each named entry of an ELF file's symbol `tables`, read once per content
    of the file (sandbox/scan/elf_read.py)."""
    info = elf_info(path)
    for name in tables:
        yield from info.tables.get(name, ())


@functools.lru_cache(maxsize=512)
def _exports(path: str, mtime_ns: int, size: int) -> frozenset[str]:
    """Names an ELF shared object defines in its dynamic symbol table (the cache key says which version)."""
    from elftools.common.exceptions import ELFError

    try:  # read past elf_info's cache: a library's names are kept here, as a set, and need not be kept twice
        info = read_uncached(path, (".dynsym",))
    except (OSError, ELFError, ValueError):
        return frozenset()
    return frozenset(name for name, undefined, _ in info.tables.get(".dynsym", ()) if not undefined)


def needed_libraries(extension: Path) -> list[Path]:
    """The shared objects the extension names itself (DT_NEEDED), found in its own RUNPATH folders: the few it
    links (torch's, on CUDA the runtime's), not the transitive set defined_by_libraries reads."""
    from elftools.common.exceptions import ELFError

    try:
        names = read_uncached(extension, ()).tag_values("DT_NEEDED")
    except (OSError, ELFError, ValueError):
        return []
    folders = [d for d in _search_path(extension) if d.is_dir()]
    return [next(d / n for d in folders if (d / n).is_file()) for n in names
            if any((d / n).is_file() for d in folders)]


def exports(path: Path) -> frozenset[str]:
    try:
        st = path.stat()
    except OSError:
        return frozenset()
    return _exports(str(path), st.st_mtime_ns, st.st_size)


def defined_by_libraries(extension: Path, symbols: set[str]) -> set[str]:
    """Those of `symbols` that some shared object in the extension's library folders defines."""
    left, found = set(symbols), set()
    for folder in library_folders(extension):
        for lib in _shared_objects(folder):
            if not left:
                return found
            hit = left & exports(lib)
            found |= hit
            left -= hit
    return found
