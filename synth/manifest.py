"""A stage's folder: task files (`ID.py`) plus `manifest.jsonl`, one row per task seen, kept or dropped.

Rows carry what later stages need (`ops`, `op_specs`, `spec`, `metrics`, `nearest`); a stage copies
the row forward and adds its own fields. A folder of plain .py task files with no manifest is
accepted as input too (tasks users bring), one row per file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

MANIFEST = "manifest.jsonl"


class StageError(ValueError):
    """Bad input or output folder, with a message saying what to do."""


def read_rows(folder: Path) -> list[dict]:
    path = folder / MANIFEST
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        # a process killed mid-write (a device call's time limit) leaves a last line without its newline:
        # that task was not recorded, and a resumed run decides it again
        lines.pop()
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise StageError(f"{path}:{n}: not a JSON line") from None
    return rows


def _repair(folder: Path) -> None:
    """Before appending: cut an unfinished last row (see read_rows) and the temporary task files of a killed run."""
    path = folder / MANIFEST
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[:data.rfind(b"\n") + 1])
    for tmp in folder.glob(".*.py.tmp"):
        tmp.unlink(missing_ok=True)


def input_rows(folder: Path) -> list[dict]:
    """The kept tasks of a stage's folder, each with its source read in."""
    if not folder.is_dir():
        raise StageError(f"no such folder: {folder}")
    rows = [r for r in read_rows(folder) if r.get("status") == "kept"]
    if not rows and not (folder / MANIFEST).is_file():
        rows = [{"id": p.stem, "file": p.name, "origin": "user", "ops": []} for p in sorted(folder.glob("*.py"))]
    for r in rows:
        try:
            r["source"] = (folder / r["file"]).read_text()
        except OSError as e:
            raise StageError(f"{folder / r['file']}: {e.strerror}") from None
    return rows


class StageOutput:
    """Writes a stage's folder; with resume, tasks already recorded there are not redone."""

    def __init__(self, folder: Path, stage: str, resume: bool):
        self.folder = folder
        self.stage = stage
        existing = read_rows(folder)
        if existing and not resume:
            raise StageError(f"{folder} already holds a {MANIFEST}: pass --resume to continue it, "
                             "or choose an empty folder")
        folder.mkdir(parents=True, exist_ok=True)
        _repair(folder)
        self.rows: dict[str, dict] = {r["id"]: r for r in existing}
        self._f = open(folder / MANIFEST, "a")

    def done(self, task_id: str) -> bool:
        return task_id in self.rows

    def write(self, row: dict, source: str | None = None) -> None:
        row = {k: v for k, v in row.items() if k != "source"}
        row["stage"] = self.stage
        if row.get("status") == "kept":
            if source is None:
                raise ValueError("a kept task needs its source")
            row["file"] = f"{row['id']}.py"
            tmp = self.folder / f".{row['file']}.tmp"
            tmp.write_text(source)
            os.replace(tmp, self.folder / row["file"])
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()  # a killed run loses at most the task in flight
        self.rows[row["id"]] = row

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> StageOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> dict:
        return summarize(self.stage, list(self.rows.values()))


def summarize(stage: str, rows: list[dict]) -> dict:
    kept = sum(1 for r in rows if r.get("status") == "kept")
    reasons = Counter(r.get("reason") or "unknown" for r in rows if r.get("status") != "kept")
    return {"stage": stage, "seen": len(rows), "kept": kept, "dropped": len(rows) - kept,
            "reasons": dict(reasons.most_common())}
