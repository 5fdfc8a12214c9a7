"""MCP server III, cases 3, 4 and 7 as the red team ran them: two bearer-token clients of one real server process over
streamable HTTP on loopback, the CPU backend, the judge as root (as on the CI and GPU machines).

3. B's task source starts threads until it is refused and holds them; A's open_task meanwhile must work, and B
   must be stopped at the server's --process-threads.
4. B's source includes a device file; its compile fails for that reason, at once, and A's compile beside it works.
7. B's task check spins on every core; A's profile must not time beside it: the check holds the CPU's lock that a
   timing takes exclusively, so A's profile waits for it (its queue time says so) instead of timing under the load.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time

import anyio
import pytest
from test_mcp import TOKEN_A, TOKEN_B, call, http_client, write_solution
from test_mcp_tenancy import TASK_TAIL
from test_pid_limits import MECHANISMS, _full_groups

from conftest import http_mcp_server
from sandbox.confinement import pidgroup
from sandbox.timing.device_lock import device_key, lock_dir

pytestmark = pytest.mark.anyio
THREADS = 64  # the server's --process-threads: far under what the bomb tries, far over what a task check needs


# threads until refused, held for HOLD seconds so that another client works while they are, then a report
BOMB = r'''
import threading, time
threading.stack_size(32768)
n, refused, stop = 0, None, threading.Event()
try:
    while n < 4000:
        threading.Thread(target=stop.wait, daemon=True).start()
        n += 1
except (RuntimeError, OSError) as e:
    refused = type(e).__name__ + ": " + str(e)
time.sleep(__HOLD__)
stop.set()
raise RuntimeError("REPORT" + str(n) + "|" + str(refused) + "REPORT")
''' + TASK_TAIL

# every core busy for SPIN seconds (threads in C: torch's matmul releases the GIL), then a report of the times
SPIN = r'''
import os, threading, time
import torch
t0 = time.time()
def spin():
    a = torch.randn(256, 256)
    while time.time() - t0 < __SPIN__:
        a @ a
torch.set_num_threads(1)
threads = [threading.Thread(target=spin) for _ in range(max(2, os.cpu_count() or 2) * 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
raise RuntimeError("REPORT" + str(t0) + "|" + str(time.time()) + "REPORT")
''' + TASK_TAIL


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _serve(tmp_path_factory, mechanism: str = ""):
    root = tmp_path_factory.mktemp("limits-root")
    log = root.parent / f"limits-server{mechanism}.log"
    saved = os.environ.get(pidgroup.MECHANISM_ENV)
    if mechanism:  # the server's environment, and so its workers'
        os.environ[pidgroup.MECHANISM_ENV] = mechanism
    try:
        with http_mcp_server(root, log, [TOKEN_A, TOKEN_B], ["--process-threads", str(THREADS)]) as (url, proc):
            if saved is None:
                os.environ.pop(pidgroup.MECHANISM_ENV, None)
            else:
                os.environ[pidgroup.MECHANISM_ENV] = saved
            yield url, root
            proc.terminate()
            assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if saved is None:
            os.environ.pop(pidgroup.MECHANISM_ENV, None)
        else:
            os.environ[pidgroup.MECHANISM_ENV] = saved


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serve(tmp_path_factory)


@pytest.fixture(scope="module")
def server_uid(tmp_path_factory):
    """A server whose confined processes are bound by RLIMIT_NPROC under uids of their own (the GPU hosts' way)."""
    yield from _serve(tmp_path_factory, "uid")


def _report(text: str) -> list[str]:
    m = re.search(r"REPORT(.*?)REPORT", text)
    assert m, text[:3000]
    return m.group(1).split("|")


# the uid mechanism in the full suite where a cgroup serves the default tier (tests/test_pid_limits.py covers it)
@pytest.mark.parametrize("mechanism", [MECHANISMS[0], pytest.param("uid", marks=[
    *MECHANISMS[1].marks, *([pytest.mark.full] if pidgroup.base() is not None else [])])])
async def test_case_3_one_clients_thread_bomb_leaves_the_other_clients_open_task_working(mechanism, request):
    url, _ = request.getfixturevalue("server" if mechanism == "cgroup" else "server_uid")
    results: dict = {}
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        # A's first open_task also starts the server's workers (tens of seconds on a loaded 2-core CI machine,
        # where it once outlasted the bomb's hold): done before, so that the one under test is A's alone
        warm = await call(a, "open_task", {"task": "example/swish_bias"})
        await call(a, "close_workspace", {"workspace_id": warm["workspace_id"]})

        async def bomb() -> None:
            r = await b.call_tool("open_task", {"source": BOMB.replace("__HOLD__", "40"), "name": "bomb"})
            results["bomb"] = (r.is_error, r.content[0].text)

        async with anyio.create_task_group() as tg:
            tg.start_soon(bomb)
            with anyio.fail_after(120):
                while not _full_groups(THREADS - 4, mechanism):  # B's check holds every thread it may have
                    assert "bomb" not in results, results["bomb"][1][:2000]
                    await anyio.sleep(0.1)
            opened = await call(a, "open_task", {"task": "example/swish_bias"})  # while B's group is full
            assert "bomb" not in results, "B's threads were let go before A's open_task ran: the test proves nothing"
            assert opened["workspace_id"]
            await call(a, "close_workspace", {"workspace_id": opened["workspace_id"]})
    is_error, text = results["bomb"]
    assert is_error
    started, refused = _report(text)
    assert int(started) <= THREADS, text[:2000]  # the limit (over the one thread the process started with)
    assert refused != "None", text[:2000]


@pytest.mark.slow  # A's half builds the example's binding against torch's headers
async def test_case_4_a_device_file_include_fails_one_clients_compile_and_not_the_others(server):
    url, _ = server
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        ws_a = (await call(a, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        ws_b = (await call(b, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        await call(a, "write_file", {"workspace_id": ws_a, "path": "kernels/light.cpp",
                                     "content": "int light_fn() { return 42; }\n"})
        for device in ("/dev/zero",):  # /dev/urandom and the rest: tests/test_build_jail.py
            await call(b, "write_file", {"workspace_id": ws_b, "path": "kernels/zero.cpp",
                                         "content": f'#include "{device}"\n'})
            out: dict = {}

            async def compile_as(name: str, client, ws: str, out: dict = out) -> None:
                r = await client.call_tool("compile", {"workspace_id": ws})
                out[name] = r.structured_content or {"text": r.content[0].text}

            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(compile_as, "b", b, ws_b)
                tg.start_soon(compile_as, "a", a, ws_a)
            took = time.monotonic() - t0
            assert out["a"].get("ok"), out["a"]
            said = json.dumps(out["b"])
            assert not out["b"].get("ok"), said[:2000]
            # a compile error that names the file, not the build's timeout or an internal error
            assert device in said and "timeout" not in said.lower() and "internal_error" not in said, said[:2000]
            assert took < 300, took  # the build's own 600 s timeout is not what ended it
        for client, ws in ((a, ws_a), (b, ws_b)):
            await call(client, "close_workspace", {"workspace_id": ws})


def _cpu_lock_held_shared() -> bool:
    """Whether someone holds the host's CPU lock shared (a task check): an exclusive try fails while they do."""
    path = (lock_dir() / device_key("cpu")).with_suffix(".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the lock if it was taken
    return False


@pytest.mark.slow  # builds the example's extension against torch's headers and profiles it
async def test_case_7_another_clients_spinning_task_check_does_not_time_beside_a_profile(server):
    url, _ = server
    spin_s = 12
    async with http_client(url, TOKEN_A) as a, http_client(url, TOKEN_B) as b:
        ws = (await call(a, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
        await write_solution(a, ws, "cpu")
        assert (await call(a, "compile", {"workspace_id": ws}))["ok"]
        assert (await call(a, "verify", {"workspace_id": ws}))["ok"]
        await call(a, "profile", {"workspace_id": ws})  # the baseline measured and cached before the load starts
        results: dict = {}

        async def spin() -> None:
            r = await b.call_tool("open_task", {"source": SPIN.replace("__SPIN__", str(spin_s)), "name": "spin"})
            results["spin"] = r.content[0].text

        async with anyio.create_task_group() as tg:
            tg.start_soon(spin)
            with anyio.fail_after(120):
                while not _cpu_lock_held_shared():
                    assert "spin" not in results, results["spin"][:2000]
                    await anyio.sleep(0.05)
            asked = time.time()
            r = await a.call_tool("profile", {"workspace_id": ws})
            answered = time.time()
        began, ended = (float(x) for x in _report(results["spin"]))
        assert asked < ended, "B's spin ended before A asked: the test proves nothing"
        p = r.structured_content or {}
        assert p, r.content[0].text[:2000]
        # A's profile waited for B's check (nothing else here holds the CPU's lock for seconds), or said the machine
        # was noisy; without the check's hold it timed at once beside the spin (120x slower in the red team's run)
        assert p.get("queued_s", 0.0) > 1.0 or p.get("reason") == "timing_noisy", (
            p.get("queued_s"), ended - asked, p.get("reason"), p.get("message", "")[:500])
        assert answered >= ended
        await call(a, "close_workspace", {"workspace_id": ws})
