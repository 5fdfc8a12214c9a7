"""The process an analysis runs: `python -P -m sandbox.analyze.target REQUEST.json`, started by `ncu` (or, for the
torch profiler's table, by the judge itself). It runs candidate code, so it is confined as the candidate role is,
in the same order: the network and Landlock's first stage before torch is imported, the second stage and the
resource limits before the task's or the candidate's code is loaded (sandbox.worker.candidate.CandidateRole.setup,
reused whole). ncu injects its library into this process when it starts it, before any of that: the library is
NVIDIA's, the judge's, and it is loaded before any code a client wrote.

The eager reference's forward runs first, before any candidate code is loaded (CandidateRole's before_candidate
hook), then one marker kernel (torch.cuda._sleep: ATen's spin_kernel), then the candidate's forward: in ncu's
list, the kernels before the first marker are eager's and those after it the candidate's, and no candidate code has
run before the marker. Each forward runs warm-up calls outside the profiled range first (cudaProfilerStart/Stop:
ncu runs with --profile-from-start off), so lazy initialisation is not what ncu measures.

Standard library only above the confinement's first stage; the reply is a JSON file in the scratch directory.
"""

from __future__ import annotations

import json
import os
import sys
import time

# the first stage, before torch: no network, writes to scratch only. Under ncu the network was left already, by
# ncu and this process together (sandbox.analyze.netns); alone, this process leaves it as a worker does
_NETNS = os.environ.get("CUDA_AGENT_ANALYZE_NETNS", "target")


def _leave_network() -> bool:
    if _NETNS == "launcher":
        return True
    if os.environ.get("CUDA_AGENT_NO_NETNS") or _NETNS != "target":
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0  # CLONE_NEWNET
    except (OSError, AttributeError):
        return False


if __name__ == "__main__":
    from sandbox.confinement import filesystem, limits, pidgroup  # standard library only

    _THREADS = limits.ResourceLimits.from_env().threads
    pidgroup.join(_THREADS)  # one thread, /sys still open: a cgroup pids group where the host offers one
    _ISOLATED = _leave_network()
    _APPLIED = filesystem.at_worker_start("candidate")
    # else RLIMIT_NPROC under a uid of its own, but not under ncu: GPU counters need root's CAP_SYS_ADMIN
    pidgroup.bind_rest(_THREADS, keep_admin=bool(os.environ.get("CUDA_AGENT_ANALYZE_NCU")))  # CPU only: DEVICE_ENV
else:  # imported (tests read its constants): nothing applied
    _ISOLATED, _APPLIED = False, None

FORWARD_ROW = "forward (whole call)"
OPENED = "opened"  # the file the target writes beside its reply once its device is open
PROFILED_CALLS = 1  # forwards inside the profiled range, per side
WARMUP_CALLS = 2


def _reply(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def main(request_path: str) -> int:
    with open(request_path) as fh:
        req = json.load(fh)
    out_path = req["out"]
    t0 = time.perf_counter()
    try:
        data = _run(req)
    except BaseException as e:  # noqa: BLE001  (the judge reads why from the reply, whatever the candidate raised)
        reason = getattr(e, "reason", None) or "runtime_error"
        message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        _reply(out_path, {"ok": False, "reason": reason, "message": str(message)[-4000:],
                          "seconds": time.perf_counter() - t0})
        return 1
    data.update(ok=True, seconds=time.perf_counter() - t0)
    _reply(out_path, data)
    return 0


def _run(req: dict) -> dict:
    from sandbox.worker import startup  # imports torch

    startup.CONFINEMENT.update(applied=_APPLIED, notes=[], limits=[], second_stage=False)
    startup._NETWORK_ISOLATED = _ISOLATED
    import torch

    from sandbox.worker.candidate import CandidateRole
    from sandbox.worker.inputs import make_inputs

    mode = req["mode"]  # "ncu": profiled ranges for ncu; "torch": torch.profiler's table
    startup.open_device(req["device"])  # where ncu's library could not reach ncu, this is where the process hangs
    with open(os.path.join(os.path.dirname(req["out"]), OPENED), "w"):
        pass  # the judge's sign that the device opened (ncu_run.launch gives up sooner without it)
    sides: dict = {}
    role = CandidateRole()

    def forward(model, inputs, n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                model(*inputs)
        startup.synchronize(role.device)

    def profiled(name: str, model, inputs) -> None:
        forward(model, inputs, WARMUP_CALLS)
        if mode == "ncu":
            if role.device.type == "cuda":
                torch.cuda.profiler.start()
                if name == "candidate":
                    torch.cuda._sleep(1)  # the marker: every kernel after it is the candidate's
                forward(model, inputs, PROFILED_CALLS)
                torch.cuda.profiler.stop()
            return
        sides[name] = _torch_table(model, inputs, role.device, req.get("rows", 10))

    def eager(r: CandidateRole) -> None:
        inputs = make_inputs(r.mod, req["seed"], r.device)
        profiled("eager", r.reference, inputs)

    times = role.setup(task=req["task"], device=req["device"], init_seed=req["seed"], extension=req["extension"],
                       model_new=req["model_new"], shm_dir=req["shm_dir"], record_ops=False,
                       before_candidate=eager if req.get("eager", True) else None)
    inputs = make_inputs(role.mod, req["seed"], role.device)
    profiled("candidate", role.model, inputs)
    return {"sides": sides, "device_name": startup.device_name(role.device), "confinement": times.get("confinement"),
            "confinement_notes": times.get("confinement_notes", []), "limits": times.get("limits", []),
            "network_isolated": startup._NETWORK_ISOLATED, "torch": torch.__version__}


def _torch_table(model, inputs, device, rows: int) -> list[dict]:
    """torch.profiler's kernel table of one forward: the fallback where ncu cannot run (no ncu, no counter
    permission, the CPU backend)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, torch.no_grad():
        with record_function(FORWARD_ROW):
            model(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = []
    for ev in prof.key_averages():
        if ev.key == FORWARD_ROW:  # the whole call: on the CPU an extension's own work shows only here
            table.append({"name": ev.key, "total_us": float(ev.cpu_time_total), "calls": int(ev.count)})
            continue
        dev_us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if device.type == "cuda":
            if dev_us and not ev.key.startswith(("cuda", "Memcpy", "Memset")):
                table.append({"name": ev.key, "total_us": float(dev_us), "calls": int(ev.count)})
        elif ev.self_cpu_time_total > 0 and not ev.key.startswith("["):
            table.append({"name": ev.key, "total_us": float(ev.self_cpu_time_total), "calls": int(ev.count)})
    table.sort(key=lambda r: (r["name"] != FORWARD_ROW, -r["total_us"]))
    return table[:rows]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
