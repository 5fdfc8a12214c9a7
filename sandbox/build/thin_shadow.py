"""The torch header a thin compile reads in place of torch's own: ATen/DeviceGuard.h without its list overload.

Every ATen/ops/NAME.h includes ATen/DeviceGuard.h, and that header includes ATen/core/IListRef.h for one function,
`device_of(ITensorListRef)`. IListRef brings IValue, whose inline functions GCC instantiates at the end of every
translation unit that sees them, precompiled header or not: on this repository's CPU that was 0.55 of a thin
binding's 1.25 CPU-seconds. The copy written here is torch's text with that include and that function taken out,
and nothing else changed, so the functions it keeps are token for token torch's (one definition across the thin
objects and the infrastructure's). It sits in the thin precompiled header's folder, the first include directory of
a thin compile, so `#include <ATen/DeviceGuard.h>` finds it before torch's. A binding that calls the list overload
(or names ITensorListRef without including IListRef.h, or calls an op of a tensor list such as at::cat, which the
symbol scan refuses in an extension anyway) fails the thin compile and is compiled against the full header, as any
source that needs more than the thin path offers; nothing it could call resolves differently.
Where torch's header no longer reads as expected, no copy is written and thin compiles read torch's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHADOWED = "ATen/DeviceGuard.h"
ENV = "CUDA_AGENT_THIN_SHADOW"  # "0": thin compiles read torch's header (to measure what the copy saves)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def scheme() -> str:
    """Part of the infrastructure's hash: a thin header precompiled with the copy and one without never share a
    folder, nor does one made before the copy existed or by another version of this module."""
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12] if enabled() else "thin-shadow-off"


_INCLUDE = "#include <ATen/core/IListRef.h>\n"
# the list overload with the comment above it, up to its closing brace at the start of a line
_LIST_OVERLOAD = re.compile(r"(?:///[^\n]*\n)*inline std::optional<Device> device_of\(ITensorListRef t\) \{\n.*?\n\}\n",
                            re.S)


def shadow_text(original: str) -> str | None:
    """torch's ATen/DeviceGuard.h without IListRef and the list overload, or None where it does not hold exactly one
    of each (another torch): then no copy is made."""
    if original.count(_INCLUDE) != 1 or len(_LIST_OVERLOAD.findall(original)) != 1:
        return None
    text = _LIST_OVERLOAD.sub("", original.replace(_INCLUDE, ""))
    return None if "ITensorListRef" in text or "IListRef" in text else text


def write(folder: Path, include_dirs: list[str]) -> Path | None:
    """The copy in `folder`, made from the first ATen/DeviceGuard.h among `include_dirs` (torch's), or None."""
    if not enabled():
        return None
    for d in include_dirs:
        original = Path(d) / SHADOWED
        if original.is_file():
            text = shadow_text(original.read_text())
            if text is None:
                return None
            out = folder / SHADOWED
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            return out
    return None
