"""`cuda-agent`: one command line for every layer.

Each layer keeps its commands in its own typer app (`sandbox.commands`, `mcp_server.commands`,
`harness.cli`, ...) and knows nothing of the others; this module, the top of the import graph, mounts
them. A layer's command module imports nothing heavy at import time, so `cuda-agent --help` stays fast
and a missing optional extra only fails the commands that need it.
Exit status everywhere: 0 success, 1 failure result, 2 bad usage or input.
"""

from __future__ import annotations

import importlib
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Write, build, verify and time CUDA kernels for PyTorch models; run, train and "
                       "evaluate agents that write them.")

# (module, attribute, group name): a group name of None merges the layer's commands at the top level
MOUNTS: list[tuple[str, str, str | None]] = [
    ("sandbox.commands", "app", None),
    ("sandbox.commands", "daemon_app", "judge-daemon"),
    ("sandbox.analyze.cli", "app", None),
    ("mcp_server.commands", "app", None),
    ("harness.cli", "app", None),
    ("harness.cluster.cli", "app", "cluster"),
    ("training.cli", "train_app", "train"),
    ("training.cli", "engine_app", "engine"),
    ("synth.cli", "app", "synth"),
    ("harness.viewer.cli", "app", None),
]


def _mount() -> None:
    for module, attr, name in MOUNTS:
        sub = getattr(importlib.import_module(module), attr)
        if name is None:
            app.add_typer(sub)
        else:
            app.add_typer(sub, name=name)


_mount()


def main() -> None:
    from pydantic import ValidationError

    try:
        app()
    except ValidationError as e:
        # a command that builds a *Config from its options without a check of its own: still one line and exit 2,
        # the option and its rule, not pydantic's dump. Any other model failing is a bug and keeps its traceback
        if not e.title.endswith("Config"):
            raise
        from sandbox.commands import option_error

        print(f"error: {option_error(e)}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
