"""Itanium C++ names read without a demangler: the scope path of a mangled name. Standard library only, so the
build's object scan (sandbox/scan/object_scan.py, run by path with `python -I`) uses it without importing torch."""

from __future__ import annotations


def qualified_name(symbol: str) -> tuple[str, ...] | None:
    """The scope path of an Itanium-mangled name, up to its first template arguments:
    `_ZNK2at10TensorBase8data_ptrIfEEPT_v` -> ("at", "TensorBase", "data_ptr"); vtables, typeinfo and TLS
    wrappers name the entity they belong to; operators are their two-letter codes ("ls" is operator<<)."""
    if not symbol.startswith("_Z"):
        return None
    s, i = symbol, 2
    if s[i:i + 2] in ("TV", "TI", "TS", "TT", "TH", "TW", "GV"):
        i += 2
    parts: list[str] = []
    nested = i < len(s) and s[i] == "N"
    if nested:
        i += 1
        while i < len(s) and s[i] in "KVrRO":  # a method's cv- and ref-qualifiers
            i += 1
    while i < len(s):
        c = s[i]
        if c.isdigit():
            j = i
            while j < len(s) and s[j].isdigit():
                j += 1
            n = int(s[i:j])
            parts.append(s[j:j + n])
            i = j + n
        elif s.startswith("St", i):
            parts.append("std")
            i += 2
        elif c in "CD" and i + 1 < len(s) and s[i + 1].isdigit():
            parts.append(s[i:i + 2])
            i += 2
        elif c == "B" and parts:  # an ABI tag ([abi:cxx11]) belongs to the name before it
            j = i + 1
            while j < len(s) and s[j].isdigit():
                j += 1
            i = j + int(s[i + 1:j] or 0)
        elif c.islower() and i + 1 < len(s) and s[i + 1].islower():
            parts.append(s[i:i + 2])
            i += 2
        else:
            break
        if not nested:
            break
    return tuple(parts) or None
