"""Files one worker hands another, carried by the judge: no process names another's /dev/shm.

A worker with a /dev/shm of its own (sandbox.confinement.mountns.private_shm) writes its exported outputs there, by
the session's path (/dev/shm/cuda-agent-XXXX/out0.bin in its view), and CUDA IPC's reference-count files by torch's
names (/dev/shm/torch_...). The reader, another worker of the same judgment, has its own /dev/shm, where that path
names nothing. So the judge, which sees every worker's folder, does the carrying: on a reply it notes where each
described file really lies (`mark`), checked to be the sender's own regular file; on a request it hard-links that
file into the receiver's folder at the same path (`deliver`), so the receiver opens it by the name it was given and a
CUDA reference count stays one file. With a CUDA IPC handle go the CUDA driver's own files of the sender
(`cuda.shm.*`), which the importer opens by name too. What a worker wrote into its reply decides nothing here: keys the judge sets are
dropped from replies first, and a path that leaves the sender's folder carries nothing (the reader then finds no
file, the sender's fault).

Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import shutil

SHM = "/dev/shm"
_FROM, _RC_FROM, _DRIVER = "_relay_from", "_relay_rc_from", "_relay_driver"  # set by the judge only
# the CUDA driver's own file for an exporting process's IPC handles (cuda.shm.<device>.<n>.<n>), which the importer
# opens by a name it reads from the handle: measured on the H200 host, an import without it fails with "mapping
# of buffer object failed"
_SHM_NAME = re.compile(r"/[A-Za-z0-9_.-]{1,200}")


def _host(view_path: str, own: str | None) -> str | None:
    """Where a path of a worker's view lies on the host: beneath its own folder where it has one."""
    path = os.path.normpath(view_path)
    if own is None or not path.startswith(SHM + "/"):  # no folder of its own: the reader opens the path as given
        return None
    host = os.path.join(own, os.path.relpath(path, SHM))
    real = os.path.realpath(host)
    if not real.startswith(os.path.realpath(own) + "/") or not os.path.isfile(real) or os.path.islink(host):
        return None
    return host


def mark(obj, own: str | None):
    """A reply of the worker whose /dev/shm is `own`, in place: each tensor's file and reference-count file noted
    with its host path (None: the worker has the host's /dev/shm, and nothing is noted)."""
    if isinstance(obj, list):
        for o in obj:
            mark(o, own)
    elif isinstance(obj, dict):
        for key in (_FROM, _RC_FROM, _DRIVER):
            obj.pop(key, None)
        if obj.get("kind") == "tensor":
            if isinstance(obj.get("file"), str):
                host = _host(obj["file"], own)
                if host:
                    obj[_FROM] = host
            ipc = obj.get("ipc")
            if isinstance(ipc, dict) and isinstance(ipc.get("ref_counter_handle"), str):
                try:
                    name = base64.b64decode(ipc["ref_counter_handle"], validate=True).decode()
                except (binascii.Error, UnicodeDecodeError):
                    name = ""
                host = _host(SHM + name, own) if _SHM_NAME.fullmatch(name) else None
                if host:
                    obj[_RC_FROM] = (host, SHM + name)
                    obj[_DRIVER] = _driver_files(own)
        for v in obj.values():
            mark(v, own)
    return obj


def _driver_files(own: str) -> list[tuple[str, str]]:
    out = []
    for name in os.listdir(own):
        host = _host(f"{SHM}/{name}", own) if name.startswith("cuda.shm.") else None
        if host:
            out.append((host, f"{SHM}/{name}"))
    return out


def _link(src: str, view_path: str, own: str | None, placed: list[str]) -> None:
    dest = os.path.join(own, os.path.relpath(os.path.normpath(view_path), SHM)) if own else view_path
    if os.path.realpath(dest) == os.path.realpath(src):
        return
    os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
    tmp = dest + ".relay"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem (a scratch outside /dev/shm): a copy; a reference count must not get here
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    placed.append(dest)


def deliver(obj, own: str | None, placed: list[str]):
    """A request's arguments for the worker whose /dev/shm is `own`: a copy without the judge's notes, each noted
    file linked into that worker's view first (the links made are appended to `placed`)."""
    if isinstance(obj, list):
        return [deliver(o, own, placed) for o in obj]
    if isinstance(obj, dict):
        out = {k: deliver(v, own, placed) for k, v in obj.items() if k not in (_FROM, _RC_FROM, _DRIVER)}
        if _FROM in obj and isinstance(obj.get("file"), str):
            _link(obj[_FROM], obj["file"], own, placed)
        for src, view_path in ([obj[_RC_FROM]] if _RC_FROM in obj else []) + obj.get(_DRIVER, []):
            _link(src, view_path, own, placed)
        return out
    return obj


def forget(placed: list[str]) -> None:
    """Remove the links a worker was given (a kept task process, before its next judgment)."""
    for path in placed:
        try:
            os.unlink(path)
        except OSError:
            pass
    placed.clear()
