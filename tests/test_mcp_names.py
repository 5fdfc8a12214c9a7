"""File names over the real HTTP server, with two clients: the one rule for names (sandbox/workspace.py) refuses
a name that would have gone into build.ninja or a shell command, both where it is written and where a file with
such a name was made on the server's disk by other means; the other client sees none of it.

One real build (client B's solution): the refusals cost no compile.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mcp import TOKEN_A, TOKEN_B, call, http_client, tool_error, write_solution

from conftest import http_mcp_server

# full suite only (tests/README.md): a real HTTP server and a build; the names rule itself is tested in the default
# tier by test_workspace.py and test_compile.py, the HTTP server by test_mcp.py
pytestmark = [pytest.mark.anyio, pytest.mark.full]

RULE = "may use only A-Z a-z 0-9 _ . + -"
# each of these, written by a client, would have reached build.ninja (and from there /bin/sh) as it is
BAD_NAMES = [
    "kernels/x.cpp\nrule pwn\n  command = touch PWNED\nbuild PWNED: pwn\ndefault PWNED\n#.cpp",  # a ninja rule
    "kernels/price$cxx.cpp",  # a ninja variable
    "kernels/my kernel.cpp",  # a space: two paths to ninja
    "kernels/a;touch PWNED;.cpp",  # shell text
    "kernels/$(touch PWNED).cpp",
    "kernels/`touch PWNED`.cpp",
    "kernels/relu\u200b.cpp",  # a zero-width space: looks like relu.cpp
    "kernels/\u0440elu.cpp",  # a Cyrillic er: looks like relu.cpp
    "kernels/relu\u202e.cpp",  # a right-to-left override
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def names_server(tmp_path_factory):
    """A real server process accepting two tokens; yields its URL and its --root, where workspaces live."""
    root = tmp_path_factory.mktemp("names-root")
    log = root.parent / "names-server.log"
    with http_mcp_server(root, log, [TOKEN_A, TOKEN_B]) as (url, proc):
        yield url, root
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()


async def test_bad_names_are_refused_and_never_reach_the_build(names_server):
    url, root = names_server
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        ws_a = (await call(a, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        ws_b = (await call(b, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        await write_solution(a, ws_a, "cpu")

        for name in BAD_NAMES:
            err = await tool_error(a, "write_file", {"workspace_id": ws_a, "path": name, "content": "int x;\n"})
            assert RULE in err and repr(name) in err, (name, err)
        # a good name with the characters the rule allows beyond letters and digits
        await call(a, "write_file", {"workspace_id": ws_a, "path": "kernels/v2-fast+x.h", "content": "#pragma once\n"})
        listed = [f["path"] for f in (await call(a, "list_files", {"workspace_id": ws_a}))["files"]]
        assert "kernels/v2-fast+x.h" in listed
        assert not [p for p in listed if "PWNED" in p or " " in p or "$" in p or not p.isascii()], listed

        # the same names made on the server's disk by other means (a CLI user, a script): listed, not writable,
        # and the compile refuses them by name before ninja runs anything
        ws_root = root / ws_a
        assert (ws_root / ".cuda_agent" / "workspace.json").is_file()
        planted = ["kernels/x.cpp\nrule pwn\n  command = touch PWNED\nbuild PWNED: pwn\ndefault PWNED\n#.cpp",
                   "kernels/y`>PWNED`.cpp", "kernels/my kernel.cpp"]
        (ws_root / "kernels" / "x.cpp").write_text("int x_fn() { return 1; }\n")
        for name in planted:
            (ws_root / name).write_text("int planted;\n")
        files = {f["path"]: f["writable"] for f in (await call(a, "list_files", {"workspace_id": ws_a}))["files"]}
        assert all(files[name] is False for name in planted), files
        err = await tool_error(a, "edit_file", {"workspace_id": ws_a, "path": "kernels/my kernel.cpp",
                                                "old_text": "planted", "new_text": "changed"})
        assert RULE in err
        c = await call(a, "compile", {"workspace_id": ws_a})
        assert not c["ok"] and c["reason"] == "compile_error", c
        assert c["message"].startswith("cannot build ") and RULE in c["message"], c["message"]
        for name in planted:
            assert repr(name) in c["message"], (name, c["message"])
        assert "0 error(s)" not in c["message"] and "'kernels/x.cpp'" not in c["message"]
        assert not list(ws_root.rglob("PWNED*")), "a command from a file name ran"
        assert not (ws_root / "build" / "build.ninja").exists(), "the build file was written"

        # client B: its own workspace, none of A's files, and its build is not disturbed by them
        seen_b = [f["path"] for f in (await call(b, "list_files", {"workspace_id": ws_b}))["files"]]
        assert not [p for p in seen_b if p.startswith("kernels/")], seen_b
        assert "unknown workspace" in await tool_error(b, "list_files", {"workspace_id": ws_a})
        await write_solution(b, ws_b, "cpu")
        built = await call(b, "compile", {"workspace_id": ws_b})
        assert built["ok"], built
        assert not list(root.rglob("PWNED*"))
        for client, ws in ((a, ws_a), (b, ws_b)):
            await call(client, "close_workspace", {"workspace_id": ws})
    assert not Path(ws_root).exists()
