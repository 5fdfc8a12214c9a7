"""Tracing tasks in isolated workers, and KernelBench's signatures, traced once per suite and cached.

Task code is untrusted Python (synthesized tasks, and the reference problems themselves), so it runs
in `sandbox.worker`'s `trace` role, never in this process. A worker imports torch once (seconds) and
then traces a batch of tasks (tens of milliseconds each), so the 250 KernelBench problems take one
worker, not 250. A batch whose worker dies or overruns is split in halves and retried, so one bad task
costs its neighbours a retry, not a verdict.

KernelBench's signatures are cached under the project cache (`$CUDA_AGENT_CACHE/decontam/`), keyed by
the suite (the pinned commit when the files match `tasks/kernelbench_manifest.json`, else a digest of
the files), the torch version (decompositions change with it) and SIGNATURE_VERSION.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from synth.signature import Signature, signature

# bump when sandbox/worker/trace.py or synth/signature.py would give another signature for the same task
SIGNATURE_VERSION = 3
BATCH = 64
TASK_TIMEOUT_S = 60.0
LEVELS = ("level1", "level2", "level3")


def trace_sources(sources: dict[str, str], batch: int = BATCH, timeout_s: float = TASK_TIMEOUT_S) -> dict[str, dict]:
    """id -> {"ok": True, "trace": {...}} or {"ok": False, "error": "..."}, every source traced in a worker."""
    from sandbox.confinement.environment import handoff_dir

    ids = list(sources)
    out: dict[str, dict] = {}
    scratch = handoff_dir()
    try:
        paths = {}
        for n, tid in enumerate(ids):
            paths[tid] = scratch / f"task_{n}.py"
            paths[tid].write_text(sources[tid])
        for i in range(0, len(ids), batch):
            out.update(_batch(ids[i:i + batch], paths, scratch, timeout_s))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _batch(ids: list[str], paths: dict, scratch: Path, timeout_s: float) -> dict[str, dict]:
    from sandbox.confinement.processes import Worker, WorkerError

    w = Worker("trace", scratch)
    try:
        # the worker's own alarm stops a Python loop at timeout_s; this one stops anything else
        reply = w.request("trace", timeout_s * len(ids) + 120, "tracing tasks",
                          tasks=[str(paths[t]) for t in ids], timeout_s=timeout_s)
    except WorkerError as e:
        reply = {"ok": False, "reason": e.reason, "message": e.message}
    finally:
        w.close()
    if reply.get("ok"):
        return dict(zip(ids, reply["results"], strict=True))
    if len(ids) == 1:
        return {ids[0]: {"ok": False, "error": f"{reply.get('reason')}: {reply.get('message', '')[:1500]}"}}
    half = len(ids) // 2
    return {**_batch(ids[:half], paths, scratch, timeout_s), **_batch(ids[half:], paths, scratch, timeout_s)}


def signatures(sources: dict[str, str]) -> tuple[dict[str, Signature], dict[str, str]]:
    """(id -> signature of each traced source, id -> why the others could not be traced)."""
    sigs: dict[str, Signature] = {}
    errors: dict[str, str] = {}
    for tid, res in trace_sources(sources).items():
        if not res.get("ok"):
            errors[tid] = res.get("error", "unknown")
            continue
        try:
            sigs[tid] = signature(res["trace"])
        except Exception as e:  # a trace this canonicalizer does not understand: that task alone
            errors[tid] = f"signature: {type(e).__name__}: {e}"
    return sigs, errors


@dataclass
class Reference:
    """KernelBench's problems: signatures of those that trace, errors of those that do not."""

    root: Path
    key: str
    signatures: list[tuple[str, Signature]]
    errors: dict[str, str] = field(default_factory=dict)
    cached: bool = False


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def _suite_key(root: Path, files: list[Path]) -> str:
    from tasks.kernelbench import COMMIT, load_manifest

    hashes = {f.relative_to(root).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    pinned = {k: v for k, v in load_manifest().items() if k.startswith(LEVELS)}
    if hashes == pinned:
        suite = f"kernelbench-{COMMIT[:12]}"
    else:
        suite = "tree-" + hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:16]
    return f"{suite}-torch{_torch_version()}-sig{SIGNATURE_VERSION}"


def reference(root: Path | None = None, refresh: bool = False) -> Reference:
    """KernelBench level 1-3 signatures: from the cache, else traced now (about 15 s for all 250) and cached."""
    from tasks.kernelbench import cache_dir
    from tasks.loader import kernelbench_root

    root = Path(root or kernelbench_root())
    files = sorted(p for level in LEVELS for p in (root / level).glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no KernelBench problems under {root} (set CUDA_AGENT_KERNELBENCH)")
    key = _suite_key(root, files)
    path = cache_dir() / "decontam" / f"{key}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            return Reference(root, key, [(n, Signature.from_json(s)) for n, s in data["signatures"]],
                             data.get("errors", {}), cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache is traced again
    names = {f"kernelbench/{f.parent.name}/{f.stem}": f for f in files}
    sigs, errors = signatures({n: f.read_text() for n, f in names.items()})
    ref = Reference(root, key, sorted(sigs.items()), errors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"root": str(root), "key": key, "errors": errors,
                               "signatures": [(n, s.to_json()) for n, s in ref.signatures]}))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    return ref
