"""pybind11's out-of-line code compiled once per toolchain instead of in every binding (GCC only).

A binding that only includes binding_registry.h already takes seconds with the header precompiled: pybind11
3 declares `error_already_set::what()` in the class and defines it `inline` later, which makes it the class's
key function, so every translation unit emits the vtable and, through what it reaches, most of pybind11's
inline member functions (209 weak functions in an empty TU; docs/history.md, "The binding's cost").
GCC's `#pragma interface`, in force for a header, tells every TU that includes it not to emit that
header's inline member functions and vtables, and `#pragma implementation` in one TU emits them all. So:

- the precompiled header of the judge's cache (infra_cache.infra_header) starts with `#line 1 "<header>"` plus
  `#pragma interface` for each pybind11 header it includes, spelled as GCC opened it (g++ -H): a binding
  compiled against it leaves those functions to the shared infrastructure object;
- that object (infra_cache.infra_object, binding.cpp) is compiled with `#pragma implementation` for the same
  headers, so it holds them, and every extension links it.

Measured on a 2-core CPU at -O1: an empty TU 9.2 to 4.2 s, the example's binding 8.9 to 6.7 s.

Templates are instantiated where they are used as before, so a binding only links against the infrastructure
object for non-template members. Should one need a member that object does not hold (pybind11 symbols are
hidden, so the link itself fails, naming it), the build compiles the workspace's bindings again against the
plain precompiled header (compile_workspace): slower, never wrong. A header spelled otherwise than the pragma
names it, or another compiler (clang ignores the pragmas), only leaves a binding as slow as before.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# bump to rebuild every toolchain's infrastructure object and header when the scheme changes
SCHEME = "pybind-interface-1"
HEADERS_FILE = "pybind_headers.txt"
# a link that needed a pybind11 member the infrastructure object does not hold, in GNU ld's and gold's words
# ("undefined reference to", "hidden symbol ... isn't defined") and lld's ("undefined [hidden] symbol:")
_LINK_MISSED = re.compile(r"(hidden symbol .{0,40}pybind11.{0,400}isn't defined|undefined reference to .{0,40}pybind11"
                          r"|undefined (?:hidden )?symbol: .{0,40}pybind11)")


def is_gcc(cxx: str, timeout_s: float = 30.0) -> bool:
    """Whether `cxx` is GCC (clang also answers to g++ names, and ignores these pragmas)."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def pybind_headers(cxx: str, flags: list[str], header: Path, timeout_s: float) -> list[str]:
    """The pybind11 headers `header` includes, each as GCC spelled it when it opened it (the name its line maps
    carry, which is what `#pragma interface` is matched on), in the order first opened. Empty if g++ fails."""
    try:
        r = subprocess.run([cxx, *flags, "-x", "c++-header", "-fsyntax-only", "-H", str(header)],
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    seen: dict[str, None] = {}
    for line in r.stderr.splitlines():
        m = re.match(r"^\.+ (.+\.h(?:pp)?)$", line)
        if m and "/pybind11/" in m.group(1):
            seen.setdefault(m.group(1))
    return list(seen)


def _quoted(path: str) -> str:
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def interface_header(text: str, headers: list[str], own_path: Path) -> str:
    """binding_registry.h's text with every one of `headers` marked interface-only before anything includes
    them. The pragmas go right after `#pragma once`, and the line map is set back to the file itself after them,
    so that diagnostics still name binding_registry.h at the right lines."""
    lines = text.splitlines(keepends=True)
    at = next((i + 1 for i, ln in enumerate(lines) if ln.strip() == "#pragma once"), 0)
    marks = "".join(f"#line 1 {_quoted(h)}\n#pragma interface\n" for h in headers)
    back = f"#line {at + 1} {_quoted(str(own_path))}\n"
    return "".join(lines[:at]) + marks + back + "".join(lines[at:])


def implementation_source(text: str, headers: list[str]) -> str:
    """binding.cpp's text preceded by `#pragma implementation` for each header (GCC matches it on the base
    name), so the infrastructure object holds what interface-only bindings leave out."""
    names = dict.fromkeys(Path(h).name for h in headers)
    marks = "".join(f"#pragma implementation {_quoted(n)}\n" for n in names)
    return marks + f"#line 1 {_quoted('binding.cpp')}\n" + text if marks else text


def write_infra_sources(folder: Path, headers: list[str], header_text: str, cpp_text: str) -> None:
    """binding_registry.h and binding.cpp in `folder` as the infrastructure object is compiled from them: the
    header with `headers` marked interface (implementation emits only what interface withholds, so that TU needs
    the marks too), the source asking for their members."""
    header = folder / "binding_registry.h"
    header.write_text(interface_header(header_text, headers, header))
    (folder / "binding.cpp").write_text(implementation_source(cpp_text, headers))


def link_missed_a_member(log: str) -> bool:
    """Whether a failed link's log says a pybind11 member was left to the infrastructure object, which does not
    hold it: compile the bindings again against the plain header."""
    return bool(_LINK_MISSED.search(log))


def unresolved_pybind_imports(extension: Path) -> set[str]:
    """pybind11 symbols the linked extension imports that none of the libraries it links defines (torch_python
    exports the tensor casters): one with default visibility left undefined would link, and fail at import.
    Only the extension's own DT_NEEDED libraries are read, torch_python's first, so that a build pays a few
    hundredths of a second for it, not the seconds of reading every library torch loads on CUDA; a symbol
    defined only further away reads as unresolved, which costs a rebuild against the plain header, never a
    wrong verdict."""
    from sandbox.scan.elf_exports import exports, needed_libraries
    from sandbox.scan.symbol_scan import imported_symbols

    left = {s for s in imported_symbols(extension) if "pybind11" in s}
    for lib in sorted(needed_libraries(extension), key=lambda p: "python" not in p.name):
        if not left:
            break
        left -= exports(lib)
    return left
