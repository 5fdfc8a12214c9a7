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
import struct
from collections.abc import Iterator
from pathlib import Path

_SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
_ELF64_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
_MAX_DIRS = 64


def _search_path(elf_path: Path) -> list[Path]:
    """The object's DT_RUNPATH and DT_RPATH folders, $ORIGIN expanded."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    out: list[Path] = []
    try:
        with open(elf_path, "rb") as fh:
            for sec in ELFFile(fh).iter_sections():
                if not isinstance(sec, DynamicSection):
                    continue
                for tag in sec.iter_tags():
                    if tag.entry.d_tag in ("DT_RUNPATH", "DT_RPATH"):
                        value = tag.runpath if tag.entry.d_tag == "DT_RUNPATH" else tag.rpath
                        for part in value.split(":"):
                            part = part.replace("$ORIGIN", str(elf_path.parent)).replace("${ORIGIN}", str(elf_path.parent))
                            if part:
                                out.append(Path(part))
    except (OSError, ELFError, ValueError):
        return []
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


_STT_FUNC = 2


def symbol_entries(path: Path, tables: tuple[str, ...] = (".dynsym", ".symtab")) -> Iterator[tuple[str, bool, bool]]:
    """(name, undefined, a function) for each named entry of an ELF file's symbol `tables`. A 64-bit little-endian
    table is read with struct: pyelftools' own reader took about a second for a CUDA extension's 22k entries on the
    H100 host, where every build read it twice (the symbol scan, the pybind11 import check), and about 2 s for
    libtorch_cpu's 74k exports."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        for sec_name in tables:
            sec = elf.get_section_by_name(sec_name)
            if sec is None:
                continue
            if elf.elfclass != 64 or not elf.little_endian or sec["sh_entsize"] != _ELF64_SYM.size:
                for sym in sec.iter_symbols():  # any other ELF: slower, read the same
                    if sym.name:
                        yield sym.name, sym["st_shndx"] == "SHN_UNDEF", sym["st_info"]["type"] == "STT_FUNC"
                continue
            table, data = elf.get_section(sec["sh_link"]).data(), sec.data()
            for name_at, info, _other, shndx, _value, _size in _ELF64_SYM.iter_unpack(
                    data[:len(data) - len(data) % _ELF64_SYM.size]):
                if name_at:
                    end = table.find(b"\0", name_at)
                    name = table[name_at:end if end >= 0 else len(table)].decode("utf-8", errors="replace")
                    yield name, shndx == 0, info & 0xF == _STT_FUNC


@functools.lru_cache(maxsize=512)
def _exports(path: str, mtime_ns: int, size: int) -> frozenset[str]:
    """Names an ELF shared object defines in its dynamic symbol table (the cache key says which version)."""
    from elftools.common.exceptions import ELFError

    try:
        return frozenset(name for name, undefined, _ in symbol_entries(Path(path), (".dynsym",)) if not undefined)
    except (OSError, ELFError, ValueError):
        return frozenset()


def needed_libraries(extension: Path) -> list[Path]:
    """The shared objects the extension names itself (DT_NEEDED), found in its own RUNPATH folders: the few it
    links (torch's, on CUDA the runtime's), not the transitive set defined_by_libraries reads."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    names: list[str] = []
    try:
        with open(extension, "rb") as fh:
            for sec in ELFFile(fh).iter_sections():
                if isinstance(sec, DynamicSection):
                    names += [t.needed for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
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
