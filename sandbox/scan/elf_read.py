"""An ELF file's symbol tables and dynamic tags, read once per version of the file.

A CUDA judgment read its extension's 22k symbols three times in the judge's process: the symbol scan, the
pybind11 import check, and the list of the extension's own kernels. pyelftools also parsed every section header,
and the GNU hash table with them, each time the file was opened. On the H200 host that came to about a third
of a wrong judgment's judge-side CPU (3daac8d:bench/judge_side.py), and in the judging process every thread shares one
interpreter lock. Here a 64-bit little-endian file (what gcc and nvcc build on x86-64 and aarch64) is read with
struct. Any other ELF goes through pyelftools, and reads the same.

An extension's tables are kept by the file's content (elf_info: its SHA-256, about a millisecond for a 2 MB
extension), not by its name or times: an extension swapped after its scan, whatever times it was given, is read
again. A library is read through a memory map and not kept (read_uncached), touching only the sections asked for:
its RUNPATH for the scan's library folders, its exports once for elf_exports' own cache of them.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, addralign, entsize
_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
_DYN = struct.Struct("<qQ")  # d_tag, d_val
_STT_FUNC = 2
DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 14, 15, 29
_DYN_TAGS = {DT_NEEDED: "DT_NEEDED", DT_SONAME: "DT_SONAME", DT_RPATH: "DT_RPATH", DT_RUNPATH: "DT_RUNPATH"}

Symbols = tuple[tuple[str, bool, bool], ...]  # (name, undefined, a function), named entries only


class ElfInfo:
    """One version of one ELF file: its symbol tables by name and its dynamic string tags, in file order."""

    def __init__(self, tables: dict[str, Symbols], dynamic: tuple[tuple[str, str], ...]):
        self.tables = tables
        self.dynamic = dynamic

    def tag_values(self, tag: str) -> list[str]:
        return [v for t, v in self.dynamic if t == tag]


def _cstr(buf, base: int, size: int, at: int) -> str:
    """The NUL-ended string at `at` of the string table at `base` (`size` bytes) of `buf` (bytes or a memory map)."""
    start, stop = base + at, base + size
    end = buf.find(b"\0", start, stop)
    return bytes(buf[start:end if end >= 0 else stop]).decode("utf-8", errors="replace")


def _read_fast(m, wanted: tuple[str, ...] = (".dynsym", ".symtab")) -> ElfInfo | None:
    """The file (bytes or a memory map) read with struct, or None where it is not a 64-bit little-endian ELF file
    this reads. Only the sections it needs are touched: a library's 400 MB stay on disk."""
    if len(m) < _EHDR.size or m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
        return None
    e = _EHDR.unpack_from(m, 0)
    shoff, shentsize, shnum, shstrndx = e[6], e[11], e[12], e[13]
    if shoff == 0 or shentsize != _SHDR.size or shoff + shnum * shentsize > len(m) or shstrndx >= max(shnum, 1):
        return None
    shdrs = [_SHDR.unpack_from(m, shoff + i * shentsize) for i in range(shnum)]
    strtab = shdrs[shstrndx]
    names = [_cstr(m, strtab[4], strtab[5], h[0]) for h in shdrs]

    def strings(h) -> tuple[int, int]:
        if h[6] >= shnum or shdrs[h[6]][4] + shdrs[h[6]][5] > len(m):
            raise ValueError("a string table outside the file")
        return shdrs[h[6]][4], shdrs[h[6]][5]

    def entries(h, st: struct.Struct):
        if h[1] == 8 or h[4] + h[5] > len(m):  # SHT_NOBITS, or outside the file
            return iter(())
        return st.iter_unpack(memoryview(m)[h[4]:h[4] + h[5] - h[5] % st.size])

    tables: dict[str, Symbols] = {}
    dynamic: list[tuple[str, str]] = []
    for name, h in zip(names, shdrs, strict=True):
        if name in wanted:
            if h[9] != _SYM.size:
                return None
            base, size = strings(h)
            tables[name] = tuple((_cstr(m, base, size, name_at), shndx == 0, info & 0xF == _STT_FUNC)
                                 for name_at, info, _other, shndx, _value, _size in entries(h, _SYM) if name_at)
        elif h[1] == 6:  # SHT_DYNAMIC
            base, size = strings(h)
            for tag, val in entries(h, _DYN):
                if tag == 0:
                    break
                if tag in _DYN_TAGS:
                    dynamic.append((_DYN_TAGS[tag], _cstr(m, base, size, val)))
    return ElfInfo(tables, tuple(dynamic))


def _read_slow(stream, wanted: tuple[str, ...] = (".dynsym", ".symtab")) -> ElfInfo:
    """Any ELF file pyelftools reads (32-bit, big-endian), from an open binary stream."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    tables: dict[str, Symbols] = {}
    dynamic: list[tuple[str, str]] = []
    elf = ELFFile(stream)
    for name in wanted:
        sec = elf.get_section_by_name(name)
        if sec is not None:
            tables[name] = tuple((s.name, s["st_shndx"] == "SHN_UNDEF", s["st_info"]["type"] == "STT_FUNC")
                                 for s in sec.iter_symbols() if s.name)
    for sec in elf.iter_sections():
        if isinstance(sec, DynamicSection):
            for t in sec.iter_tags():
                tag = t.entry.d_tag
                attr = {"DT_NEEDED": "needed", "DT_SONAME": "soname", "DT_RPATH": "rpath", "DT_RUNPATH": "runpath"}
                if tag in attr:
                    dynamic.append((tag, getattr(t, attr[tag])))
    return ElfInfo(tables, tuple(dynamic))


def _parse(m, stream, wanted: tuple[str, ...] = (".dynsym", ".symtab")) -> ElfInfo:
    """`m`: the file's bytes or memory map; `stream`: the same, as a binary stream for pyelftools."""
    if m[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    try:
        fast = _read_fast(m, wanted)
    except (struct.error, IndexError, ValueError):
        fast = None
    return fast if fast is not None else _read_slow(stream, wanted)


_CACHE: OrderedDict[bytes, ElfInfo] = OrderedDict()
_CACHE_SIZE = 64
_LOCK = threading.Lock()


def elf_info(path: Path | str) -> ElfInfo:
    """The file's tables, read once per content (module docstring). OSError where it cannot be read; ValueError or
    pyelftools' ELFError where it is not an ELF file."""
    data = Path(path).read_bytes()
    key = hashlib.sha256(data).digest()
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    info = _parse(data, io.BytesIO(data))
    with _LOCK:
        _CACHE[key] = info
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return info


def read_uncached(path: Path | str, tables: tuple[str, ...] = (".dynsym", ".symtab")) -> ElfInfo:
    """The file's `tables` (none: its dynamic tags alone), read now through a memory map and not kept: a library,
    read for its RUNPATH or once for a set of its names, of which only those sections are touched."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise ValueError("not an ELF file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse(m, fh, tables)
