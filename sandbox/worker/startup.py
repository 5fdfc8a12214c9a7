"""What a worker does before it serves: leave the network, import torch, open the device, preload.

`python -m sandbox.worker` imports this module first, so the network namespace is private before
torch (or any code that could open a socket) is imported, and the start-up clock counts from here.
A worker forked from the template (`sandbox.worker.template`) takes the same steps, in the same order,
in the forked child through `forked()`: the template itself skips them, since it serves no role.
Imports only the standard library, torch, `sandbox.confinement.filesystem` and, on CUDA, `sandbox.timing.cores`
(both standard library only).
"""

from __future__ import annotations

import os
import sys
import time

_STARTED = time.perf_counter()
TEMPLATE_ROLE = "template"


def _isolate_network() -> bool:
    """A private network namespace (no interfaces but a down loopback): the candidate cannot reach out.

    Needs CAP_SYS_ADMIN; without it the worker runs with the host's network, and results say so.
    """
    if os.environ.get("CUDA_AGENT_NO_NETNS"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(0x40000000) == 0  # CLONE_NEWNET
    except (OSError, AttributeError):
        return False


from sandbox.confinement import filesystem  # noqa: E402  (standard library only: runs before torch starts any thread)

_NETWORK_ISOLATED = False
# mutated in place, never rebound: other modules hold references to these
CONFINEMENT: dict = {"applied": None, "notes": [], "limits": []}
_STEPS: dict[str, float] = {}  # start-up steps' seconds, reported with the set-up reply
_TIMES = {"ready_at": None, "forked": False}


def begin(role: str) -> None:
    """The network namespace, then Landlock's first stage, while the process has one thread (see
    sandbox.confinement.filesystem); the candidate role tightens it before loading any candidate code."""
    global _NETWORK_ISOLATED
    from sandbox.confinement import limits, pidgroup  # standard library only

    threads = limits.ResourceLimits.from_env().threads
    pidgroup.join(threads)  # while it has one thread, before Landlock closes /sys
    _NETWORK_ISOLATED = _isolate_network()
    t = time.perf_counter()
    CONFINEMENT.update(applied=filesystem.at_worker_start(role), notes=[], limits=[], second_stage=False)
    # no group: RLIMIT_NPROC under a uid of its own, once the namespaces are made, for a CPU process (a pooled
    # worker's role names its device: idle:cpu)
    pidgroup.bind_rest(threads, device=role.split(":")[1] if role.startswith("idle:") else None)
    _STEPS["confine_s"] = time.perf_counter() - t


# only in a worker started by exec (`python -P -m sandbox.worker ROLE ...`): a process that merely imports the
# worker's modules (a test timing a candidate in-process) must keep its network and its filesystem
_WORKER = len(sys.argv) > 1 and sys.argv[0].endswith(os.path.join("sandbox", "worker", "__main__.py"))
_ROLE = sys.argv[1] if _WORKER else ""
if _WORKER and os.environ.get("CUDA_AGENT_JUDGE_PID", "").isdigit():
    # dies (SIGKILL) with the judging process that started it, stopped or not, template included: first, before
    # anything could leave it running (sandbox/confinement/orphans.py)
    from sandbox.confinement.proctree import die_with  # standard library only

    if not die_with(int(os.environ["CUDA_AGENT_JUDGE_PID"])):
        os._exit(1)  # the judge died before the signal was armed
if _ROLE and _ROLE != TEMPLATE_ROLE:
    begin(_ROLE)

import torch  # noqa: E402

from sandbox.worker import guards  # noqa: E402

_TORCH_IMPORTED = time.perf_counter()


def forked(role: str, started: float) -> None:
    """A child of the template, just forked (one thread): this process's own start-up. It imported nothing
    (the template did), so its clock starts at the fork and its torch import took no time."""
    global _STARTED, _TORCH_IMPORTED
    _STARTED = _TORCH_IMPORTED = started
    _STEPS.clear()
    _TIMES["forked"] = True
    begin(role)


def mark_ready() -> float:
    """The moment the worker can serve its role, on the machine-wide monotonic clock that the judge's
    `Worker` compares with the moment it asked for the worker (sandbox.confinement.processes)."""
    _TIMES["ready_at"] = time.monotonic()
    return _TIMES["ready_at"]


def open_device(name: str) -> torch.device:
    t = time.perf_counter()
    device = torch.device(name)
    if device.type == "cuda":
        from sandbox.timing import cores  # standard library only

        cores.keep_off_timing_cores()  # before the driver's and the context's threads start: they inherit it
        # the driver's start (cuInit) apart from the context's creation: on an H200 under eight judgments the first
        # took 0.02 s and the second 0.6 s, so the context is what a pool opens ahead (docs/history.md, fifteenth round)
        torch.cuda.init()
        t_ctx = time.perf_counter()
        _STEPS.setdefault("device_runtime_s", t_ctx - t)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.empty(0, device=device)  # creates the context now, so its cost is counted here
        guards.resolve_cuda_runtime()  # now, while this process may still start the helpers it needs
        _STEPS.setdefault("device_context_s", time.perf_counter() - t_ctx)
    else:
        import platform

        platform.processor()  # device_name's, cached: it runs `uname -p`, which a confined process may not start
    _STEPS.setdefault("device_init_s", time.perf_counter() - t)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def startup_times() -> dict:
    return {"import_torch_s": _TORCH_IMPORTED - _STARTED, "ready_s": time.perf_counter() - _STARTED,
            "started": "fork" if _TIMES["forked"] else "exec", "network_isolated": _NETWORK_ISOLATED,
            "confinement": CONFINEMENT["applied"], "confinement_notes": CONFINEMENT["notes"],
            "limits": CONFINEMENT["limits"], **_STEPS}


def setup_step():
    """A lap timer for a role's set-up: step(NAME) records the seconds since the last lap as NAME_s, reported
    with the set-up reply (verify's phases show them as <role>_NAME)."""
    mark = [time.perf_counter()]

    def step(name: str) -> None:
        now = time.perf_counter()
        _STEPS[f"{name}_s"] = _STEPS.get(f"{name}_s", 0.0) + now - mark[0]
        mark[0] = now
    return step


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def preload() -> None:
    """torch.profiler's first use imports torch._dynamo (4-5 s on the H200 host: it asks
    hasattr(torch, "_inductor")). A timer pays that here, at start-up, where it overlaps the other
    process's set-up; a pooled worker, which may become a timer, pays it before it is needed at all."""
    t = time.perf_counter()
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # an optional speed-up, never a reason to fail
        pass
    _STEPS["preload_s"] = time.perf_counter() - t


def _join_judgment(starts_tools: bool = False) -> None:
    """A process whose start left its thread bound to its set-up (one that may open CUDA, as root, without a cgroup)
    takes its judgment's uid now, before the seccomp filter refuses uid changes (sandbox.confinement.nproc)."""
    from sandbox.confinement import limits, pidgroup  # standard library only

    pidgroup.bind_joined(limits.ResourceLimits.from_env().threads, starts_tools)


def confine_candidate(shm_dir: str, extension: str | None, model_new: str, task: str, cuda: bool) -> None:
    """The second stage, before the task's and the candidate's code are loaded: the filesystem, then resource
    limits."""
    from sandbox.confinement import limits  # standard library only

    if CONFINEMENT.get("second_stage"):
        raise RuntimeError("this process was confined for another role already")
    t = time.perf_counter()
    _join_judgment()
    CONFINEMENT["applied"], CONFINEMENT["notes"] = filesystem.for_candidate(
        CONFINEMENT["applied"], shm_dir, extension, model_new, task, cuda)
    CONFINEMENT["limits"] = limits.apply()
    CONFINEMENT["candidate"] = CONFINEMENT["second_stage"] = True
    _STEPS["confine_s"] = _STEPS.get("confine_s", 0.0) + time.perf_counter() - t


def confine_task(role: str, files: list[str], compiles: bool = False) -> None:
    """The second stage of a process that runs a task's reference and never a candidate, before the task is
    loaded: a task is code a client may have written (an MCP `source`, a synthesized task), so it reads only
    what it needs, and runs under the candidate's limits. `compiles`: torch.compile may start its compilers.
    Once per process: a later call (the eager role's second model) keeps the first confinement."""
    from sandbox.confinement import limits  # standard library only

    if CONFINEMENT.get("second_stage") or filesystem.library_baseline(role):
        return
    t = time.perf_counter()
    _join_judgment(starts_tools=compiles)
    CONFINEMENT["applied"], CONFINEMENT["notes"] = filesystem.for_task(CONFINEMENT["applied"], files, compiles)
    CONFINEMENT["limits"] = limits.apply(processes=compiles)
    CONFINEMENT["second_stage"] = True
    if compiles:
        # Inductor's compile workers are processes of their own that initialise CUDA (pre_fork_setup reads the
        # device's properties), and CUDA's initialisation writes beneath the process's own /proc entry, which
        # Landlock grants this process only, not its children: on the H100 the confined baseline's torch.compile
        # failed so. Compiled in this process instead (Triton's ptxas and the C++ compilers still run as children)
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    _STEPS["confine_s"] = _STEPS.get("confine_s", 0.0) + time.perf_counter() - t
