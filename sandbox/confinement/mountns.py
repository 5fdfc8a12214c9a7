"""The filesystem fallback where Landlock is missing: a private mount namespace in which every mount is
read-only except the worker's scratch directory and the exchange area, and the judge's cache is hidden.

Made at worker start while the process has one thread (a user namespace needs that): as root with
CLONE_NEWNS alone, otherwise inside a new user namespace that maps the user to itself. The candidate
cannot undo it: the seccomp filter of `sandbox.confinement.limits` refuses mount, umount, unshare, setns and the
new mount API before any candidate code runs. Reads are not confined (other workspaces stay
readable); writes are, which is what the cache-poisoning exploit needs.
"""

from __future__ import annotations

import ctypes
import os
import shutil

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
         "relatime": 1 << 21, "strictatime": 1 << 24}  # flags a user namespace may not drop on remount


class MountError(OSError):
    pass


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _enc(s: str | None) -> bytes | None:
    return s.encode() if s is not None else None


def _mount(libc, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = _enc
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"mount {target}: {os.strerror(err)}")


def _enter(libc) -> None:
    if libc.unshare(_CLONE_NEWNS) == 0:
        return
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"unshare: {os.strerror(err)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every mount, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape")  # \040 for spaces
            keep = 0
            for opt in parts[5].split(","):
                keep |= _KEEP.get(opt, 0)
            out.append((point, keep))
    return out


def confine(writable: list[str], hidden: list[str]) -> None:
    """Raises MountError where the namespace cannot be made (then nothing was changed on the host)."""
    libc = _libc()
    _enter(libc)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    for point, keep in _mounts():
        try:
            _mount(libc, None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)
        except MountError:
            if point == "/":
                raise
    mounts = _mounts()
    for path in writable:
        if os.path.isdir(path):
            real = os.path.realpath(path)
            keep = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
                       key=lambda m: len(m[0]))[1]
            _mount(libc, real, real, None, MS_BIND | MS_REC)
            _mount(libc, None, real, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | keep)
    for path in hidden:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0")


SHM = "/dev/shm"
OWN_SHM = "shm"  # the folder inside a worker's scratch that is its /dev/shm
_MNT_DETACH = 2


def private_shm(scratch: str) -> str | None:
    """Give this process (one thread: every later thread shares it) a /dev/shm of its own: the folder `OWN_SHM` in
    its scratch, bound over /dev/shm in a private mount namespace, with the scratch bound again at its own path when
    it lay beneath /dev/shm. Returns that folder's host path, or None where the namespace cannot be made (not root),
    with nothing changed.

    Why: the host's /dev/shm holds every judgment's exchange files, and a process that may name a folder there may
    watch it (inotify needs only a path lookup) and open what Landlock grants beneath it; CUDA IPC's reference
    counts (torch creates them with shm_open) had made /dev/shm writable to candidates and tasks alike. Here a
    process names its own files only; the judge links what another process of its judgment must read into that
    process's folder (sandbox.confinement.worker_process.Worker.send)."""
    if not os.path.isdir(SHM):
        return None
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:  # as root (or with CAP_SYS_ADMIN) only: no user namespace for this
        return None
    scratch = os.path.realpath(scratch)
    own = os.path.join(scratch, OWN_SHM)
    keep = -1
    try:
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
        os.mkdir(own, 0o700)
        keep = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # opened in this namespace: bindable
        _mount(libc, own, SHM, None, MS_BIND | MS_NOSUID | MS_NODEV)
        if scratch.startswith(SHM + "/"):
            inner = os.path.join(SHM, os.path.relpath(scratch, SHM))
            os.makedirs(inner, mode=0o700, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{keep}", inner, None, MS_BIND)
    except OSError:
        libc.umount2(SHM.encode(), _MNT_DETACH)  # this namespace's own: the host's /dev/shm is as it was
        shutil.rmtree(own, ignore_errors=True)
        return None
    finally:
        if keep >= 0:
            os.close(keep)
    return own
