"""Starting the analysed process: under `ncu` (or alone, for the torch profiler's table), confined, bounded in time.

The process is sandbox.analyze.target, which confines itself before it loads any code a client wrote; its
environment is a worker's (scrubbed, its scratch directory, the resource limits). ncu itself is NVIDIA's program
and runs code of no client: it is the judge's, like the compilers' launcher. Where the target leaves the network
(its own namespace, as every worker does) ncu must still reach it: CUDA_AGENT_ANALYZE_NETNS=launcher starts ncu
and the target together in a namespace of their own, with only a loopback, instead.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sandbox.analyze import ncu_csv
from sandbox.confinement.environment import exchange_base, exchange_dir, worker_env
from sandbox.confinement.limits import ResourceLimits
from sandbox.confinement.proctree import kill_tree

NCU_ENV = "CUDA_AGENT_NCU"  # the ncu to run; "off": as if none were installed
NETNS_ENV = "CUDA_AGENT_ANALYZE_NETNS"  # target (default), launcher, or none

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


def launch(request: dict, ncu: str | None, timeout_s: float, max_kernels: int = 48,
           replay_mode: str = "kernel") -> Run:
    """Run the target on `request` (task, extension, model_new, device, seed, mode), under ncu when given."""
    session = exchange_dir()
    try:
        scratch = tempfile.mkdtemp(prefix="scratch-", dir=session)
        req = dict(request, out=os.path.join(scratch, "reply.json"), shm_dir=str(session))
        req_path = Path(scratch) / "request.json"  # the scratch folder stays visible to a worker whose /dev/shm is its own
        req_path.write_text(json.dumps(req))
        env = dict(worker_env(), CUDA_AGENT_SCRATCH=scratch, CUDA_AGENT_EXCHANGE_BASE=exchange_base(),
                   CUDA_AGENT_LIMITS=ResourceLimits.from_env().to_env())
        netns = os.environ.get(NETNS_ENV, "target")
        env[NETNS_ENV] = netns if ncu else "target"
        cmd = [sys.executable, "-P", "-m", "sandbox.analyze.target", str(req_path)]
        log = session / "ncu.csv"
        if ncu:
            cmd = ncu_args(ncu, str(log), max_kernels, replay_mode) + cmd
        if ncu and netns == "launcher":
            cmd = [sys.executable, "-P", "-m", "sandbox.analyze.ncu_run", *cmd]
        out_path = session / "output.log"
        t0 = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=session, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_tree(proc.pid)
                proc.wait()
        seconds = time.perf_counter() - t0
        reply_file = Path(req["out"])
        reply = json.loads(reply_file.read_text()) if reply_file.is_file() else None
        return Run(reply=reply, ncu_text=log.read_text(errors="replace") if log.is_file() else "",
                   output=out_path.read_text(errors="replace")[-8000:], seconds=seconds, timed_out=timed_out)
    finally:
        shutil.rmtree(session, ignore_errors=True)


def _loopback_up() -> None:
    """Bring `lo` up in a fresh network namespace (SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, ifreq))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))


def _launcher(argv: list[str]) -> None:
    """`python -m sandbox.analyze.ncu_run NCU ARGS...`: a network namespace with only a loopback, then exec ncu."""
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:  # CLONE_NEWNET
        _loopback_up()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    _launcher(sys.argv[1:])
