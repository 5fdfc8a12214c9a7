"""Reading ncu's CSV (`ncu --csv --page raw`): one row per profiled kernel, one column per raw metric, a row of
units under the header. Every value is brought to base SI units here (seconds, bytes, per second), whatever prefix
ncu printed, so the arithmetic after it never sees a unit.

Lines that are not the table (ncu's ==PROF==, ==WARNING== and ==ERROR== lines, the target's own output where it
shares the file) are skipped; the errors among them are what `failure` reads.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field

NAME_COLUMNS = ("Kernel Name", "Function Name", "Demangled Name", "Name")
# prefixes ncu writes before a unit: SI (case matters: "m" milli, "M" mega), the micro sign in both its code points,
# and binary ones for bytes
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "m": 1e-3, "u": 1e-6, "\u00b5": 1e-6,
           "\u03bc": 1e-6, "n": 1e-9, "p": 1e-12, "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
# the base units, in every spelling ncu has written: the long names ("nsecond", "Gbyte/second", "cycle/nsecond"),
# read in any case, and the short ones ncu 2025.3 writes with --print-units base ("ns", "byte/s", "GB/s"), read as
# written; a unit part is a prefix and one of these whole, so "SM", "pass" or "cluster" are not a prefixed "s"
_LONG_BASES = {"second", "seconds", "sec", "byte", "bytes", "hz", "cycle", "cycles", "inst", "warp", "sector",
               "request", "thread", "block", "flop", "wavefront", "transaction"}
_SHORT_BASES = {"s", "B"}
_PREFIXES_LONGEST_FIRST = sorted(_PREFIX, key=len, reverse=True)
_INT3 = re.compile(r"-?\d+")


class NcuError(ValueError):
    """ncu's output holds no table this module can read."""


@dataclass
class NcuKernel:
    id: int
    name: str
    grid: list[int] = field(default_factory=list)
    block: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def get(self, *names: str) -> float | None:
        """The first of `names` ncu reported (metric names differ between ncu versions and architectures)."""
        for n in names:
            v = self.metrics.get(n)
            if v is not None:
                return v
        return None


def _unit_factor(unit: str) -> float:
    """The factor that brings a value in `unit` to base units, for any of ncu's spellings: 'Gbyte/second' and 'GB/s'
    1e9, 'usecond' and 'us' 1e-6, 'ns' 1e-9, 'cycle/nsecond' 1e9, 'Ghz' 1e9, '%' 1; a unit it does not know
    ('register/thread', 'SM') 1."""
    unit = unit.strip()
    if not unit or unit == "%":
        return 1.0
    factor = 1.0
    for i, part in enumerate(unit.split("/")):
        f = _one(part)
        factor = factor * f if i == 0 else factor / f
    return factor


def _is_base(text: str) -> bool:
    return text in _SHORT_BASES or text.lower() in _LONG_BASES


def _one(part: str) -> float:
    """One side of a unit: a prefix and a base ('Mbyte', 'ns', 'KiB', 'Ghz'), or a bare base; 1 for what is
    neither (a count ncu names without a base unit)."""
    part = part.strip()
    for prefix in _PREFIXES_LONGEST_FIRST:
        if part.startswith(prefix) and _is_base(part[len(prefix):]):
            return _PREFIX[prefix]
    return 1.0


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _dims(text: str) -> list[int]:
    return [int(x) for x in _INT3.findall(text or "")][:3]


def table_lines(text: str) -> list[str]:
    """The CSV table's lines: from the header (its first cell is "ID") to the last row, ncu's own lines left out."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return []
    return [line for line in lines[start:] if line.startswith('"')]


def parse(text: str) -> list[NcuKernel]:
    """The kernels of a raw-page CSV, in the order ncu profiled them. Raises NcuError where there is no table."""
    lines = table_lines(text)
    if not lines:
        raise NcuError("no ncu table in the output")
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header = rows[0]
    name_col = next((header.index(c) for c in NAME_COLUMNS if c in header), None)
    if name_col is None:
        raise NcuError(f"the ncu table names no kernel column (columns: {header[:12]})")
    units: list[str] = [""] * len(header)
    body = rows[1:]
    if body and not body[0][0].strip():  # the units row: no ID
        units = body[0] + [""] * (len(header) - len(body[0]))
        body = body[1:]
    meta = {"ID", "Process ID", "Process Name", "Host Name", "Context", "Stream", "Device", "CC", "Block Size",
            "Grid Size", "API Stream", "Section Name", *NAME_COLUMNS}
    kernels = []
    for row in body:
        if len(row) < len(header) or _number(row[0]) is None:
            continue
        cell = dict(zip(header, row, strict=False))
        metrics = {}
        for i, col in enumerate(header):
            if col in meta:
                continue
            v = _number(row[i])
            if v is not None:
                metrics[col] = v * _unit_factor(units[i])
        kernels.append(NcuKernel(id=int(_number(row[0]) or 0), name=row[name_col], grid=_dims(cell.get("Grid Size", "")),
                                 block=_dims(cell.get("Block Size", "")), metrics=metrics))
    return kernels


PERMISSION_SIGNS = ("ERR_NVGPUCTRPERM", "permission to access NVIDIA GPU Performance Counters")


def failure(text: str) -> tuple[str, str] | None:
    """(kind, message) where ncu's output says why it profiled nothing: counter_permission, or ncu_failed with its
    ==ERROR== lines; None where it names no error."""
    if any(s in text for s in PERMISSION_SIGNS):
        return "counter_permission", ("the driver keeps the GPU's performance counters to administrators "
                                      "(ERR_NVGPUCTRPERM): run as root, or load the driver with "
                                      "NVreg_RestrictProfilingToAdminUsers=0")
    errors = [line for line in text.splitlines() if line.startswith("==ERROR==")]
    if errors:
        return "ncu_failed", "\n".join(errors[:5])[:2000]
    if "No kernels were profiled" in text:
        return "ncu_failed", "ncu profiled no kernel (the forward launched none inside the profiled range)"
    return None


def version(text: str) -> str | None:
    """ncu's version from `ncu --version`'s output: 'Version 2025.3.1.0 (build ...)' -> '2025.3.1.0'."""
    m = re.search(r"Version\s+([\d.]+)", text)
    return m.group(1) if m else None
