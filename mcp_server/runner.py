"""The helper process that runs one sandbox operation for the server: `python -m mcp_server.runner`.

Reads one JSON request on stdin, writes one JSON reply on stdout. Running each operation in its
own process lets the server cancel it by killing a process tree, and gives each call its own
environment (CUDA_VISIBLE_DEVICES picks the GPU the scheduler granted; the sandbox's workers
inherit it). The sandbox itself is used as is.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import traceback
from typing import Any

from sandbox.confinement import environment, proctree, template

PARENT_ENV = "MCP_SERVER_HELPER_PARENT"  # the server's pid, to tell whether it died before we started
PREWARM_ENV = "CUDA_AGENT_PREWARM"  # cuda or cpu: start torch workers before the request arrives


def _init(req: dict[str, Any]) -> Any:
    from sandbox.api import init_workspace
    from tasks import Task, check_source

    if req.get("source") is not None:
        check_source(req["source"], req["task_id"])
        task: str | Task = Task(id=req["task_id"], source=req["source"])
    else:
        task = req["task"]
    _, result = init_workspace(task, req["workdir"], req.get("backend"), check=req.get("check", True))
    return result


def _compile(req: dict[str, Any]) -> Any:
    from sandbox.api import CompileConfig, Workspace, compile_workspace

    return compile_workspace(Workspace(req["workdir"]), CompileConfig(**req.get("config", {})))


def _verify(req: dict[str, Any]) -> Any:
    from sandbox.api import VerifyConfig, Workspace, verify_workspace

    return verify_workspace(Workspace(req["workdir"]), VerifyConfig(**req.get("config", {})))


def _profile(req: dict[str, Any]) -> Any:
    from sandbox.api import ProfileConfig, Workspace, profile_workspace

    return profile_workspace(Workspace(req["workdir"]), ProfileConfig(**req.get("config", {})))


def _analyze(req: dict[str, Any]) -> Any:
    from sandbox.api import AnalyzeConfig, Workspace, analyze_workspace

    return analyze_workspace(Workspace(req["workdir"]), AnalyzeConfig(**req.get("config", {})))


OPS = {"init": _init, "compile": _compile, "verify": _verify, "profile": _profile, "analyze": _analyze}


BUILD_PREFIX = "build:"  # PREWARM_ENV for a compile's helper: build:cuda, build:cpu (no workers)


def prepare(warm: str) -> None:
    """Make a helper started ahead of its call completely ready before it blocks on the request: its
    workers start (forked from the server's template, or importing torch by exec) while this process
    imports the operations' modules and reads the toolchain (the device's name and torch's version,
    which profile needs), so a request finds nothing left to load. None of it imports torch here.
    A compile's helper (build:BACKEND) starts no workers: the start-up it saves is Python's and the
    imports, 0.3-0.5 s of every compile call otherwise."""
    from sandbox.confinement.processes import enable_warm_pool
    from sandbox.timing import device_lock  # noqa: F401  (before the pool: its workers open the device under this lock)

    if warm.startswith(BUILD_PREFIX):
        warm = warm[len(BUILD_PREFIX):]
    else:
        enable_warm_pool(2, refill=False).prefill(warm)
    import elftools.elf.elffile  # noqa: F401  (the symbol scan's ELF reader, imported at first use: 0.1 s)

    import sandbox.api  # noqa: F401  (the operations, their pydantic models, tasks, sandbox.workspace)
    from sandbox.build.toolchain import get_toolchain

    try:
        get_toolchain(warm)  # cached on disk after the first probe: a file read
    except RuntimeError:
        pass  # the operation that needs it reports the failure


class _Stopped(BaseException):
    """Raised into the running operation so the sandbox's own cleanup (scratch dirs, locks) runs."""


_state = {"in_op": False, "stopping": False}


def _on_term(signum: int, frame: Any) -> None:
    # the server cancelled the call, or died (parent-death signal): take our whole tree down with us
    if _state["stopping"]:
        return
    _state["stopping"] = True
    template.kill_children()  # workers forked by the server's template are not our descendants
    proctree.kill_own_tree()
    if _state["in_op"]:
        raise _Stopped
    environment.remove_process_folder()  # os._exit skips the exit handlers that would remove it
    os._exit(128 + signum)


def run(req: dict[str, Any]) -> dict[str, Any]:
    from sandbox.workspace import WorkspaceError
    from tasks import TaskError

    op = OPS.get(req.get("op", ""))
    if op is None:
        return {"ok": False, "kind": "internal", "error": f"unknown operation {req.get('op')!r}"}
    try:
        return {"ok": True, "result": op(req).model_dump(mode="json")}
    except (WorkspaceError, TaskError) as e:
        return {"ok": False, "kind": "input", "error": str(e)}
    except Exception as e:
        return {"ok": False, "kind": "internal", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:]}


def main() -> None:
    # the reply owns stdout; anything else the sandbox prints goes to stderr
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    proctree.become_subreaper()
    proctree.die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_term)
    if os.environ.get(PARENT_ENV, str(os.getppid())) != str(os.getppid()):
        sys.exit(1)  # the server died before we could ask to be told
    channel = os.environ.pop(template.CHANNEL_ENV, None)
    if channel is not None:
        template.attach(int(channel))
    warm = os.environ.get(PREWARM_ENV)
    if warm in ("cuda", "cpu", f"{BUILD_PREFIX}cuda", f"{BUILD_PREFIX}cpu"):
        prepare(warm)
    try:
        req = json.loads(sys.stdin.read())
    except ValueError as e:
        reply = {"ok": False, "kind": "internal", "error": f"bad request: {e}"}
    else:
        _state["in_op"] = True
        try:
            reply = run(req)
        except _Stopped:
            # the workers are dead already; what their sessions left in the exchange area (the task's text, logs,
            # scratch) goes now: the reaper that would remove it is a thread os._exit does not wait for
            environment.remove_process_folder()
            os._exit(128 + signal.SIGTERM)
        _state["in_op"] = False
    # the sandbox cleans up after itself; this catches anything it missed. The workers are killed already and
    # the template collects its children once this process is gone: the exit handlers need not wait for them
    from sandbox.confinement.reaper import REAPER

    REAPER.wait_at_exit = False
    template.kill_children()
    proctree.kill_own_tree()
    with os.fdopen(reply_fd, "w") as out:
        out.write(json.dumps(reply))
    # the server reaps the helper before it answers the call: skip the interpreter's teardown (tens of ms
    # to tear down every module), running only the exit handlers (the warm pool's directory, the template)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):  # both are the server's stderr now
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
