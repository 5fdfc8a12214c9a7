"""Structured diagnostics from g++, nvcc, ptxas and the linker."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sandbox.results import Diagnostic

_GCC = re.compile(r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:(?P<col>\d+):)? (?P<sev>fatal error|error|warning|note): (?P<msg>.*)$")
_NVCC = re.compile(r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?P<sev>error|warning|remark|catastrophic error)(?: #[\w-]+)?: (?P<msg>.*)$")
_PTXAS = re.compile(r"^ptxas (?P<sev>error|fatal|warning)\s*: (?P<msg>.*)$")
# GNU ld's and gold's words, then lld's
_LINK = re.compile(r"^(?:.*: )?(?P<msg>undefined reference to .*|multiple definition of .*"
                   r"|undefined (?:hidden )?symbol: .*|duplicate symbol: .*)$")
_SEVERITY_ORDER = {"fatal error": 0, "error": 0, "warning": 1, "note": 2}


def _norm_file(raw: str, build_dir: Path, root: Path) -> str:
    p = Path(raw)
    full = (p if p.is_absolute() else build_dir / p)
    full = Path(os.path.normpath(full))
    try:
        return full.relative_to(root).as_posix()
    except ValueError:
        return str(full)


def parse_diagnostics(log: str, build_dir: Path, root: Path) -> list[Diagnostic]:
    """Errors first, then warnings and notes; only diagnostics located in the workspace keep notes."""
    seen: set[tuple] = set()
    out: list[Diagnostic] = []
    for line in log.splitlines():
        line = line.rstrip()
        d = None
        m = _GCC.match(line) or _NVCC.match(line)
        if m:
            sev = m.group("sev")
            sev = "error" if sev == "catastrophic error" else ("note" if sev == "remark" else sev)
            col = m.groupdict().get("col")
            d = Diagnostic(file=_norm_file(m.group("file"), build_dir, root), line=int(m.group("line")),
                           column=int(col) if col else None, severity=sev, message=m.group("msg").strip())
        elif m := _PTXAS.match(line):
            sev = "warning" if m.group("sev") == "warning" else "error"
            d = Diagnostic(severity=sev, message="ptxas: " + m.group("msg").strip())
        elif m := _LINK.match(line):
            d = Diagnostic(severity="error", message=m.group("msg").strip())
        if d is None:
            continue
        in_ws = d.file is None or not os.path.isabs(d.file)
        if d.severity in ("note", "warning") and not in_ws:
            continue  # header noise from torch/CUDA
        key = (d.file, d.line, d.severity, d.message)
        if key not in seen:
            seen.add(key)
            out.append(d)
    out.sort(key=lambda d: _SEVERITY_ORDER.get(d.severity, 3))
    return out
