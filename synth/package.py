"""`cuda-agent synth package`: a finished build's set in the form the project ships.

The shipped folder (`tasks/synth_set` unless told otherwise) is the build's dataset folder (synth.dataset)
written afresh from the build's stage folders: both splits as gzipped JSON lines (what `synth:` task ids
read on a plain clone, standard library only), the zstd-compressed `datasets` files where `datasets` is
importable, report.json and the card. It is written beside the destination, checked (every task loads
by its id, and `datasets.load_from_disk` gives the same rows), and only then swapped in, so a failed
package leaves the shipped set as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from synth.buildinfo import read_info
from synth.manifest import StageError
from tasks.synthset import SPLITS, is_set, shipped_root, synth_tasks


def dataset_params(build: Path, backend: str | None = None) -> tuple[str, tuple[float, float], float, float]:
    """(backend, band, threshold, eval fraction) the build's set was made with: from build.json, else from an
    earlier dataset report, else the defaults."""
    from synth.dataset import DATASET
    from synth.filter import DEFAULT_BAND_MS
    from synth.signature import DEFAULT_THRESHOLD
    from synth.splits import EVAL_FRACTION

    params = (read_info(build) or {}).get("params", {})
    path = build / DATASET / "report.json"
    prev = json.loads(path.read_text()) if path.is_file() else {}
    be = backend or params.get("backend") or prev.get("backend") or "cpu"
    if be not in DEFAULT_BAND_MS:
        raise ValueError("the backend is cpu or cuda")
    band = tuple(params.get("band_ms") or prev.get("eager_ms", {}).get("band") or DEFAULT_BAND_MS[be])
    threshold = params.get("threshold") or prev.get("threshold") or DEFAULT_THRESHOLD
    frac = params.get("eval_fraction")
    if frac is None:
        frac = (prev.get("splits") or {}).get("eval_fraction", EVAL_FRACTION)
    return be, (float(band[0]), float(band[1])), float(threshold), float(frac)


def _finished(build: Path) -> None:
    runs = (read_info(build) or {}).get("runs") or []
    if runs and not runs[-1].get("complete"):
        raise StageError(f"{build}: the build is not complete: run the same `synth build` command with --resume")
    if not (build / "5-selfcheck" / "manifest.jsonl").is_file():
        raise StageError(f"{build} holds no self-checked tasks (5-selfcheck): build the set first")


def package(build: Path, dest: Path | None = None, eval_fraction: float | None = None) -> dict:
    """Write the build's set to `dest` (default: the shipped location); returns what was written, and its size."""
    from synth.dataset import write_dataset

    _finished(build)
    dest = dest or shipped_root()
    if dest.exists() and any(dest.iterdir()) and not is_set(dest):
        raise StageError(f"{dest} holds other files: package into an empty folder or a set folder")
    backend, band, threshold, frac = dataset_params(build)
    if eval_fraction is not None:
        frac = eval_fraction
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    exp = write_dataset(build, backend, band, threshold, frac, dest=tmp)
    loaded = synth_tasks(str(tmp))
    if len(loaded) != exp["rows"]:
        raise StageError(f"the packaged set loads {len(loaded)} tasks of {exp['rows']}")
    if exp["arrow"]:
        import datasets

        dd = datasets.load_from_disk(str(tmp))
        got = {s: len(dd[s]) for s in SPLITS}
        if got != exp["splits"]:
            raise StageError(f"load_from_disk gives {got}, the rows are {exp['splits']}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    files = {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*")) if p.is_file()}
    return {"dest": str(dest), "rows": exp["rows"], "splits": exp["splits"], "arrow": exp["arrow"],
            "note": exp["note"], "bytes": sum(files.values()), "files": files}
