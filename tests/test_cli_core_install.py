"""The README's first command installs only the core dependencies: the CLI must start without the extras."""

import subprocess
import sys

# what the extras bring (mcp, harness, train, synth, test); none may be imported to build the command line
EXTRAS = ["mcp", "openai", "anthropic", "datasets", "transformers", "peft", "trl", "tokenizers", "starlette",
          "uvicorn", "matplotlib", "jsonschema", "websocket"]

PROBE = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: an extra)")
sys.meta_path.insert(0, Block())
from typer.main import get_command
from cuda_agent.cli import app
print(" ".join(sorted(get_command(app).commands)))
"""


def test_cli_builds_without_any_extra():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    commands = set(r.stdout.split())
    assert {"demo", "init", "compile", "verify", "profile", "reward", "tasks", "serve", "rollout", "eval",
            "export", "view", "train", "engine", "synth"} <= commands
