"""The set as a dataset folder, in both splits (synth.splits): `train.jsonl.gz` and `eval.jsonl.gz`
(always), the `datasets` save_to_disk files of a DatasetDict (where the package is importable),
`report.json` and a README.md dataset card (synth.card).

The build machine need not have `datasets` (the GPU device does not): the JSON lines hold every column,
and `cuda-agent synth card --out BUILD` (or `synth package`) run later where `datasets` is installed
adds the Arrow files from them, so the folder then loads with `datasets.load_from_disk`. Everything is
written compressed and in task-id order, so the same set gives the same bytes whichever order its
tasks finished in and over however many resumed invocations it was built: the folder is small enough
to ship in the repository (tasks/synth_set) and diffs only where the set changed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

from synth.buildinfo import read_info
from synth.card import card
from synth.report import eager_of, make_report, set_rows
from synth.splits import EVAL_FRACTION, SALT, split_of
from tasks.synthset import LEGACY_ROWS, SPLITS, split_file

DATASET = "dataset"
COLUMNS = ("task_id", "code", "ops", "libraries", "fusion_depth", "origin", "backend", "eager_ms",
           "nearest_kernelbench", "score", "split")


def dataset_rows(build: Path, backend: str, eval_fraction: float = EVAL_FRACTION) -> list[dict]:
    rows = []
    for r in set_rows(build):
        near = r.get("nearest") or {}
        source = (build / "5-selfcheck" / r["file"]).read_text()
        rows.append({"task_id": r["id"], "code": source, "ops": list(r.get("ops") or []),
                     "libraries": list(r.get("libraries") or []), "fusion_depth": len(r.get("ops") or []),
                     "origin": r.get("origin", ""), "backend": backend, "eager_ms": eager_of(r),
                     "nearest_kernelbench": near.get("problem") or "", "score": float(near.get("score") or 0.0),
                     "split": split_of(r["id"], eval_fraction)})
    return sorted(rows, key=lambda r: r["task_id"])


def _gzip_lines(rows: list[dict]) -> bytes:
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    return gzip.compress(text, compresslevel=9, mtime=0)  # mtime 0: the same rows, the same bytes


def _schema():
    import pyarrow as pa

    s, f, lst = pa.string(), pa.float64(), pa.list_(pa.string())
    return pa.schema([("task_id", s), ("code", s), ("ops", lst), ("libraries", lst), ("fusion_depth", pa.int64()),
                      ("origin", s), ("backend", s), ("eager_ms", f), ("nearest_kernelbench", s), ("score", f),
                      ("split", s)])


def _compress_arrow(folder: Path) -> None:
    """Rewrite save_to_disk's Arrow files zstd-compressed: load_from_disk reads them as they are (pyarrow
    decompresses on read), and task source compresses about tenfold."""
    import pyarrow as pa

    if not pa.Codec.is_available("zstd"):
        return
    for path in folder.glob("*/*.arrow"):
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
        tmp = path.with_suffix(".tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(
                sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(table)
        tmp.replace(path)


def _save_arrow(folder: Path, by_split: dict[str, list[dict]]) -> None:
    import pyarrow as pa
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    parts = {}
    for split, rows in by_split.items():
        # the fingerprint is the rows' own hash: the same set gets the same one on every machine, and datasets'
        # default (dill over the dataset's state) hit Python's recursion limit inside a long test process
        fingerprint = hashlib.sha256(_gzip_lines(rows)).hexdigest()[:16]
        table = pa.Table.from_pydict({k: [r[k] for r in rows] for k in COLUMNS}, schema=_schema())
        parts[split] = Dataset(InMemoryTable(table), fingerprint=fingerprint)
    DatasetDict(parts).save_to_disk(str(folder))
    _compress_arrow(folder)


def _clear(folder: Path) -> None:
    """The files an earlier write left (the one-file layout before the splits included), nothing else."""
    for name in (LEGACY_ROWS, "dataset_info.json", "state.json", "dataset_dict.json", "dataset.parquet"):
        (folder / name).unlink(missing_ok=True)
    for p in folder.glob("data-*.arrow"):
        p.unlink()
    for split in SPLITS:
        shutil.rmtree(folder / split, ignore_errors=True)


def write_dataset(build: Path, backend: str, band_ms: tuple[float, float], threshold: float,
                  eval_fraction: float = EVAL_FRACTION, dest: Path | None = None) -> dict:
    """(Re)write BUILD/dataset (or `dest`) from the build's folders; returns where and what it wrote."""
    folder = dest or build / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    _clear(folder)
    rows = dataset_rows(build, backend, eval_fraction)
    by_split = {s: [r for r in rows if r["split"] == s] for s in SPLITS}
    arrow, note = False, None
    try:
        import datasets  # noqa: F401
    except ImportError:
        note = (f"datasets is not importable here: {split_file('train')} and {split_file('eval')} hold every "
                f"column; run `cuda-agent synth card --out {build}` where it is to add the save_to_disk files")
    else:
        _save_arrow(folder, by_split)
        arrow = True
    # after save_to_disk, which owns the folder's layout
    for split, part in by_split.items():
        (folder / split_file(split)).write_bytes(_gzip_lines(part))
    rep = make_report(build, band_ms)
    rep.update(backend=backend, threshold=threshold,
               splits={"eval_fraction": eval_fraction, "salt": SALT, **{s: len(p) for s, p in by_split.items()}})
    info = read_info(build)
    if info:  # what made the set, run by run (host names stay in the build folder: the report may ship)
        rep["build"] = {"params": info["params"],
                        "runs": [{k: v for k, v in r.items() if k != "host"} for r in info["runs"]]}
    (folder / "report.json").write_text(json.dumps(rep, indent=2))
    (folder / "README.md").write_text(card(rep, len(rows), band_ms, threshold, backend))
    return {"rows": len(rows), "splits": {s: len(p) for s, p in by_split.items()}, "dataset": str(folder),
            "arrow": arrow, "note": note, "report": rep}
