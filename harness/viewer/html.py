"""The report page: one static HTML file, everything inlined, so it opens offline and can be mailed.

Data travels as JSON in `<script type="application/json">` blocks: the index is parsed at load, each
episode's body only when that episode is opened, so a run of thousands of episodes loads quickly.
Model and task text is untrusted: `script_json` makes a JSON block that no string can break out of, and
the page's script renders every string with textContent, never as markup.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from harness.viewer.data import build_view

MARKER = "<!--VIEWER-DATA-->"
# inside <script> the HTML parser ends the element at "</script" and treats "<!--" specially; JavaScript
# treats U+2028/2029 as line ends in older engines. \u escapes keep the JSON identical after parsing.
_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_TABLE = str.maketrans(_ESCAPES)


def script_json(obj: Any) -> str:
    """JSON that is safe as the text of a <script type="application/json"> element."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str).translate(_TABLE)


def template() -> str:
    return resources.files("harness.viewer").joinpath("template.html").read_text(encoding="utf-8")


def _script_hashes(page: str) -> str:
    """CSP hashes of the page's own scripts: a second line of defence, so that even a script element
    that reached the page some other way would be refused by the browser."""
    codes = re.findall(r"<script>(.*?)</script>", page, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(c.encode()).digest()).decode()}'" for c in codes)


def render(view: dict[str, Any]) -> str:
    blocks = [f'<script type="application/json" id="viewer-index">{script_json(view["index"])}</script>']
    blocks += [f'<script type="application/json" id="ep-{i}">{script_json(body)}</script>'
               for i, body in enumerate(view["bodies"])]
    page = template()
    page = page.replace("__SCRIPT_HASHES__", _script_hashes(page), 1)
    if MARKER not in page:
        raise RuntimeError("the viewer template lost its data marker")
    before, after = page.split(MARKER, 1)
    return before + "\n".join(blocks) + after


def write_html(run: Path, out: Path | None = None, metrics: Path | None = None, title: str | None = None) -> Path:
    view = build_view(run, metrics, title)
    run = Path(run)
    target = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(view), encoding="utf-8")
    return target
