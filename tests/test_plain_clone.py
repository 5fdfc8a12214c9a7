"""The README's test command passes in a plain clone: the KernelBench-dependent test files, run from a copy of
the repository with nothing beside it (no ../shared), CUDA_AGENT_KERNELBENCH unset and an empty cache, pass.
There they use the small tree (tests/fixtures/kernelbench); checks on the real 250 problems skip, saying so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_REAL_KERNELBENCH, PLAIN_CHECKOUT, REPO

# the test files that load, list or decontaminate against KernelBench (the one list of them)
KERNELBENCH_DEPENDENT = [
    "tests/test_cli.py",
    "tests/test_decontam.py",
    "tests/test_gpu.py",
    "tests/test_harness_gpu.py",
    "tests/test_harness_units.py",
    "tests/test_kernelbench_download.py",
    "tests/test_synth.py",
    "tests/test_synth_set.py",
    "tests/test_tasks.py",
]
# files that name KernelBench ids without loading any
NAMES_ONLY = {"tests/test_harness_report.py": "made-up records of kernelbench/levelN ids",
              "tests/test_synth_ship.py": "a made-up decontamination record naming a kernelbench/levelN id",
              "tests/test_synth_shipped.py": "the shipped set's rows name their nearest kernelbench/levelN problem"}
USES_KERNELBENCH = re.compile(r"kernelbench[/:]level|kernelbench_root|(small|real|any)_kernelbench|kernelbench_tree")


def _test_files() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))


def test_every_kernelbench_dependent_file_is_listed():
    here = Path(__file__).relative_to(REPO).as_posix()
    found = {f for f in _test_files() if f != here and USES_KERNELBENCH.search((REPO / f).read_text())}
    assert found - set(NAMES_ONLY) == set(KERNELBENCH_DEPENDENT), "update KERNELBENCH_DEPENDENT or NAMES_ONLY"


def _repository_files() -> list[str]:
    """What a clone would hold once committed: tracked files and untracked ones git does not ignore."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell the repository's files from the rest")
    r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout (an sdist?): no clone to make ({r.stderr.strip()})")
    # a KernelBench inside the checkout (the loader's <repo>/shared/kernelbench) is no part of a clone
    return [f for f in r.stdout.split("\0") if f and not f.startswith("shared/") and (REPO / f).is_file()]


@pytest.mark.skipif(PLAIN_CHECKOUT, reason="this run is itself in a plain checkout (it finds no KernelBench): the "
                    "KernelBench-dependent files already run here as they would in a clone")
@pytest.mark.full  # runs the KernelBench-dependent test files again in a copy of the repository (CI's clone is plain: there it skips)
def test_kernelbench_dependent_tests_pass_in_a_plain_clone(tmp_path):
    clone = tmp_path / "plain" / "cuda-agent"
    for f in _repository_files():
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, clone / f)
    assert not (clone.parent / "shared").exists() and not (clone / "shared").exists()
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_AGENT_KERNELBENCH", "CUDA_AGENT_TEST_CACHE", "PYTHONPATH")}
    env |= {"CUDA_AGENT_CACHE": str(cache), "PYTHONPATH": str(clone)}  # the clone's code, not this checkout's

    probe = subprocess.run([sys.executable, "-c", "import tasks; print(tasks.__file__, tasks.kernelbench_root())"],
                           capture_output=True, text=True, cwd=clone, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    code, root = probe.stdout.split()
    assert Path(code).is_relative_to(clone), probe.stdout
    assert not Path(root).exists(), f"the clone still finds a KernelBench at {root}"

    # slow tests are left out unless they use KernelBench (the synth build decontaminates against it)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
           "-m", "kernelbench or not slow", *KERNELBENCH_DEPENDENT]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=clone, env=env, timeout=1500)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert re.search(r"\d+ passed", tail) and not re.search(r"\d+ (failed|errors?)\b", tail), tail
    assert NO_REAL_KERNELBENCH in tail, tail  # the real suite was nowhere to be found, and the skips say so
