"""Real MCP clients against `cuda-agent serve`: Claude Code (`claude mcp add` / `claude mcp list`) and the
MCP Inspector's CLI, both installed from npm.

They need npm and its registry. Where npm is not on PATH or the registry cannot be reached the tests are
skipped, saying which; an install that fails for any other reason fails the tests. Installs are kept in
`$CUDA_AGENT_NPM_CACHE` (default `~/.cache/cuda-agent/npm`), one directory per package and version, so a
rerun does not download again and works offline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# Exact versions: a range would move under CI without a commit, and npm resolves a range to the newest
# version whose `engines` the local node satisfies (on node 20, `@2.1` gives 2.1.197, not the latest 2.1.x).
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.331")
INSPECTOR = ("@modelcontextprotocol/inspector", "2.12.0")

EXPECTED_TOOLS = {"list_tasks", "open_task", "list_files", "read_file", "write_file", "edit_file", "compile",
                  "verify", "profile", "analyze", "read_skill", "close_workspace"}
# npm's error codes for a registry it cannot reach; anything else is a real failure
NETWORK_ERRORS = {"ECONNREFUSED", "ECONNRESET", "ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ESOCKETTIMEDOUT",
                  "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN", "ERR_SOCKET_TIMEOUT"}

pytestmark = pytest.mark.timeout(1200)  # a first install downloads ~400 MB (Claude Code's native binary)


def run(cmd: list[Any], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def shown(r: subprocess.CompletedProcess[str]) -> str:
    return f"$ {' '.join(r.args)}\nexit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"


# ---- installing the clients ----------------------------------------------------------------------

def _unreachable(r: subprocess.CompletedProcess[str]) -> str | None:
    """The reason npm could not reach the registry, or None if it failed for another reason."""
    m = re.search(r"npm error code (\S+)", r.stderr)
    if not ((m and m.group(1) in NETWORK_ERRORS) or "npm error network" in r.stderr):
        return None
    detail = re.search(r"request to (\S+) failed, reason: (.+)", r.stderr)
    return (m.group(1) if m else "network error") + (f": {detail.group(1)}: {detail.group(2)[:200]}" if detail else "")


def npm_install(name: str, version: str) -> Path:
    """`name@version` installed into a prefix of its own under the npm cache dir; returns the prefix."""
    root = Path(os.environ.get("CUDA_AGENT_NPM_CACHE") or Path.home() / ".cache" / "cuda-agent" / "npm")
    prefix = root / f"{name.lstrip('@').replace('/', '+')}@{version}"
    if prefix.is_dir():  # only a finished install is renamed into place
        return prefix
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not on PATH (needed to install {name}@{version} from the npm registry)")
    # a quick look first, without npm's retries, so an offline machine skips in seconds
    try:
        r = run([npm, "view", f"{name}@{version}", "version", "--fetch-retries=0", "--fetch-timeout=30000"],
                timeout=90)
    except subprocess.TimeoutExpired:
        pytest.skip(f"the npm registry did not answer within 90 s (npm view {name}@{version})")
    if r.returncode != 0 and (why := _unreachable(r)):
        pytest.skip(f"the npm registry is unreachable ({why})")
    assert r.returncode == 0 and version in r.stdout, shown(r)

    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.", dir=root))
    try:
        try:
            r = run([npm, "install", "--prefix", work, "--no-audit", "--no-fund", "--update-notifier=false",
                     f"{name}@{version}"], timeout=900)
        except subprocess.TimeoutExpired:  # the registry answered, so this is no reason to skip
            pytest.fail(f"npm install {name}@{version} did not finish within 900 s")
        if r.returncode != 0 and (why := _unreachable(r)):
            pytest.skip(f"the npm registry became unreachable during the install ({why})")
        assert r.returncode == 0, shown(r)
        try:
            work.rename(prefix)
        except OSError:  # another session finished the same install first
            if not prefix.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return prefix


@pytest.fixture(scope="module")
def claude(tmp_path_factory) -> list[str]:
    prefix = npm_install(*CLAUDE_CODE)
    env = claude_env(tmp_path_factory.mktemp("claude-version"))
    package = prefix / "node_modules" / "@anthropic-ai" / "claude-code"
    tried: list[str] = []
    # The package's postinstall copies the platform's native binary over bin/claude.exe, a stub. Where npm
    # does not run install scripts (--ignore-scripts, allow-scripts policies) the stub stays; the package's
    # own cli-wrapper.cjs then finds and runs the same binary.
    for cmd in ([prefix / "node_modules" / ".bin" / "claude"], ["node", package / "cli-wrapper.cjs"]):
        cmd = [str(c) for c in cmd]
        try:
            r = run([*cmd, "--version"], timeout=60, env=env)
        except OSError as e:
            tried.append(f"{cmd}: {e}")
            continue
        tried.append(shown(r))
        if r.returncode == 0:
            assert CLAUDE_CODE[1] in r.stdout, shown(r)
            return cmd
    raise AssertionError("neither the claude binary nor its wrapper runs:\n" + "\n".join(tried))


@pytest.fixture(scope="module")
def inspector() -> list[str]:
    return [str(npm_install(*INSPECTOR) / "node_modules" / ".bin" / "mcp-inspector")]


# ---- the server as a client starts it ------------------------------------------------------------

def serve_command(*args: str) -> list[str]:
    """`cuda-agent serve` of this interpreter's environment (its console script, as users register it)."""
    script = Path(sys.executable).parent / "cuda-agent"
    base = [str(script)] if script.exists() else [sys.executable, "-m", "cuda_agent"]
    return [*base, "serve", "--backend", "cpu", *args]


