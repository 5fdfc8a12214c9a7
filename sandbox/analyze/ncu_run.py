"""Starting the analysed process: under `ncu` (or alone, for the torch profiler's table), confined, bounded in time.

The process is sandbox.analyze.target, which confines itself before it loads any code a client wrote; its
environment is a worker's (scrubbed, its scratch directory, the resource limits). ncu itself is NVIDIA's program
and runs code of no client: it is the judge's, like the compilers' launcher. ncu and its target leave the network
together (sandbox.analyze.netns): a target that left on its own could no longer be reached by ncu.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sandbox.analyze import ncu_csv, netns
from sandbox.analyze.target import OPENED
from sandbox.confinement import pidgroup
from sandbox.confinement.environment import exchange_base, exchange_dir, worker_env
from sandbox.confinement.limits import ResourceLimits
from sandbox.confinement.proctree import kill_tree

NCU_ENV = "CUDA_AGENT_NCU"  # the ncu to run; "off": as if none were installed
NETNS_ENV = netns.NETNS_ENV
UNDER_NCU_ENV = "CUDA_AGENT_ANALYZE_NCU"  # launcher (default: sandbox.analyze.netns), target (the target's own: ncu hangs), none

# bounded: each section costs replay passes of every profiled kernel
SECTIONS = ("SpeedOfLight", "SpeedOfLight_RooflineChart", "Occupancy", "LaunchStats", "WarpStateStats")
METRICS = (
    "gpu__time_duration.sum", "dram__bytes.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "dram__bytes.sum.per_second", "dram__bytes.sum.peak_sustained", "dram__cycles_elapsed.avg.per_second",
    "sm__cycles_elapsed.avg.per_second", "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct",
    "smsp__sass_average_data_bytes_per_sector_mem_global_op_st.pct",
    *(f"sm__sass_thread_inst_executed_op_{p}{op}_pred_on.sum" for p in "fhd" for op in ("fma", "add", "mul")),
    *(f"sm__sass_thread_inst_executed_op_{p}fma_pred_on.sum.peak_sustained" for p in "fhd"),
)
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: the target launches it between eager's forward and the candidate's


def find_ncu() -> str | None:
    """ncu's path: $CUDA_AGENT_NCU, PATH, or CUDA's and Nsight Compute's usual folders; None where absent."""
    env = os.environ.get(NCU_ENV, "").strip()
    if env.lower() in ("off", "none", "0"):
        return None
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        for path in sorted(glob.glob(pattern), reverse=True):
            if os.access(path, os.X_OK):
                return path
    return None


@lru_cache(maxsize=4)
def ncu_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ncu_csv.version(out)


def ncu_args(ncu: str, log: str, max_kernels: int, replay_mode: str) -> list[str]:
    args = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--log-file", log, "--profile-from-start", "off",
            "--launch-count", str(max_kernels), "--replay-mode", replay_mode,
            # clocks as they are: ncu's default locks them to base, which would move a timing running meanwhile
            # on this device (none does: the analysis holds the device's lock shared) and after it
            "--clock-control", "none", "--cache-control", "all", "--target-processes", "application-only"]
    for s in SECTIONS:
        args += ["--section", s]
    return args + ["--metrics", ",".join(METRICS)]


@dataclass
class Run:
    reply: dict | None  # the target's reply file, None where it wrote none
    ncu_text: str  # ncu's log (the CSV table and its ==PROF== lines); "" without ncu
    output: str  # the target's stdout and stderr (ncu's too, where ncu ran)
    seconds: float
    timed_out: bool
    stalled: bool = False  # given up before the target's device opened (ncu could not reach it)


def _wait(proc: subprocess.Popen, opened: Path, timeout_s: float, attach_s: float) -> str | None:
    """Until the process ends (None), or the reason it was given up: "opening" (no device opened within attach_s:
    under ncu, a target its profiler cannot reach hangs there), "timeout"."""
    t0 = time.monotonic()
    while True:
        try:
            proc.wait(timeout=0.2)
            return None
        except subprocess.TimeoutExpired:
            pass
        waited = time.monotonic() - t0
        if waited > timeout_s:
            return "timeout"
        if waited > attach_s and not opened.exists():
            return "opening"


def launch(request: dict, ncu: str | None, timeout_s: float, max_kernels: int = 48,
           replay_mode: str = "kernel", attach_s: float = 60.0) -> Run:
    """Run the target on `request` (task, extension, model_new, device, seed, mode), under ncu when given."""
    session = exchange_dir()
    # ncu's table is written where the analysed process cannot write (its writes: its scratch and the exchange area)
    private = Path(tempfile.mkdtemp(prefix="cuda-agent-ncu-"))
    try:
        scratch = tempfile.mkdtemp(prefix="scratch-", dir=session)
        req = dict(request, out=os.path.join(scratch, "reply.json"), shm_dir=str(session))
        req_path = Path(scratch) / "request.json"  # the scratch folder stays visible to a worker whose /dev/shm is its own
        req_path.write_text(json.dumps(req))
        env = dict(worker_env(), CUDA_AGENT_SCRATCH=scratch, CUDA_AGENT_EXCHANGE_BASE=exchange_base(),
                   CUDA_AGENT_LIMITS=ResourceLimits.from_env().to_env())
        # without ncu the target leaves the network itself, as a worker does
        where = os.environ.get(NETNS_ENV, netns.JOINED) if ncu else "target"
        env[NETNS_ENV] = where
        env[UNDER_NCU_ENV] = "1" if ncu else ""  # the target keeps root's CAP_SYS_ADMIN for ncu's counters
        env[pidgroup.DEVICE_ENV] = "cuda" if str(request.get("device", "")).startswith("cuda") else "cpu"
        cmd = [sys.executable, "-P", "-m", "sandbox.analyze.target", str(req_path)]
        log = private / "ncu.csv"
        if ncu:
            cmd = ncu_args(ncu, str(log), max_kernels, replay_mode) + cmd
            if where == netns.JOINED:
                cmd = [sys.executable, "-P", "-m", "sandbox.analyze.netns", *cmd]
        out_path = session / "output.log"
        t0 = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=session, start_new_session=True)
            try:
                stalled = _wait(proc, Path(scratch) / OPENED, timeout_s, attach_s if ncu else timeout_s)
                timed_out = stalled is not None
            finally:
                kill_tree(proc.pid)
                proc.wait()
        seconds = time.perf_counter() - t0
        reply_file = Path(req["out"])
        reply = json.loads(reply_file.read_text()) if reply_file.is_file() else None
        return Run(reply=reply, ncu_text=log.read_text(errors="replace") if log.is_file() else "",
                   output=out_path.read_text(errors="replace")[-8000:], seconds=seconds, timed_out=timed_out,
                   stalled=stalled == "opening")
    finally:
        shutil.rmtree(session, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
