"""The server's own paths out of everything a client is sent: tool replies, their structured content, errors.

Build logs, compiler diagnostics, judge tracebacks and OS errors name files by their absolute path on the server,
which tells a client where the server keeps its workspaces, who runs it (the home directory) and how it is
installed. A path inside the workspace becomes relative to it (what the file tools take); the other known places
become placeholders. Only whole path prefixes are replaced, so `/root` does not touch `/rootfs`.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mcp_types import CallToolResult, TextContent

# a character that may continue a file name: a match must not be followed by one
_NAME_CHAR = r"[\w.~+-]"
# what ends a path before a match ("-I/x", "'/x'", "file=/x"): a "/" after it puts the match inside another path
_BEFORE_PATH = frozenset(" \t\n\r\"'`=:,;()[]{}<>|")
# standard install prefixes say nothing about this server, and hiding them would garble compiler command lines
_SYSTEM_PREFIXES = frozenset({"/usr", "/usr/local"})
# workspace folders under the server's root: ws-<hex> and the default one (mcp_server.workspaces._ID)
_WS_DIR = r"[A-Za-z0-9_-]{1,64}"
# the judge's exchange area: a folder per judging process, cuda-agent-<pid>-<random>, in /dev/shm or, where that
# cannot be written, the temporary folder (sandbox.confinement.environment.exchange_base); the task's source
# being checked, a session's logs and outputs live there, so errors name it
_EXCHANGE_DIR = r"/cuda-agent-[A-Za-z0-9_.-]+"
EXCHANGE = "<exchange>"


def _forms(path: Path | str) -> list[str]:
    """A path as given and as resolved (a temp dir under a symlink, a home through a link), longest first."""
    p = Path(path)
    forms = {str(p).rstrip("/")}
    try:
        forms.add(str(p.resolve()).rstrip("/"))
    except OSError:
        pass
    # "/" (a home or root of "/") would match every absolute path: nothing to hide there
    return sorted((f for f in forms if f), key=len, reverse=True)


class Redactor:
    def __init__(self, server_root: Path, places: Iterable[tuple[Path | str, str]] = (),
                 exchange_bases: Iterable[str] = ()):
        """`server_root`: where workspaces live (their paths become relative); `places`: (path, placeholder);
        `exchange_bases`: folders whose cuda-agent-* folders are the judge's exchange area."""
        self._server_root = server_root
        self._workspace_roots: list[Path] = []
        self._places = list(places)
        self._exchange_bases = list(exchange_bases)
        self._build()

    @classmethod
    def for_server(cls, server_root: Path, cache_dir: Path | None = None) -> Redactor:
        places: list[tuple[Path | str, str]] = [(server_root, "<server-root>")]
        if cache_dir is not None:
            places.append((cache_dir, "<judge-cache>"))
        # the checkout (task files, the sandbox's infrastructure headers) and the interpreter (torch's headers)
        places.append((Path(__file__).resolve().parent.parent, "<cuda-agent>"))
        places += [(p, "<python>") for p in {sys.prefix, sys.base_prefix} if p not in _SYSTEM_PREFIXES]
        places.append((Path.home(), "~"))
        return cls(server_root, places, exchange_bases=("/dev/shm", tempfile.gettempdir()))

    def add_workspace(self, root: Path) -> None:
        """A workspace outside the server's root (`serve --workdir`): its paths become relative too."""
        self._workspace_roots.append(root)
        self._build()

    def _build(self) -> None:
        # one alternation, longest first: at a given position the most specific prefix wins (a workspace
        # before the server's root, the cache before the home directory it may live in)
        alts: list[tuple[str, str | None]] = []
        for root in self._workspace_roots:
            alts += [(re.escape(f), None) for f in _forms(root)]
        alts += [(re.escape(f) + "/" + _WS_DIR, None) for f in _forms(self._server_root)]
        for path, placeholder in self._places:
            alts += [(re.escape(f), placeholder) for f in _forms(path)]
        alts.sort(key=lambda a: len(a[0]), reverse=True)
        # last: at one position a fixed place (a server root that is itself /tmp/cuda-agent-mcp-...) comes first
        for base in dict.fromkeys(self._exchange_bases):
            alts += [(re.escape(f) + _EXCHANGE_DIR, EXCHANGE) for f in _forms(base)]
        self._replacements = [p for _, p in alts]
        groups = "|".join(f"({pattern})" for pattern, _ in alts)
        # a workspace path followed by "/" loses the slash too: "<ws>/kernels/a.cu" becomes "kernels/a.cu"
        self._pattern = re.compile(rf"(?:{groups})(?:(/)|(?!{_NAME_CHAR}))")

    def _sub(self, m: re.Match[str]) -> str:
        if _inside_path(m.string, m.start()):  # "/root" in "/work/root/x" is not the home directory
            return m.group(0)
        groups = m.groups()
        index = next(i for i, g in enumerate(groups[:-1]) if g is not None)
        placeholder = self._replacements[index]
        slash = groups[-1] or ""
        if placeholder is not None:
            return placeholder + slash
        return "" if slash else "."

    def text(self, text: str) -> str:
        if "/" not in text:
            return text
        return self._pattern.sub(self._sub, text)

    def data(self, value: Any) -> Any:
        """Every string in a JSON-like value (structured content), keys included."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.data(k): self.data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v) for v in value]
        return value

    def result(self, result: CallToolResult) -> CallToolResult:
        content = [c.model_copy(update={"text": self.text(c.text)}) if isinstance(c, TextContent) else c
                   for c in result.content]
        structured = self.data(result.structured_content) if result.structured_content is not None else None
        return result.model_copy(update={"content": content, "structured_content": structured})


def _inside_path(text: str, start: int) -> bool:
    i = start - 1
    while i >= 0 and text[i] not in _BEFORE_PATH:
        if text[i] == "/":
            return True
        i -= 1
    return False