def server_env() -> dict[str, str]:
    """What the server needs from its client: this checkout's code first (the environment may have the
    project installed from elsewhere) and the session's isolated cache."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "CUDA_AGENT_CACHE": os.environ["CUDA_AGENT_CACHE"]}


# ---- Claude Code --------------------------------------------------------------------------------

def claude_env(home: Path) -> dict[str, str]:
    """A private HOME (`claude mcp add` writes ~/.claude.json) and nothing of the user's Claude settings.

    No API key: `mcp add` and `mcp list` send no model requests (checked with api.anthropic.com
    unresolvable). The variables below keep the commands off the network otherwise.
    """
    env = {k: v for k, v in os.environ.items()
           # CLAUDECODE (set inside a Claude Code session), CLAUDE_CONFIG_DIR, provider switches, MCP_*
           if not k.startswith(("ANTHROPIC_", "CLAUDE", "MCP_", "XDG_"))}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        TMPDIR=str(home / "tmp"),  # claude keeps per-session notes under $TMPDIR/claude-<uid>/
        DISABLE_AUTOUPDATER="1",  # no update check or download
        # no telemetry, error reports or feature-flag fetches: without it both commands try to send events
        # (and leave ~/.claude/telemetry/1p_failed_events.* behind where they cannot)
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        MCP_TIMEOUT="60000",  # server start-up limit in ms (default 30 s); a loaded CI machine is slow
    )
    return env


def claude_session(claude: list[str], tmp_path: Path, servers: dict[str, list[str]]) -> str:
    """Register `servers` (name -> command) in a fresh HOME and project, then return `claude mcp list`."""
    home, project = tmp_path / "home", tmp_path / "project"
    project.mkdir()
    env = claude_env(home)
    for name, command in servers.items():
        env_args = [a for k, v in server_env().items() for a in ("-e", f"{k}={v}")]
        # the name before -e: -e takes several values and would swallow it
        r = run([*claude, "mcp", "add", name, "--transport", "stdio", *env_args, "--", *command],
                timeout=120, env=env, cwd=project)
        assert r.returncode == 0 and f"Added stdio MCP server {name}" in r.stdout, shown(r)
    r = run([*claude, "mcp", "list"], timeout=300, env=env, cwd=project)
    logs = "\n".join(f"--- {p.relative_to(home)}\n{p.read_text()[-3000:]}"
                     for p in sorted(home.glob(".cache/claude-cli-nodejs/*/mcp-logs-*/*")))
    assert r.returncode == 0, shown(r) + "\n" + logs
    return r.stdout + "\n" + logs


def status_line(listing: str, name: str) -> str:
    """`cuda-agent: /path/cuda-agent serve --backend cpu - ✔ Connected` (or `- ✘ Failed to connect — ...`)."""
    lines = [ln for ln in listing.splitlines() if ln.startswith(f"{name}: ")]
    assert lines, f"{name} is missing from `claude mcp list`:\n{listing}"
    return lines[0]


@pytest.mark.full  # installs Claude Code (~400 MB); a real client in the default tier: the MCP Inspector's tests
def test_claude_code_connects(claude, tmp_path):
    listing = claude_session(claude, tmp_path, {"cuda-agent": serve_command()})
    line = status_line(listing, "cuda-agent")
    assert re.search(r"\bConnected$", line) and "Failed" not in line, listing


@pytest.mark.full  # installs Claude Code (~400 MB); a real client in the default tier: the MCP Inspector's tests
def test_claude_code_reports_broken_servers(claude, tmp_path):
    """The same check says so when the server cannot start, so the test above can fail."""
    listing = claude_session(claude, tmp_path, {
        "bad-option": serve_command("--no-such-option"),
        "no-executable": [str(tmp_path / "no" / "cuda-agent"), "serve"],
    })
    for name in ("bad-option", "no-executable"):
        line = status_line(listing, name)
        assert "Failed to connect" in line and "Connected" not in line, listing
    assert "No such option: --no-such-option" in listing  # the server's stderr, from Claude Code's log


# ---- MCP Inspector CLI --------------------------------------------------------------------------

def inspect(inspector: list[str], tmp_path: Path, *args: str, serve_args: tuple[str, ...] = ()
            ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None, dict[str, Any] | None]:
    """One `mcp-inspector --cli` run against a fresh stdio server; returns (process, result, error).

    With --format json the result is one JSON object on stdout and a failure an error envelope on stderr.
    The Inspector starts the server with a minimal environment (PATH, HOME, ...), unlike Claude Code,
    which passes on its own: what the server needs goes in with -e.
    """
    home = tmp_path / "inspector-home"  # it keeps a catalog and client config under ~/.mcp-inspector
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_")}
    env["HOME"] = str(home)
    env_args = [a for k, v in server_env().items() for a in ("-e", f"{k}={v}")]
    # the server's start imports the judge: its default 15 s to connect was once too short on a loaded 2-core machine
    r = run([*inspector, "--cli", "--connect-timeout", "120000", *env_args, *args, "--format", "json", "--",
             *serve_command(*serve_args)],
            timeout=180, env=env)
    result = json.loads(r.stdout)["result"] if r.stdout.strip() else None
    error = None
    for line in reversed(r.stderr.strip().splitlines()):
        if line.startswith("{"):
            error = json.loads(line).get("error")
            break
    return r, result, error


def text_of(result: dict[str, Any]) -> str:
    return "\n".join(c.get("text", "") for c in result["content"])


@pytest.mark.parametrize("era", [pytest.param("legacy", marks=pytest.mark.full), "modern"])  # full: tests/README.md
def test_inspector_lists_tools(inspector, tmp_path, era):
    # --strict: exit 6 if a tool's schema has a portability problem of error severity
    r, result, _ = inspect(inspector, tmp_path, "--protocol-era", era, "--method", "tools/list", "--strict")
    assert r.returncode == 0 and result, shown(r)
    tools = {t["name"]: t for t in result["tools"]}
    assert EXPECTED_TOOLS <= set(tools), sorted(tools)
    assert {"tasks", "total", "next_offset"} <= set(tools["list_tasks"]["outputSchema"]["properties"])
    assert tools["verify"]["annotations"]["readOnlyHint"] is True


def test_inspector_calls_list_tasks(inspector, tmp_path):
    r, result, _ = inspect(inspector, tmp_path, "--method", "tools/call", "--tool-name", "list_tasks",
                           "--tool-args-json", json.dumps({"query": "swish_bias", "limit": 5}))
    assert r.returncode == 0 and result and result["isError"] is False, shown(r)
    listed = result["structuredContent"]
    assert listed["offset"] == 0 and listed["total"] >= 1
    assert "example/swish_bias" in [t["id"] for t in listed["tasks"]]
    assert "example/swish_bias" in text_of(result)


def test_inspector_uses_the_default_workspace(inspector, tmp_path):
    """A server started for one task: workspace tools work without a workspace_id."""
    task = ("--task", "example/swish_bias")
    r, result, _ = inspect(inspector, tmp_path, "--method", "tools/call", "--tool-name", "list_files",
                           serve_args=task)
    assert r.returncode == 0 and result and result["isError"] is False, shown(r)
    files = {f["path"]: f for f in result["structuredContent"]["files"]}
    assert result["structuredContent"]["workspace_id"] == "default"
    assert files["model.py"]["writable"] is False and files["model_new.py"]["writable"] is True

    r, result, _ = inspect(inspector, tmp_path, "--method", "tools/call", "--tool-name", "read_file",
                           "--tool-args-json", json.dumps({"path": "model.py"}), serve_args=task)
    assert r.returncode == 0 and result and result["isError"] is False, shown(r)
    chunk = result["structuredContent"]
    assert chunk["path"] == "model.py" and "class Model" in chunk["content"]


# the default tier: the first case; the others take the same path (a tool error as a result) and their texts are
# checked in-process by test_mcp.py::test_mistakes_come_back_as_tool_errors (full: tests/README.md)
@pytest.mark.parametrize("tool, args, says", [
    ("list_tasks", {"limit": 0}, "greater than or equal to 1"),  # fails the argument schema
    pytest.param("list_files", {}, "open_task", marks=pytest.mark.full),  # no workspace: the text says how to get one
    pytest.param("read_file", {"path": "../etc/passwd", "workspace_id": "ws-nope"}, "ws-nope", marks=pytest.mark.full),
])
def test_inspector_tool_errors_are_results(inspector, tmp_path, tool, args, says):
    """A bad call is a tool result with isError, which the Inspector reports and exits non-zero on."""
    r, result, error = inspect(inspector, tmp_path, "--method", "tools/call", "--tool-name", tool,
                               "--tool-args-json", json.dumps(args))
    assert result and result["isError"] is True, shown(r)
    assert says in text_of(result), shown(r)
    assert r.returncode != 0 and error and error["code"] == "tool_is_error", shown(r)


def test_inspector_unknown_tool(inspector, tmp_path):
    r, result, error = inspect(inspector, tmp_path, "--method", "tools/call", "--tool-name", "no_such_tool")
    assert r.returncode != 0 and result is None, shown(r)
    assert error and error["code"] == "tool_not_found" and "no_such_tool" in error["message"], shown(r)
