"""The tiny models' tokenizer is trained on a pinned corpus: the same tokens on every commit and machine,
whatever docs/ says and whether KernelBench is beside the checkout."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the train extra is not installed")
pytest.importorskip("transformers", reason="the train extra is not installed")

from training.tokenizer_corpus import CORPUS_FILE, corpus_texts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HASH = ("import hashlib, training; from training.models import train_tokenizer; "
        "print(training.__file__); print(hashlib.sha256(train_tokenizer(512).backend_tokenizer.to_str().encode())"
        ".hexdigest())")


def _vocab_hash(tok) -> str:
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def test_the_corpus_is_the_pinned_one_and_an_edited_copy_is_refused(tmp_path):
    texts = corpus_texts()
    assert len(texts) > 20 and 100_000 < sum(map(len, texts)) < 2_000_000
    assert CORPUS_FILE.stat().st_size < 1_000_000
    edited = tmp_path / "corpus.jsonl.gz"
    data = gzip.decompress(CORPUS_FILE.read_bytes()).replace(b"kernel", b"kernal", 1)
    edited.write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match="not the pinned"):
        corpus_texts(edited)


@pytest.mark.full  # trains the tokenizer twice; the pinned corpus: the test above
def test_the_tokenizer_is_the_same_twice_and_in_a_clone_whose_docs_differ(tmp_path):
    from training.models import train_tokenizer

    here = _vocab_hash(train_tokenizer(512))
    assert _vocab_hash(train_tokenizer(512)) == here
    # a copy of the package beside docs, skills and tasks that say something else, with no ../shared, in a
    # fresh process (the BPE trainer's hash maps are seeded per process)
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "training", clone / "training", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("docs/training.md", "skills/SKILL.md", "tasks/notes.md"):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_text("An edit that would have moved every merge: " + "zyxw " * 5000)
    env = {**os.environ, "PYTHONPATH": str(clone)}
    r = subprocess.run([sys.executable, "-c", HASH], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    module, there = r.stdout.split()
    assert Path(module).resolve().is_relative_to(clone.resolve())  # the clone's code ran, not this checkout's
    assert there == here
    # control: the same texts read from files give the same tokenizer, and with the clone's docs edit among
    # them (what training on the live repository did) another one
    files = []
    for i, text in enumerate(corpus_texts()):
        files.append(tmp_path / "texts" / f"{i:04d}.txt")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_text(text)
    assert _vocab_hash(train_tokenizer(512, files=files)) == here
    assert _vocab_hash(train_tokenizer(512, files=[*files, clone / "docs" / "training.md"])) != here
