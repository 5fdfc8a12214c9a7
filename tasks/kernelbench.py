"""KernelBench from a plain clone: download the upstream problems at a pinned commit into the cache.

The archive is checked against `kernelbench_manifest.json` (sha256 of every level 1-3 problem file at
the pinned commit, made with `manifest_of()` from a tree of that commit) before anything is installed;
a mismatch, a missing file or a member whose path leaves the archive refuses the whole download and
leaves the cache as it was. Only the standard library, so the lowest layer stays light.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

REPO = "ScalingIntelligence/KernelBench"
COMMIT = "423217d9fda91e0c2d67e4a43bf62f96f6d104f1"
ARCHIVE_URL = f"https://github.com/{REPO}/archive/{COMMIT}.tar.gz"
MANIFEST_PATH = Path(__file__).parent / "kernelbench_manifest.json"
DOWNLOAD_COMMAND = "cuda-agent tasks download kernelbench"
LEVELS = ("level1", "level2", "level3")
MAX_ARCHIVE_BYTES = 512 << 20  # upstream's archive is ~30 MB; past this something is wrong


class DownloadError(RuntimeError):
    """A download that was refused or failed; nothing was installed."""


def cache_dir() -> Path:
    """Shared cache (toolchain probes, timings, suites): $CUDA_AGENT_CACHE or ~/.cache/cuda-agent."""
    env = os.environ.get("CUDA_AGENT_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuda-agent"
    base.mkdir(parents=True, exist_ok=True)
    return base


def installed_root(commit: str = COMMIT) -> Path:
    """Where `download_kernelbench` puts the levels (one folder per pinned commit)."""
    return cache_dir() / "kernelbench" / commit


def manifest_of(root: Path) -> dict[str, str]:
    """sha256 of every `levelN/*.py` (and LICENSE) under a KernelBench tree, keyed by relative path."""
    files = sorted(p for level in LEVELS for p in (root / level).glob("*.py"))
    if (root / "LICENSE").is_file():
        files.append(root / "LICENSE")
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def load_manifest(path: Path | None = None) -> dict[str, str]:
    return json.loads((path or MANIFEST_PATH).read_text())["files"]


def _fetch(url: str, dest: Path, timeout: float) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, dest.open("wb") as out:
            total = 0
            while chunk := resp.read(1 << 20):
                total += len(chunk)
                if total > MAX_ARCHIVE_BYTES:
                    raise DownloadError(f"{url}: archive larger than {MAX_ARCHIVE_BYTES >> 20} MiB, refused")
                out.write(chunk)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise DownloadError(f"{url}: cannot download ({reason}); use --url for a mirror") from None


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or name.startswith("/"):
        raise DownloadError(f"archive member {name!r} leaves the archive; refused")
    return p


def _members(archive: Path) -> Iterator[tuple[PurePosixPath, bytes | None]]:
    """(path, content) of each member; content None for folders. Refuses escapes and links."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                path = _safe_name(info.filename)
                yield path, None if info.is_dir() else zf.read(info)
        return
    try:
        tf = tarfile.open(archive, "r:*")
    except tarfile.TarError as e:
        raise DownloadError(f"not a tar or zip archive: {e}") from None
    with tf:
        for m in tf:
            path = _safe_name(m.name)
            if m.issym() or m.islnk():
                if m.islnk() or PurePosixPath(m.linkname).is_absolute() or ".." in PurePosixPath(m.linkname).parts:
                    raise DownloadError(f"archive member {m.name!r} links to {m.linkname!r}; refused")
                continue
            if m.isdir() or not m.isfile():
                yield path, None
                continue
            f = tf.extractfile(m)
            yield path, f.read() if f else b""


def _suite_files(archive: Path) -> dict[str, bytes]:
    """The manifest-relevant files, found under the archive's `KernelBench/` folder wherever it sits."""
    found: dict[str, bytes] = {}
    for path, data in _members(archive):
        if data is None:
            continue
        parts = path.parts
        if "KernelBench" in parts:
            i = parts.index("KernelBench")
            rel = parts[i + 1:]
            if len(rel) == 2 and rel[0] in LEVELS and rel[1].endswith(".py"):
                found["/".join(rel)] = data
        elif len(parts) == 2 and parts[1] == "LICENSE":  # the repository's own, next to KernelBench/
            found["LICENSE"] = data
    return found


def verify_files(files: dict[str, bytes], manifest: dict[str, str]) -> None:
    missing = sorted(set(manifest) - set(files))
    bad = sorted(n for n in manifest if n in files and hashlib.sha256(files[n]).hexdigest() != manifest[n])
    if missing or bad:
        detail = []
        if bad:
            detail.append(f"{len(bad)} file(s) differ from the checksums kept in the repository ({', '.join(bad[:5])})")
        if missing:
            detail.append(f"{len(missing)} file(s) missing ({', '.join(missing[:5])})")
        raise DownloadError("the archive is not KernelBench at the pinned commit: " + "; ".join(detail)
                            + "; nothing was installed")


def download_kernelbench(url: str = ARCHIVE_URL, manifest: dict[str, str] | None = None,
                         timeout: float = 120.0) -> Path:
    """Fetch, verify and install the pinned KernelBench levels; returns the folder they are in."""
    manifest = load_manifest() if manifest is None else manifest
    final = installed_root()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".download-") as tmp:
        archive = Path(tmp) / "archive"
        _fetch(url, archive, timeout)
        files = _suite_files(archive)
        verify_files(files, manifest)
        stage = Path(tmp) / "stage"
        for name in manifest:  # only verified files; anything else in the archive is left out
            out = stage / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(files[name])
        # swap in whole, so a reader never sees a half-installed suite
        old = Path(tmp) / "old"
        if final.exists():
            final.rename(old)
        stage.rename(final)
    return final


def missing_suite_message(where: str) -> str:
    return (f"KernelBench not found ({where}): run `{DOWNLOAD_COMMAND}` to fetch it into the cache, "
            "or set CUDA_AGENT_KERNELBENCH to a folder holding level1/, level2/, level3/")


def _main() -> None:  # regenerate the manifest: python -m tasks.kernelbench DIR
    import sys

    files = manifest_of(Path(sys.argv[1]))
    MANIFEST_PATH.write_text(json.dumps({"repo": REPO, "commit": COMMIT, "files": files}, indent=1) + "\n")
    print(f"{len(files)} files -> {MANIFEST_PATH}")


if __name__ == "__main__":
    _main()


__all__ = ["ARCHIVE_URL", "COMMIT", "DOWNLOAD_COMMAND", "DownloadError", "cache_dir", "download_kernelbench",
           "installed_root", "manifest_of",
           "missing_suite_message"]
