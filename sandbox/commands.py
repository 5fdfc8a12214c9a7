"""The sandbox's commands (init, compile, verify, profile, reward, tasks, demo), mounted by `cuda_agent.cli`.

Exit status: 0 success, 1 failure result, 2 bad usage or input.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ValidationError

from sandbox import present
from sandbox.config import COMPILE_MODES, CompileConfig, ProfileConfig, VerifyConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Write, build, verify and time CUDA kernels for PyTorch models.")

JsonOpt = Annotated[bool, typer.Option("--json", help="print exactly the result model as JSON")]
# a one-shot command profiles again while the verdict is timing_noisy, at most this many profiles in all: a
# newcomer's first run on a busy laptop should still end with a speedup (sandbox.api.profile_settled)
ONE_SHOT_TRIES = 3
Workdir = Annotated[Path, typer.Argument(help="a workspace made by `cuda-agent init`")]


CompileModeOpt = Annotated[str, typer.Option(help="torch.compile mode of the baseline: " + ", ".join(COMPILE_MODES))]


def _check_mode(mode: str, as_json: bool) -> None:
    if mode not in COMPILE_MODES:
        _bad_input(f"unknown compile mode {mode} (one of {', '.join(COMPILE_MODES)})", as_json)


def _bad_input(message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"ok": False, "error": message}))
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def option_error(e: ValidationError, options: dict[str, str] | None = None) -> str:
    """A config's validation error as one line naming each option and its rule (`--trials 0: should be greater
    than or equal to 1`), not pydantic's dump. `options`: field name -> option, where they differ."""
    parts = []
    for err in e.errors(include_url=False):
        rule = err["msg"].removeprefix("Value error, ")
        rule = rule.removeprefix("Input ") if rule.startswith("Input should") else rule
        names = [str(n) for n in err["loc"] if isinstance(n, str)]
        if not names:  # a rule over several settings (a model validator): its message names them
            parts.append(rule)
            continue
        opt = (options or {}).get(names[-1]) or "--" + names[-1].replace("_", "-")
        parts.append(f"{opt} {err['input']!r}: {rule}" if "input" in err else f"{opt}: {rule}")
    return "; ".join(parts)


def _config(model: type[BaseModel], as_json: bool, options: dict[str, str] | None = None, **values) -> BaseModel:
    """`model(**values)` built from command-line options, or exit 2 with one line naming the bad option."""
    try:
        return model(**values)
    except ValidationError as e:
        _bad_input(option_error(e, options), as_json)


def no_cuda() -> str | None:
    """Why the cuda backend cannot run here (None: it can): no GPU visible, or a torch built without CUDA.
    Found without importing torch, so `init` and `demo` refuse at once instead of failing in compile."""
    import importlib.util
    import re

    from sandbox.backend import gpu_visible

    if not gpu_visible():
        return "no GPU is visible here (no NVIDIA device, or CUDA_VISIBLE_DEVICES hides them)"
    spec = importlib.util.find_spec("torch")
    version = Path(spec.submodule_search_locations[0]) / "version.py" if spec and spec.submodule_search_locations \
        else None
    if version is not None and version.is_file():
        m = re.search(r"^cuda\b[^=]*=\s*(.+)$", version.read_text(), re.M)
        if m and m.group(1).strip() == "None":
            return "the installed torch is built without CUDA"
    return None


def _backend(backend: str | None, as_json: bool) -> str:
    """The backend to init with: an unknown name, or cuda where it cannot run, is bad input (exit 2)."""
    from sandbox.backend import resolve_backend

    try:
        resolved = resolve_backend(backend)
    except ValueError as e:
        _bad_input(str(e), as_json)
    if resolved == "cuda" and (why := no_cuda()):
        _bad_input(f"the cuda backend needs a usable GPU: {why}; use --backend cpu", as_json)
    return resolved


def _emit(result: BaseModel, text: Callable[[BaseModel], str], as_json: bool) -> None:
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        print(text(result))
    raise typer.Exit(0 if getattr(result, "ok", True) else 1)


def _open(workdir: Path, as_json: bool):
    from sandbox.confinement.processes import one_shot
    from sandbox.workspace import Workspace, WorkspaceError

    one_shot()  # one judgment per command: no workers kept ready for a next one

    try:
        return Workspace(workdir)
    except WorkspaceError as e:
        _bad_input(str(e), as_json)


@app.command()
def init(task: Annotated[str, typer.Argument(
             help="a task file, example/NAME, synth:eval/ID or synth:train/ID (the shipped synthesized set: "
                  "`cuda-agent tasks synth:eval`), kernelbench/levelN/NAME or ops6k:NAME")],
         workdir: Annotated[Path, typer.Argument(help="an empty or new directory")],
         backend: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if a GPU is visible)")] = None,
         check: Annotated[bool, typer.Option(help="execute the task first (forward on the meta device, or on "
                                                    "the CPU where small) to validate it")] = True,
         as_json: JsonOpt = False) -> None:
    """Create a workspace for a task."""
    from sandbox.api import init_workspace
    from sandbox.workspace import WorkspaceError
    from tasks import TaskError

    backend = _backend(backend, as_json)
    try:
        _, result = init_workspace(task, workdir, backend, check=check)
    except (TaskError, WorkspaceError, ValueError) as e:
        _bad_input(str(e), as_json)
    _emit(result, present.init_text, as_json)


@app.command("compile")
def compile_cmd(workdir: Workdir,
                timeout: Annotated[float, typer.Option(help="seconds before the build is killed")] = 300.0,
                as_json: JsonOpt = False) -> None:
    """Build kernels/ into the cuda_extension module (incremental)."""
    from sandbox.build.compile import compile_workspace

    cfg = _config(CompileConfig, as_json, {"timeout_s": "--timeout"}, timeout_s=timeout)
    ws = _open(workdir, as_json)
    _emit(compile_workspace(ws, cfg), present.compile_text, as_json)


@app.command()
def verify(workdir: Workdir,
           trials: Annotated[int, typer.Option(help="input sets, each from a fresh seed")] = 5,
           atol: float = 1e-2, rtol: float = 1e-2,
           allow_torch_ops: Annotated[bool, typer.Option(help="do not fail on PyTorch compute ops")] = False,
           strict: Annotated[bool, typer.Option(help="float32 at atol = rtol = 1e-4")] = False,
           generalize: Annotated[bool, typer.Option(help="also try other input sizes (reported apart)")] = False,
           timeout: Annotated[float, typer.Option(help="seconds per input set")] = 120.0,
           as_json: JsonOpt = False) -> None:
    """Check ModelNew against the reference in isolated processes."""
    from sandbox.correctness.verify import verify_workspace

    cfg = _config(VerifyConfig, as_json, {"trial_timeout_s": "--timeout"}, trials=trials, atol=atol, rtol=rtol,
                  forbid_torch_ops=not allow_torch_ops, trial_timeout_s=timeout, strict=strict, generalize=generalize)
    ws = _open(workdir, as_json)
    _emit(verify_workspace(ws, cfg), present.verify_text, as_json)


@app.command()
def profile(workdir: Workdir,
            compile_mode: CompileModeOpt = "default",
            cache: Annotated[bool, typer.Option(help="reuse cached baseline timings")] = True,
            as_json: JsonOpt = False) -> None:
    """Time ModelNew against PyTorch eager and torch.compile."""
    from sandbox.api import profile_settled

    _check_mode(compile_mode, as_json)
    cfg = _config(ProfileConfig, as_json, compile_mode=compile_mode, use_cache=cache)
    ws = _open(workdir, as_json)
    _emit(profile_settled(ws, cfg, ONE_SHOT_TRIES), present.profile_text, as_json)


def _evaluation_text(ws, c, v, p, r) -> str:
    parts = [present.compile_text(c)]
    if v is not None:
        parts.append(present.verify_text(v))
    if p is not None:
        parts.append(present.profile_text(p))
    parts.append(present.reward_text(r))
    return "\n".join(parts)


@app.command()
def reward(workdir: Workdir, compile_mode: CompileModeOpt = "default", as_json: JsonOpt = False) -> None:
    """Compile, verify and profile, then compute the milestone reward."""
    from sandbox.api import Evaluation, evaluate

    _check_mode(compile_mode, as_json)
    ws = _open(workdir, as_json)
    c, v, p, r = evaluate(ws, compile_mode, noisy_tries=ONE_SHOT_TRIES)
    ev = Evaluation(ok=r.correct, compile=c.model_dump(), verify=v.model_dump() if v else None,
                    profile=p.model_dump() if p else None, reward=r.model_dump())
    if as_json:
        print(ev.model_dump_json(indent=2))
    else:
        print(_evaluation_text(ws, c, v, p, r))
    raise typer.Exit(0 if ev.ok else 1)


@app.command()
def tasks(spec: Annotated[str | None, typer.Argument(
              help="what to list: synth (the shipped synthesized set), synth:eval, synth:train, kernelbench, "
                   "kernelbench:level1, ops6k, a folder (a synthesized set too) or a file; left out: every task "
                   "this install has; or `download`")] = None,
          suite: Annotated[str | None, typer.Argument(help="with `download`: the suite to fetch (kernelbench)")] = None,
          url: Annotated[str | None, typer.Option(help="with `download`: the archive URL (a mirror)")] = None,
          as_json: JsonOpt = False) -> None:
    """List task ids (init takes them), or `tasks download kernelbench` to fetch the suite into the cache."""
    from tasks import TaskError, list_tasks
    from tasks.loader import available_tasks

    if spec == "download":
        _download(suite, url, as_json)
        return
    if suite is not None or url is not None:
        _bad_input(f"unexpected {suite or '--url'!r}: only `tasks download kernelbench` takes a second argument",
                   as_json)
    missing: list[str] = []
    try:
        found, missing = available_tasks() if spec is None else (list_tasks(spec), [])
    except TaskError as e:
        _bad_input(str(e), as_json)
    if as_json:
        print(json.dumps([{"id": t.id, "sha256": t.sha256, "path": str(t.path) if t.path else None} for t in found],
                         indent=2))
    else:
        for t in found:
            print(t.id)
        print(f"{len(found)} tasks" + "".join(f"; {m}" for m in missing), file=sys.stderr)


def _download(suite: str | None, url: str | None, as_json: bool) -> None:
    from tasks.kernelbench import ARCHIVE_URL, COMMIT, DownloadError, download_kernelbench

    if suite != "kernelbench":
        _bad_input(f"unknown suite {suite!r}: `cuda-agent tasks download kernelbench` is the one there is", as_json)
    source = url or ARCHIVE_URL
    if not as_json:
        print(f"downloading KernelBench {COMMIT[:7]} from {source}", file=sys.stderr)
    try:
        root = download_kernelbench(source)
    except DownloadError as e:
        if as_json:
            print(json.dumps({"ok": False, "error": str(e)}))
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    counts = {d.name: len(list(d.glob("*.py"))) for d in sorted(root.glob("level*"))}
    if as_json:
        print(json.dumps({"ok": True, "path": str(root), "commit": COMMIT, "levels": counts}, indent=2))
    else:
        print(f"KernelBench {COMMIT[:7]} verified and installed in {root} "
              f"({', '.join(f'{n} {k}' for k, n in counts.items())} problems); "
              "list them with `cuda-agent tasks kernelbench:level1`")


# The same model at two sizes: on a GPU the small one is all launch overhead (0.05 ms on an H100, a
# tie at best), so the GPU demo runs a 1 GiB activation (~1.4 ms eager on an H100); two CPU cores
# would take seconds a call on that, so the CPU demo keeps the small one.
DEMO_TASKS = {"cuda": "example/swish_bias_large", "cpu": "example/swish_bias"}
DEMO_WHY = ("why: eager PyTorch runs silu and the add as two kernels, two passes over memory; the bundled "
            "kernel fuses them into one pass, and torch.compile generates one fused kernel too, so expect "
            "about 2x eager and about 1x torch.compile where memory bandwidth decides")


@app.command()
def demo(backend: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if a GPU is visible)")] = None,
         workdir: Annotated[Path | None, typer.Option(help="where to put the workspace (default: a temp dir)")] = None,
         as_json: JsonOpt = False) -> None:
    """The whole loop on the bundled example: init, write a solution, compile, verify, profile, reward."""
    from sandbox.api import Evaluation, evaluate, init_workspace
    from sandbox.confinement.processes import one_shot
    from tasks.loader import EXAMPLES_DIR

    backend = _backend(backend, as_json)
    one_shot()
    target = workdir or Path(tempfile.mkdtemp(prefix="cuda-agent-demo-")) / "swish_bias"
    ws, init_result = init_workspace(DEMO_TASKS[backend], target, backend)
    solution = EXAMPLES_DIR / "solutions" / "swish_bias" / backend
    shutil.copytree(solution, ws.root, dirs_exist_ok=True)
    if not as_json:
        print(present.init_text(init_result))
        print(f"wrote the bundled {backend} solution: {', '.join(sorted(ws.list_files()))}")
    c, v, p, r = evaluate(ws, noisy_tries=ONE_SHOT_TRIES)
    if as_json:
        print(Evaluation(ok=r.correct, compile=c.model_dump(), verify=v.model_dump() if v else None,
                         profile=p.model_dump() if p else None, reward=r.model_dump()).model_dump_json(indent=2))
    else:
        print(_evaluation_text(ws, c, v, p, r))
        print(present.demo_summary(r, backend))
        print(DEMO_WHY)
    raise typer.Exit(0 if r.correct else 1)


daemon_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                         help="The user's template daemon, which forks workers for one-shot judge calls "
                              "(docs/judge.md). It exits by itself when idle (CUDA_AGENT_TEMPLATE_IDLE_S).")


@daemon_app.command("status")
def daemon_status(as_json: JsonOpt = False) -> None:
    """List this user's template daemons: key, pid, state, workers forked."""
    from sandbox.confinement import daemon

    found = daemon.daemons()
    if as_json:
        print(json.dumps(found, indent=2))
        return
    if not found:
        print(f"no template daemon running (directory {daemon.directory()})")
    for d in found:
        info = d.get("info", {})
        extra = (f", {info.get('forks', 0)} workers forked, {info.get('children', 0)} running, idle limit "
                 f"{info.get('idle_s', 0):g} s" + (f", problems: {'; '.join(info['problems'])}" if info.get("problems")
                                                  else "")) if info else ""
        print(f"{d['key']}: pid {d['pid']}, {d['state']}{extra} (log {d['log']})")


@daemon_app.command("stop")
def daemon_stop(as_json: JsonOpt = False) -> None:
    """Stop this user's template daemons (workers of calls still running are killed with them)."""
    from sandbox.confinement import daemon

    stopped = daemon.stop()
    if as_json:
        print(json.dumps(stopped, indent=2))
    else:
        print(f"stopped {len(stopped)} template daemon{'s' if len(stopped) != 1 else ''}")
