"""GPU memory as a scheduled resource: a judgment is admitted on a device only while the footprints admitted there fit.

Why: the device lock (device_lock.py) lets verifies and set-ups run side by side, and on an H200 eight judgments at a
time of KernelBench's published sizes (6.4 GB an input) ran out of memory in 13 of 16 verifies (issue 65): each
process's allocations were fine alone, the device was not big enough for all of them. So each judgment declares its
footprint (the task's, measured once per task and device, kept beside the baselines) and waits until it fits.

The ledger is host-wide, like the device lock: a JSON file per device in the lock folder, read and rewritten under
flock(2), one entry per judgment (pid, its start time, bytes, waiting or admitted). Entries of dead processes are
dropped on every read, so a judge killed mid-judgment frees its share. Waiting never holds the flock: a waiter polls
with backoff. Waiters are admitted in arrival order (a large footprint is not starved by a stream of small ones),
and a footprint at least as large as the device runs once nothing else is admitted (alone, never a deadlock).

Order with the device lock: admission outer, device lock inner, everywhere, so that no judgment holds the lock while
it waits for memory that a lock-waiter holds. Re-entrant per thread and device: a judgment's verify and profile (and
a profile's baseline) run under the judgment's one admission.

On the CPU nothing is admitted unless CUDA_AGENT_MEMORY_BUDGET gives a budget (then "cpu" is a device of that many
bytes: the tests' scripted memory); on CUDA the budget is the device's total (a probe's mem_get_info) less HEADROOM,
or CUDA_AGENT_MEMORY_BUDGET where set; CUDA_AGENT_MEMORY_ADMISSION=0 turns admission off.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sandbox.config import cache_dir
from sandbox.timing.device_lock import _open_shared, device_key, lock_dir

BUDGET_ENV = "CUDA_AGENT_MEMORY_BUDGET"
SWITCH_ENV = "CUDA_AGENT_MEMORY_ADMISSION"
HEADROOM = 0.08  # of the device's total, never admitted: the driver's own, fragmentation, processes outside the judge
CONTEXT_BYTES = 600 << 20  # a CUDA context and its libraries per process, which no allocator statistic shows
AHEAD_BYTES = 4 << 30  # what the timer may draw ahead (sandbox/worker/batches.py PREPARE_BUDGET_BYTES on CUDA)
SPOT_BYTES = 2 << 30  # spot copies on the device (ProfileConfig.spot_device_bytes' default)
SMALL_BYTES = 512 << 20  # of each, what a small task may always use (the CPU's PREPARE_BUDGET_BYTES)
FOOTPRINT_VERSION = 2  # 2: allowances of at least one input set and one output copy
# a task's footprint before its first judgment has measured it: a third of the device. The whole device made every
# new task's first judgment wait for all admitted ones and everything behind it wait for that (a stream of new tasks,
# as in RL over a synthesized set, judged one at a time); the largest footprint at KernelBench's published sizes
# (level 1's 6.4 GB inputs: about 33 GB by footprint_of on a 128 GB H200 budget) fits a third. A task that needs more
# before it is measured runs out of memory beside the others and is run again alone (sandbox/correctness/oom.py).
UNKNOWN_SHARE = 3

_held = threading.local()  # device -> Admission of this thread (re-entrancy)
_capacity: dict[str, int | None] = {}


class AdmissionError(Exception):
    """The ledger could not be read or written (the lock folder's file)."""


def _parse_bytes(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
    return int(float(text.rstrip("kmgtib") if scale > 1 else text) * scale)


def capacity(device: str) -> int | None:
    """Bytes the judgments on `device` may hold together, or None: no admission there."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    if (budget := os.environ.get(BUDGET_ENV)):
        return _parse_bytes(budget)
    if not device.startswith("cuda"):
        return None
    key = device_key(device)
    if key not in _capacity:
        try:
            _capacity[key] = int(probe_total(device) * (1 - HEADROOM))
        except (AdmissionError, OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            # no probe, no admission: judgments run as before the ledger (the OOM rules still settle a failure)
            _capacity[key] = None
    return _capacity[key]


def probe_total(device: str) -> int:
    """The device's total memory, from torch.cuda.mem_get_info in a probe process (this process may never have
    opened the device: the judge does not import torch), cached host-wide in the lock folder."""
    path = lock_dir() / f"{device_key(device)}.total"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        pass
    index = int(device.partition(":")[2] or 0)
    code = f"import torch; print(torch.cuda.mem_get_info({index})[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0:
        raise AdmissionError(f"probing {device}'s memory failed: {out.stderr[-1000:]}")
    total = int(out.stdout.split()[-1])
    try:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(total))
        os.replace(tmp, path)
    except OSError:
        pass
    return total


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/pid/stat): a pid reused by another process is not the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _alive(entry: dict) -> bool:
    try:
        os.kill(entry["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's judge
        pass
    start = _start_time(entry["pid"])
    return start is None or entry.get("start") in (None, start)


class Ledger:
    """The device's entries, each change made under the file's flock and written back before it is let go."""

    def __init__(self, device: str):
        self.path = lock_dir() / f"{device_key(device)}.memory"

    @contextmanager
    def open(self) -> Iterator[dict]:
        try:
            fd = _open_shared(self.path)
        except OSError as e:
            raise AdmissionError(f"the memory ledger {self.path}: {e}") from e
        with os.fdopen(fd, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                raw = fh.read()
                try:
                    data = json.loads(raw) if raw.strip() else {}
                except ValueError:  # a writer killed mid-write: its entries are lost, the live re-register on poll
                    data = {}
                data.setdefault("entries", [])
                data.setdefault("next_ticket", 0)
                data["entries"] = [e for e in data["entries"] if _alive(e)]
                yield data
                fh.seek(0)
                fh.truncate()
                fh.write(json.dumps(data).encode())
                fh.flush()
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def entries(self) -> list[dict]:
        with self.open() as data:
            return list(data["entries"])


class Admission:
    """One judgment's place in a device's ledger: `waited_s` (seconds queued), `bytes` (what it holds)."""

    def __init__(self, device: str, footprint: int, cap: int):
        self.device, self.bytes, self.capacity = device, int(footprint), cap
        self.id, self.waited_s, self.ledger = uuid.uuid4().hex, 0.0, Ledger(device)
        self.handed = False  # its release left to a session (hand_to)

    def _entry(self, data: dict) -> dict | None:
        return next((e for e in data["entries"] if e["id"] == self.id), None)

    def _try(self) -> bool:
        with self.ledger.open() as data:
            mine = self._entry(data)
            if mine is None:  # first poll, or the file was lost: (re)register at the back of the queue
                mine = {"id": self.id, "pid": os.getpid(), "start": _start_time(os.getpid()), "bytes": self.bytes,
                        "state": "waiting", "ticket": data["next_ticket"]}
                data["next_ticket"] += 1
                data["entries"].append(mine)
            admitted = [e for e in data["entries"] if e["state"] == "admitted"]
            ahead = [e for e in data["entries"] if e["state"] == "waiting" and e["ticket"] < mine["ticket"]]
            used = sum(e["bytes"] for e in admitted)
            # alone when nothing else is admitted, whatever its size: a footprint past the device never deadlocks
            if not ahead and (not admitted or used + self.bytes <= self.capacity):
                mine["state"] = "admitted"
                return True
            return False

    def wait(self) -> None:
        t0, pause = time.perf_counter(), 0.005
        while not self._try():
            time.sleep(pause)  # the flock let go meanwhile: the holders leave, and others register
            pause = min(pause * 1.5, 0.2)
        self.waited_s = time.perf_counter() - t0

    def resize(self, footprint: int) -> None:
        """Hold `footprint` bytes from now: a judgment that took the device alone for a task of unknown footprint
        shrinks to what it measured, and the judgments waiting behind it may be admitted at once."""
        with self.ledger.open() as data:
            if (mine := self._entry(data)) is not None:
                mine["bytes"] = self.bytes = int(footprint)

    def release(self) -> None:
        with self.ledger.open() as data:
            data["entries"] = [e for e in data["entries"] if e["id"] != self.id]

    @contextmanager
    def _until_exit(self) -> Iterator[None]:
        self.handed = True
        try:
            yield
        finally:
            self.release()


def hand_to(session, device: str) -> None:
    """This thread's admission on `device`, if any, let go with `session`'s holds (processes.Session.hold: once its
    workers are gone, in the background) rather than when the judgment returns: a dying process's memory is still in
    use. The session's device lock, held the same way and entered later, goes first."""
    adm = current(device)
    if adm is not None and not adm.handed:
        session.hold(adm._until_exit())


def take_whole(session, device: str) -> float:
    """The whole device's memory for an out-of-memory failure's second run (correctness/oom.py: "alone"), held with
    `session`'s workers like the device lock; the seconds waited for it. It waits until nothing else is admitted and,
    like a footprint past the device, is never admitted beside anything. The first run's admission was let go with
    that run's workers, so without this the second run would hold none: alone by the device lock, not by memory."""
    cap = capacity(device)
    if cap is None:
        return 0.0
    adm = Admission(device, cap, cap)
    adm.wait()
    session.hold(adm._until_exit())
    return adm.waited_s


def current(device: str) -> Admission | None:
    """This thread's admission on `device`, if it holds one."""
    return getattr(_held, "by_device", {}).get(device_key(device))


@contextmanager
def admitted(device: str, footprint: int | None) -> Iterator[Admission | None]:
    """Waits until `footprint` bytes fit on `device` beside the judgments admitted there (None: not known, a third of
    the device until measured: UNKNOWN_SHARE), holds them, and lets them go on exit. Yields the Admission (its waited_s), or None where the device is not
    admitted (the CPU without a budget) or this thread holds it already (the outer admission covers the inner)."""
    cap = capacity(device)
    key = device_key(device)
    held = _held.__dict__.setdefault("by_device", {})
    if cap is None or key in held:
        yield None
        return
    adm = Admission(device, cap // UNKNOWN_SHARE if footprint is None else footprint, cap)
    try:
        adm.wait()
        held[key] = adm
        yield adm
    finally:
        held.pop(key, None)  # this thread may be admitted again at once; the entry may outlive it (hand_to)
        if not adm.handed:
            adm.release()


def waited(adm: Admission | None) -> float:
    return adm.waited_s if adm is not None else 0.0


# --- footprints, measured once per task and device and kept beside the baselines ---

def _footprint_file(task_sha: str, backend: str) -> Path:
    from sandbox.build.toolchain import get_toolchain

    tc = get_toolchain(backend)
    parts = [task_sha, backend, tc.device_name or backend, tc.torch_version, str(FOOTPRINT_VERSION)]
    return cache_dir() / "baselines" / "footprints" / f"{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:24]}.json"


def record(task_sha: str, backend: str) -> dict | None:
    """The task's footprint record on this kind of device (bytes, peak_bytes, input_bytes, output_bytes), or None."""
    try:
        rec = json.loads(_footprint_file(task_sha, backend).read_text())
        int(rec["bytes"])
        return rec
    except (OSError, ValueError, KeyError, TypeError):
        return None


def known_footprint(task_sha: str, backend: str, device: str) -> int | None:
    """The task's footprint on this kind of device, where measured (None: not yet, or no admission on `device`)."""
    if capacity(device) is None:
        return None
    rec = record(task_sha, backend)
    return None if rec is None else int(rec["bytes"])


def footprint_of(peak: int, input_bytes: int, output_bytes: int, cuda: bool) -> int:
    """A judgment's device bytes from the reference's first input set: the reference's process at its peak, the
    candidate's assumed as large (its own inputs, outputs and workspace), what the timer draws ahead and the spot copies
    it keeps (both bounded by allowance()), and each process's context (three: the task's, the candidate's, a baseline's)."""
    ahead, spots = allowance(input_bytes, output_bytes)
    return 2 * peak + ahead + spots + (3 * CONTEXT_BYTES if cuda else 0)


def allowance(input_bytes: int, output_bytes: int) -> tuple[int, int]:
    """Of the footprint, the bytes of inputs the timer may draw ahead and of spot copies it may keep on the device: a
    small task keeps SMALL_BYTES of each (its stream batches draw hundreds of sets ahead: four sets made batches of four
    calls, too short for the judge's clock, and honest kernels were failed timing_unverified), a large one four sets
    and four copies, neither past the timer's own budgets, and never less than one set and one copy: a set too large to
    draw ahead is drawn beside the one a call holds (the synced loop), and a copy that found no room on the device went
    through pageable host memory, 4.3 s of a 6.4 GB output's 15 s judgment on an H200 (KernelBench's 25_Swish,
    2026-12-03), where the allowance of 2 GiB held nothing at all."""
    ahead = max(min(AHEAD_BYTES, max(4 * input_bytes, SMALL_BYTES)), input_bytes)
    return ahead, max(min(SPOT_BYTES, max(4 * output_bytes, SMALL_BYTES)), output_bytes)


def measured(device: str, task_sha: str, backend: str, reply: dict) -> None:
    """The reference's first input set measured (its reply's peak_bytes, input_bytes, output_bytes): the footprint is
    kept for the task, and this thread's admission shrinks (or grows) to it."""
    if capacity(device) is None or "peak_bytes" not in reply:
        return
    fp = footprint_of(int(reply["peak_bytes"]), int(reply.get("input_bytes", 0)), int(reply.get("output_bytes", 0)),
                      device.startswith("cuda"))
    path = _footprint_file(task_sha, backend)
    if known_footprint(task_sha, backend, device) is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps({"bytes": fp, "peak_bytes": reply["peak_bytes"], "created": time.time(),
                                   "input_bytes": reply.get("input_bytes"), "output_bytes": reply.get("output_bytes")}))
        os.replace(tmp, path)
    if (adm := current(device)) is not None and adm.bytes != fp:
        adm.resize(fp)
