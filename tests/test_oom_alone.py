"""Out of memory under load (issue 65, item 2; sandbox/correctness/oom.py), on the CPU backend with scripted memory:
a fake device whose forward raises torch.OutOfMemoryError("CUDA out of memory ...") while a host-wide counter file
says another judgment holds the device, or when a call asks for more than a budget. Real judgments through
sandbox.api: an OOM under contention is verified again alone and scored; an OOM alone fails `oom` with both peaks;
the task's own OOM (verify's reference, profile's eager) is never the candidate's -1."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import model_new_calling
from sandbox.correctness import oom
from sandbox.results import Reason
from sandbox.timing.device_lock import LOCK_DIR_ENV, device_key, device_lock, lock_dir

# the fake device: the counter file beside the built extension counts the other judgments holding it; past 0, or past
# a budget a call, an allocation fails as CUDA's does. Beside the extension, not beside model_new.py: the confined
# candidate reads model_new.py itself and the extension's folder, not the rest of its workspace (a read of a file
# beside model_new.py is refused, and the forward failed runtime_error, never oom, so nothing was run again alone)
FAKE_DEVICE = """\
from pathlib import Path
others = Path(cuda_extension.__file__).parent / "others"
if others.is_file() and int(others.read_text() or "0") > 0:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB (the fake device: "
                                 + others.read_text() + " other judgment(s) hold it)")
if x.numel() * x.element_size() > BUDGET:
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.numel() * x.element_size()} bytes "
                                 "past the fake device's budget of " + str(BUDGET))
return cuda_extension.correct(x, self.bias)
"""

# a task whose own forward runs out of memory in one process past `calls` calls: the candidate's process runs it
# once or twice (its canary, before any candidate code); verify's reference once an input set; eager's timing often
TASK_OOM = """\
import torch
import torch.nn as nn

CALLS = [0]


class Model(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] > {calls}:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB (the task's own, call "
                                         + str(CALLS[0]) + ")")
        return torch.nn.functional.silu(x) + self.bias


def get_inputs():
    return [torch.randn(64, 256)]


def get_init_inputs():
    return [256]
"""


def judged(ws):
    """sandbox.api.evaluate with the static scan off: the fake device reads its counter file (pathlib, __file__),
    which the scan refuses in a candidate's model_new.py; nothing here is about the scan."""
    from sandbox.api import evaluate
    from sandbox.config import ProfileConfig, VerifyConfig

    return evaluate(ws, verify=VerifyConfig(static_checks=False), profile=ProfileConfig(static_checks=False))


