"""Which credential change breaks CUDA IPC between two root processes: a real uid of each one's own, the capabilities
RLIMIT_NPROC asks to drop, or both (issue 69 item 2, on a GPU host).

On the H200 host (a cgroup v2 leaf: no pids group can be had) the judge's CPU-only thread bound, a real uid of the
process's own with CAP_SYS_RESOURCE, CAP_SYS_ADMIN, CAP_SETUID and CAP_SETPCAP dropped (sandbox/confinement/nproc.py),
made every CUDA verify fail "mapping of buffer object failed" when the reference opened the candidate's outputs. This
runs an exporter and an importer (spawned, each changing its credentials first, while it has one thread) that pass one
CUDA tensor through torch's IPC, in each mode:

    same       both keep root (the control)
    uids       each takes a real uid of its own; capabilities kept
    caps       both keep real uid 0; the capabilities dropped
    shared     both take one real uid (a judgment's), capabilities dropped: the design that would bound CUDA workers
    both       each a real uid of its own, capabilities dropped (what failed)
    shared_late  as shared, but each process opens CUDA first (a pooled worker's device is open before its role)
    exporter_uid / importer_uid  only that side takes a uid of its own (capabilities dropped); the other keeps root
    *_dumpable the mode, then PR_SET_DUMPABLE 1: a credential change that drops capabilities makes the kernel mark
               the process undumpable, which ptrace-style access checks (the driver's, pidfd_getfd) then refuse

    python -m bench.ipc_uid_probe --out /tmp/ipc_uid.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
import traceback

MODES = ("same", "uids", "caps", "shared", "both", "caps_dumpable", "both_dumpable", "shared_late", "exporter_uid",
         "importer_uid")


def _credentials(mode: str, offset: int) -> None:
    from sandbox.confinement import nproc

    if mode == "shared_late":
        import torch

        torch.ones(1, device="cuda").sum().item()
        mode = "shared"
    elif mode in ("exporter_uid", "importer_uid"):
        mode = "both" if (offset == 0) == (mode == "exporter_uid") else "same"
    mode, dumpable = mode.removesuffix("_dumpable"), mode.endswith("_dumpable")
    if mode in ("uids", "both"):
        os.setresuid(nproc.BASE + 1000 + offset, -1, -1)
    elif mode == "shared":
        os.setresuid(nproc.BASE + 999, -1, -1)
    if mode in ("caps", "shared", "both"):
        nproc._drop_caps(ctypes.CDLL(None, use_errno=True), nproc.DROPPED)
    if dumpable:
        ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE


def _export(mode: str, q, done) -> None:
    _credentials(mode, 0)
    import torch

    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    q.put(t)
    done.wait(120)


def _import(mode: str, q, out) -> None:
    _credentials(mode, 1)
    try:
        t = q.get(timeout=120)
        dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        out.put({"ok": True, "sum": float(t.sum()), "uid": os.getresuid(), "dumpable": dumpable})
    except Exception as e:  # noqa: BLE001  (the failure is the measurement)
        out.put({"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-1500:],
                 "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)})


def probe(mode: str) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    t0 = time.perf_counter()
    exporter = ctx.Process(target=_export, args=(mode, q, done))
    importer = ctx.Process(target=_import, args=(mode, q, out))
    exporter.start()
    importer.start()
    import queue

    result, deadline = None, time.monotonic() + 90
    while result is None and time.monotonic() < deadline:
        try:
            result = out.get(timeout=1)
        except queue.Empty:
            if not exporter.is_alive() and exporter.exitcode:  # it died before sharing: no answer will come
                result = {"ok": False, "error": f"the exporter died (exit {exporter.exitcode})"}
    result = result or {"ok": False, "error": "no answer in 90 s"}
    done.set()
    for p in (importer, exporter):
        p.join(30)
        if p.is_alive():
            p.kill()
    return {"mode": mode, "seconds": time.perf_counter() - t0, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the modes change real uids and drop root's capabilities")
    rows = []
    for mode in a.modes.split(","):
        row = probe(mode)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
