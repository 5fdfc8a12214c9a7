"""The judge carries files between a judgment's workers (sandbox/confinement/relay.py), and the exchange area keeps
nothing of a process that is gone (sandbox/confinement/environment.py): issue 69, cases 1, 2 and 7b."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

from sandbox.confinement import relay

ROOT = Path(__file__).resolve().parents[1]


def _spec(path: str, rc: str | None = None) -> dict:
    spec = {"kind": "tensor", "dtype": "float32", "shape": [4], "device": "cpu", "file": path}
    if rc is not None:
        spec["ipc"] = {"ref_counter_handle": base64.b64encode(rc.encode()).decode()}
    return spec


def test_a_file_goes_from_the_senders_folder_to_the_readers_at_the_same_path(tmp_path):
    sender, reader = tmp_path / "a" / "shm", tmp_path / "b" / "shm"
    (sender / "cuda-agent-x").mkdir(parents=True)
    (sender / "cuda-agent-x" / "out0.bin").write_bytes(b"1234")
    (sender / "torch_1_2_0").write_bytes(b"rc")
    (sender / "cuda.shm.0.542.1").write_bytes(b"driver")  # the CUDA driver's file for the sender's IPC handles
    reply = {"ok": True, "outputs": {"kind": "tuple", "items": [
        _spec("/dev/shm/cuda-agent-x/out0.bin", rc="/torch_1_2_0")]}}
    relay.mark(reply, str(sender))
    placed: list[str] = []
    sent = relay.deliver({"outputs": reply["outputs"]}, str(reader), placed)
    assert "_relay_from" not in str(sent) and "_relay_rc_from" not in str(sent)  # the notes never reach a worker
    assert sent["outputs"]["items"][0]["file"] == "/dev/shm/cuda-agent-x/out0.bin"
    got = reader / "cuda-agent-x" / "out0.bin"
    assert got.read_bytes() == b"1234"
    assert os.stat(got).st_ino == os.stat(sender / "cuda-agent-x" / "out0.bin").st_ino  # one file, not a copy
    assert os.stat(reader / "torch_1_2_0").st_ino == os.stat(sender / "torch_1_2_0").st_ino  # one reference count
    assert (reader / "cuda.shm.0.542.1").read_bytes() == b"driver"
    relay.forget(placed)
    assert not got.exists() and placed == []


def test_what_a_worker_writes_in_its_reply_carries_nothing_from_outside_its_folder(tmp_path):
    sender, reader = tmp_path / "a" / "shm", tmp_path / "b" / "shm"
    sender.mkdir(parents=True)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    (sender / "link.bin").symlink_to(secret)
    specs = [
        _spec("/dev/shm/../../" + str(secret)),  # out of its folder by name
        _spec("/dev/shm/link.bin"),  # out of its folder by a symbolic link
        _spec(str(secret)),  # not in /dev/shm at all
        _spec("/dev/shm/missing.bin", rc="/../../etc/passwd"),  # a reference-count name with a path in it
        {**_spec("/dev/shm/x.bin"), "_relay_from": str(secret), "_relay_rc_from": [str(secret), "/dev/shm/y"],
         "_relay_driver": [[str(secret), "/dev/shm/z"]]},
    ]
    reply = relay.mark({"outputs": {"kind": "list", "items": specs}}, str(sender))
    placed: list[str] = []
    relay.deliver(reply, str(reader), placed)
    assert placed == [] and not reader.exists(), placed


def test_a_worker_without_a_folder_of_its_own_gets_paths_as_they_are(tmp_path):
    reply = relay.mark({"outputs": _spec(str(tmp_path / "out0.bin"))}, None)
    placed: list[str] = []
    assert relay.deliver(reply, None, placed) == {"outputs": _spec(str(tmp_path / "out0.bin"))} and placed == []


_JUDGE = """
import os, sys
from sandbox.confinement import environment
environment.exchange_base = lambda: sys.argv[2]
d = environment.exchange_dir()
(d / "out0.bin").write_bytes(b"x" * 1024)
print(environment.process_folder(), flush=True)
os._exit(0) if sys.argv[1] == "exit" else os.kill(os.getpid(), 9)
"""


def _judging_process(how: str, base: Path) -> Path:
    out = subprocess.run([sys.executable, "-c", _JUDGE, how, str(base)], capture_output=True, text=True, cwd=ROOT)
    return Path(out.stdout.strip())


def test_a_judging_process_that_died_past_its_exit_handlers_leaves_nothing_after_the_next_start(tmp_path,
                                                                                                monkeypatch):
    from sandbox.confinement import environment

    monkeypatch.setattr(environment, "exchange_base", lambda: str(tmp_path))
    monkeypatch.setattr(environment, "_PROCESS", {"pid": None, "dir": None, "fd": -1})  # this process's own, anew
    # os._exit skips the exit handlers (the MCP helper cancelled mid-check, case 7b); SIGKILL skips everything
    exited = _judging_process("exit", tmp_path)
    assert exited.is_dir() and exited.parent == tmp_path and (exited / ".owner").is_file(), exited
    killed = _judging_process("kill", tmp_path)  # its start swept the first one
    assert killed.is_dir() and not exited.exists(), (exited, killed)
    live = tmp_path / "cuda-agent-someone-elses"  # a live process's folder: its lock is held
    live.mkdir()
    (live / ".owner").touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(live)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        old = tmp_path / "cuda-agent-abcd1234"  # an older version's folder, without an owner mark: left alone
        old.mkdir()
        mine = environment.process_folder()
        assert not killed.exists()
        assert live.is_dir() and old.is_dir() and Path(mine).is_dir()
        environment.remove_process_folder()
        assert not Path(mine).exists()
    finally:
        holder.kill()
        holder.wait()
