"""Work a worker role leaves for after its reply (sandbox/worker/protocol.py's AFTER_REPLY): it runs once the reply
is out and before the next request is taken up, its seconds come back with the next reply, and a job that fails
leaves the worker serving. A real child process serves the protocol over real pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SERVER = r"""
import sys, time
from sandbox.worker import protocol

marks = {}

def slow():
    marks["job_start"] = time.perf_counter()
    time.sleep(0.15)
    marks["job_end"] = time.perf_counter()

def broken():
    raise RuntimeError("the warm-up failed")

def setup():
    protocol.AFTER_REPLY.append(("slow", slow))
    return {"set": True}

def setup_broken():
    protocol.AFTER_REPLY.append(("broken", broken))
    protocol.AFTER_REPLY.append(("slow", slow))
    return {}

def ping():
    return {"marks": dict(marks)}

protocol.serve({"setup": setup, "setup_broken": setup_broken, "ping": ping}, int(sys.argv[1]), int(sys.argv[2]),
              after_reply=sys.argv[3] == "1")
"""


def _server(after_reply: bool):
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(p2c_r), str(c2p_w), "1" if after_reply else "0"],
                            pass_fds=(p2c_r, c2p_w),
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(p2c_r)
    os.close(c2p_w)
    w, r = os.fdopen(p2c_w, "wb"), os.fdopen(c2p_r, "rb")

    def request(op: str) -> dict:
        w.write(json.dumps({"op": op}).encode() + b"\n")
        w.flush()
        line = r.readline()
        assert line, f"the server ended answering {op}"
        return json.loads(line)

    yield request
    proc.kill()
    proc.wait()
    w.close()
    r.close()


@pytest.fixture
def server():
    yield from _server(after_reply=True)


@pytest.fixture
def candidate_server():
    yield from _server(after_reply=False)


def test_a_job_runs_after_its_reply_and_before_the_next_request_and_reports_with_the_next_reply(server):
    first = server("setup")
    assert first["ok"] and first["set"] and "after_reply" not in first
    replied_at = first["started_at"] + first["elapsed_s"]
    second = server("ping")
    marks = second["marks"]
    # the reply was sent before the job began, and the next request was taken up only after it ended
    assert replied_at <= marks["job_start"] < marks["job_end"] <= second["started_at"]
    # the seconds reported are the job's, measured around it
    assert marks["job_end"] - marks["job_start"] <= second["after_reply"]["slow"] <= second["started_at"] - replied_at
    third = server("ping")
    assert "after_reply" not in third  # reported once, and the job ran once


def test_a_failing_job_is_dropped_and_the_worker_keeps_serving(server):
    assert server("setup_broken")["ok"]
    reply = server("ping")
    assert reply["ok"] and set(reply["after_reply"]) == {"slow"}  # the job after the failed one still ran
    assert server("ping")["ok"]


def test_a_process_that_runs_candidate_code_runs_nothing_between_its_replies(candidate_server):
    """Only the task's roles run work after a reply (protocol.TASK_ROLES): in the candidate's
    process, outputs wait between its reply and the reference's comparison."""
    assert candidate_server("setup")["ok"]
    reply = candidate_server("ping")
    assert reply["marks"] == {} and "after_reply" not in reply


def test_the_roles_that_run_work_after_a_reply_never_load_candidate_code():
    from sandbox.confinement.filesystem import CANDIDATE_CAPABLE
    from sandbox.confinement.kept import KEEPABLE_ROLES
    from sandbox.worker.protocol import TASK_ROLES

    assert set(TASK_ROLES) == {"reference", "eager"} and not set(TASK_ROLES) & set(CANDIDATE_CAPABLE)
    assert set(KEEPABLE_ROLES) <= set(TASK_ROLES)


@pytest.mark.parametrize("role, runs", [("eager", True), ("reference", True), ("candidate", False), ("judged", False),
                                        ("timer", False)])
def test_a_worker_runs_work_after_replies_by_its_role(role, runs):
    """The worker's entry point hands serve its role's right to run work after a reply (serve itself replaced: it
    would serve the pipes until told to exit)."""
    script = (
        "import os, sys\n"
        "import sandbox.worker.__main__ as m\n"
        "def serve(handlers, rfd, wfd, after_reply=False):\n"
        "    print('AFTER', after_reply, flush=True)\n"
        "    os._exit(0)\n"
        "m.serve = serve\n"
        "r, w = os.pipe()\n"
        f"m.run_role({role!r}, r, w)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert f"AFTER {runs}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
