"""The tiny models' tokenizer corpus, pinned: the project's own text as it stood when the file was written.

Training the tokenizer on the live repository made every docs edit change every bench run's tokens (and a
checkout with KernelBench beside it got another tokenizer than a plain clone), so runs did not compare
across commits. The corpus is now one committed file, `tokenizer_corpus.jsonl.gz` (one {"path", "text"}
object per source file, in order), checked against CORPUS_SHA256 when read. Rewriting it is a deliberate
act that changes every tiny model's tokens:

    python -m training.tokenizer_corpus    # writes the file from the repository, prints the new hash
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS_FILE = Path(__file__).resolve().parent / "tokenizer_corpus.jsonl.gz"
# of the decompressed bytes (gzip output differs between zlib versions; the text does not)
CORPUS_SHA256 = "6e4f81c2e685328bc0fb10ce6b189194c71be17cd7bec7769c28cf2114e6ab6c"
SUFFIXES = {".md", ".py", ".cu", ".cpp", ".cuh", ".h"}
# the skill, task examples and solutions, docs, the harness's prompts; not KernelBench, which a plain clone
# lacks and which is not ours to redistribute
ROOTS = ("skills", "tasks", "docs", "harness")


def source_files(roots: list[Path] | None = None) -> Iterator[Path]:
    for root in roots if roots is not None else [REPO / r for r in ROOTS]:
        if root.is_file():
            yield root
        elif root.is_dir():
            yield from sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def _encode(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def write_corpus(path: Path = CORPUS_FILE) -> str:
    """Writes the corpus from the repository's files; returns the sha256 to put in CORPUS_SHA256."""
    rows = [{"path": p.relative_to(REPO).as_posix(), "text": p.read_text(errors="replace")} for p in source_files()]
    data = _encode(rows)
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return hashlib.sha256(data).hexdigest()


def corpus_texts(path: Path = CORPUS_FILE) -> list[str]:
    """The pinned texts, in order; a file that is not the pinned one is an error, not another tokenizer."""
    data = gzip.decompress(path.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, not the pinned {CORPUS_SHA256}: rewriting the corpus "
                         "changes every tiny model's tokens, so its hash is changed on purpose in the same commit")
    # split on newlines only: str.splitlines would also cut at U+2028 and the like, which json.dumps leaves as they are
    return [json.loads(ln)["text"] for ln in data.decode().split("\n") if ln]


if __name__ == "__main__":
    print(write_corpus(Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS_FILE))
