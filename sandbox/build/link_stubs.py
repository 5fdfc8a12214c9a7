"""Empty stand-ins for torch's libraries, for the link of every extension.

An extension is a shared object: the linker leaves the symbols it imports undefined whether or not it reads
the libraries that define them, and the loader binds them when the extension is loaded into a process that
has torch's libraries already. What the link needs of each library is only its name for DT_NEEDED (its
SONAME). Reading the real ones costs most of a link: GNU ld spent 0.25 s of a 0.26 s link reading
libtorch_cpu's symbol table (400 MB of library) on 2 cores, and more on CUDA, where libtorch_cuda joins it;
against these stand-ins the same link takes 0.06 s (docs/benchmarks.md). Each stand-in is an empty shared
object carrying the real library's SONAME, made once per toolchain in the judge's cache; the extension's
RUNPATH still names the real folders, so the loader, the symbol scan (sandbox.scan.elf_exports) and the
pybind11 import check read the real libraries, as before.

Linked this way, an import that a torch library also defines binds to whichever library the loader finds
first, which is what it does for every import anyway; the linker no longer pins it to an unversioned copy
(torch's wheels carry a few libstdc++ functions of their own) but asks for the C++ runtime's versioned one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCHEME = "link-stubs-1"
ENV = "CUDA_AGENT_LINK_STUBS"  # "0" links against the real libraries
DONE = "stubs.done"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def library_file(name: str, dirs: list[str]) -> Path | None:
    """The file `-l<name>` finds in `dirs`, searched in order as the linker searches its -L folders."""
    for d in dirs:
        p = Path(d) / f"lib{name}.so"
        if p.is_file():
            return p
    return None


def soname(path: Path) -> str | None:
    """A shared object's DT_SONAME, or None (none, or not an ELF file this reads)."""
    from elftools.common.exceptions import ELFError

    from sandbox.scan.elf_read import read_uncached

    try:
        found = read_uncached(path, ()).tag_values("DT_SONAME")
    except (OSError, ELFError, ValueError):
        return None
    return found[0] if found else None


def write(folder: Path, cxx: str, libraries: list[str], dirs: list[str]) -> list[str]:
    """A stand-in in `folder` for each of `libraries` found in `dirs` with a SONAME: an empty shared object of
    that SONAME, built by `cxx`. Returns the libraries it made one for; the others are linked as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for name in libraries:
        real = library_file(name, dirs)
        so = soname(real) if real else None
        if not so or "/" in so:
            continue
        tmp = folder / f"lib{name}.so.tmp"
        r = subprocess.run([cxx, "-shared", "-nostdlib", f"-Wl,-soname,{so}", "-x", "c", os.devnull, "-o", str(tmp)],
                           capture_output=True, text=True, timeout=120, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"making the link's stand-in for lib{name}.so failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, folder / f"lib{name}.so")
        made.append(name)
    (folder / DONE).write_text("".join(f"{n}\n" for n in made))
    return made