@pytest.fixture(autouse=True)
def own_locks(tmp_path, monkeypatch):
    """This test's device locks: no other judge of this host (another test run) is waited for or counted."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))


def fake_device_candidate(ws, budget: int = 1 << 20) -> Path:
    from sandbox.build.compile import extension_path

    (ws.root / "model_new.py").write_text(model_new_calling(FAKE_DEVICE.replace("BUDGET", str(budget))))
    return extension_path(ws).parent / "others"


@contextmanager
def other_judgment(counter: Path, device: str = "cpu"):
    """Another judgment on the device: it holds the device's lock shared and counts itself in `counter` until a
    judgment asks for the device alone (the turnstile held for longer than a reader holds it passing through), then
    leaves, or until the judgment is over. Yields what it saw."""
    seen = {"writer": False}
    entered, over = threading.Event(), threading.Event()

    def run() -> None:
        with device_lock(device, exclusive=False):
            counter.write_text("1")
            entered.set()
            fd = os.open(lock_dir() / f"{device_key(device)}.turnstile", os.O_RDONLY)
            busy_since = None
            try:
                while not over.is_set():
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        busy_since = None
                    except BlockingIOError:
                        busy_since = busy_since or time.monotonic()
                        if time.monotonic() - busy_since > 0.5:
                            seen["writer"] = True
                            break
                    time.sleep(0.05)
            finally:
                os.close(fd)
                counter.write_text("0")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert entered.wait(30)
    try:
        yield seen
    finally:
        over.set()
        t.join(30)


def test_an_oom_under_contention_is_verified_again_alone_and_scored(cpu_ws):
    counter = fake_device_candidate(cpu_ws)
    with other_judgment(counter) as seen:
        c, v, p, r = judged(cpu_ws)
    # the second verify asked for the device alone, and the other judgment left
    assert seen["writer"], (v.reason, v.message, v.phases, v.sandbox_notes)
    assert v.ok, (v.reason, v.message)
    assert v.phases["alone"] == 1.0 and v.phases["oom_shared_attempt"] > 0
    assert any("out of memory beside other judgments' work" in n and "1 other judgment(s) hold it" in n
               for n in v.sandbox_notes), v.sandbox_notes
    assert p is not None and r.milestone != "failed" and r.reward >= 1, (p.reason, p.message)


def test_an_oom_alone_fails_oom_with_both_peaks(cpu_ws):
    fake_device_candidate(cpu_ws, budget=1024)  # the task's 64 x 256 floats are 64 KiB: past the budget
    c, v, p, r = judged(cpu_ws)
    assert v.reason == Reason.oom and p is None
    assert v.phases["alone"] == 1.0  # the first, under the shared lock, was run again alone: bounded, once
    assert "ModelNew's process ran out of memory with the device to itself" in v.message, v.message
    peaks = v.message.partition("Peaks: ")[2]
    assert peaks.startswith("ModelNew's process ") and "; the reference's process " in peaks
    assert peaks.count("resident at most (the CPU backend") == 2 and "unknown" not in peaks.partition(". ")[0]
    assert "past the fake device's budget of 1024" in v.message
    assert (r.reward, r.milestone, r.reason) == (-1, "failed", Reason.oom)


def _task_workspace(tmp_path, built_cpu_workspace, calls: int):
    import shutil

    from sandbox.api import init_workspace

    task = tmp_path / f"oom_after_{calls}.py"
    task.write_text(TASK_OOM.replace("{calls}", str(calls)))
    ws, _ = init_workspace(str(task), tmp_path / "ws", "cpu", check=False)
    for part in ("kernels", "build"):  # the small task's extension, built once for the session
        shutil.copytree(built_cpu_workspace / part, ws.root / part, symlinks=True, dirs_exist_ok=True)
    (ws.root / "model_new.py").write_text(model_new_calling("return cuda_extension.correct(x, self.bias)"))
    return ws


def test_the_references_oom_alone_is_the_tasks_never_the_candidates(tmp_path, built_cpu_workspace):
    """The reference runs out of memory on its third input set, beside ModelNew, alone too, and with no candidate
    process at all: reference_oom, which costs nothing (RewardConfig.unjudged), never -1."""
    c, v, p, r = judged(_task_workspace(tmp_path, built_cpu_workspace, calls=2))
    assert v.reason == Reason.reference_oom and p is None, (v.reason, v.message)
    assert v.message.startswith("the task's reference runs out of memory on this device with no candidate process"), \
        v.message
    assert "alone it failed reference_oom" in v.message and "the task's code ran out of memory" in v.message
    assert (r.reward, r.milestone, r.reason, r.correct) == (0.0, "failed", Reason.reference_oom, False)


def test_the_references_oom_that_fits_alone_is_the_candidates(tmp_path, built_cpu_workspace, monkeypatch):
    """Where the task alone fits (the probe scripted here: the fake task runs out past two calls in any process),
    the reference's OOM beside ModelNew was ModelNew's share: oom."""
    monkeypatch.setattr(oom, "task_alone", lambda task, device, cfg: (True, "alone its peak was 1.0 MiB (scripted)"))
    c, v, p, r = judged(_task_workspace(tmp_path, built_cpu_workspace, calls=2))
    assert v.reason == Reason.oom and "ModelNew's memory left it too little" in v.message, v.message
    assert r.reward == -1


def test_eagers_oom_while_timing_is_never_the_candidates(tmp_path, built_cpu_workspace):
    """The task's process runs out of memory while eager is timed (past 40 calls: verify's reference calls are fewer):
    the profile fails as the reference's, and the candidate keeps `correct`."""
    c, v, p, r = judged(_task_workspace(tmp_path, built_cpu_workspace, calls=40))
    assert v.ok, v.message
    assert p is not None and not p.ok and p.reason in (Reason.reference_error, Reason.reference_oom), p.message
    assert "out of memory" in p.message
    assert (r.reward, r.milestone, r.correct) == (1, "correct", True)


HOG = """\
import torch
import torch.nn as nn

import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # a PiB: more than any device has
        return cuda_extension.swish_bias_forward(x, self.bias)
"""


@pytest.mark.gpu
def test_a_real_cuda_oom_alone_names_both_peaks(tmp_path):
    """On a GPU: a candidate that asks for more than the device has fails `oom` (after its second verify, alone), with
    its process's torch.cuda.max_memory_allocated beside the reference's and the device's free memory; -1."""
    import shutil

    from sandbox.api import compile_workspace, evaluate, init_workspace
    from tasks.loader import EXAMPLES_DIR

    ws, _ = init_workspace("example/swish_bias", tmp_path / "ws", backend="cuda")
    shutil.copytree(EXAMPLES_DIR / "solutions" / "swish_bias" / "cuda", ws.root, dirs_exist_ok=True)
    (ws.root / "model_new.py").write_text(HOG)
    assert compile_workspace(ws).ok
    c, v, p, r = evaluate(ws)
    assert v.reason == Reason.oom and v.phases["alone"] == 1.0, v.message
    peaks = v.message.partition("Peaks: ")[2]
    assert peaks.count("torch.cuda.max_memory_allocated") == 2 and " free of " in peaks, v.message
    assert r.reward == -1
