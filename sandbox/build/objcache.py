"""Compiled objects kept by content: a translation unit compiled once is not compiled again.

Every response an RL step judges is a new workspace built from nothing, and much of what responses compile
is the same text: the binding's boilerplate, a helper header, a kernel a policy has settled on. The build's
compile rules run through this script (`python -I objcache.py DIR -- COMPILER ARGS...`, run by path, so it
imports nothing of the package: stdlib only, tens of milliseconds). As ccache's "direct mode" does, it keys
an object by the command line and the source's bytes, and keeps beside each object every header the
compiler read for it (its depfile: -MD, system headers too, since a workspace header can stand in for one
that a system header includes) with their hashes: a later compile with the same key reuses the object
only if every one of those headers still has the same content. The compiler's own output (its warnings) is
kept and printed again, so a hit reports what a compile would. A failed compile is never kept.

A depfile names the headers found, never the ones looked for and not found: `#if __has_include("cfg.h")`, or a
system header's `#include <c10/x.h>` that a workspace file `kernels/c10/x.h` would shadow, preprocess one way in
a workspace without that file and another way in one with it (Judge IX, item 4). The only places a lookup can
come out differently between two builds on one toolchain are the workspaces (the system's and the toolchain's
folders are the same for every build, and the compiler's jail keeps it out of everything else), so an entry
also keeps the names of every file and folder of the workspace outside build/ and .cuda_agent/ it was compiled
in, and is reused only where they are the same. A source that reads a workspace file spelling `__has_include`
is not kept at all, so that the plain form of that trick never depends on the names check alone.

Bounded on every store: after each one (under a lock) the least recently used keys go until the cache holds
at most its limit (`--max-bytes`); an entry bigger than the limit is not kept. Each kept entry's files are
listed in the build folder's `.objcache-kept`, so whoever owns the workspace (the MCP server) can count them
against its quota and remove them with it.

Trust: an object from here is linked into later candidates' extensions, so the build uses this cache only
where the judge's cache is out of every candidate's reach (sandbox.confinement.filesystem.
shared_caches_trusted, as for the precompiled header). The cache directory is per toolchain, and the
compiler's identity and the environment variables a compiler reads are in the key. A file that reaches
the object without a depfile naming it (an assembler `.incbin`) makes the object unkeyable: not kept.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HIT_MARK = "cuda-agent object cache: reused "  # one line per hit in the build log; compile.py reads it
VERSION = "2"
# what else a compiler reads from its environment that can change the object
ENV_INPUTS = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH", "LIBRARY_PATH",
              "SOURCE_DATE_EPOCH", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CUDA_HOME", "PATH")
# an assembler directive that puts a file's bytes in the object, a file no depfile names (ccache refuses it too)
UNKEYABLE = b".incbin"
# a probe for a header that may be absent: a workspace file that spells it makes its sources unkept (the names
# check covers it anyway; this keeps the plain form from resting on that check alone)
PROBES = (b"__has_include",)
MAX_BYTES = 2048 << 20  # the judge's shared cache (compile.py passes CUDA_AGENT_OBJECT_CACHE_MB when set)
KEPT_LIST = ".objcache-kept"  # in a build folder: the cache files its compiles stored, one absolute path a line
STATE_DIRS = ("build", ".cuda_agent")  # a workspace's folders that no name check covers (sandbox.workspace)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _file_hash(path: str) -> str | None:
    data = _read(path)
    return None if data is None else hashlib.sha256(data).hexdigest()


def _identity(exe: str) -> str:
    """The compiler binary's path, size and time: a compiler upgraded in place makes new keys."""
    where = shutil.which(exe) or exe
    try:
        st = os.stat(os.path.realpath(where))
        return f"{os.path.realpath(where)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return where


def _value_after(cmd: list[str], flags: tuple[str, ...]) -> str | None:
    for i, a in enumerate(cmd[:-1]):
        if a in flags:
            return cmd[i + 1]
    return None


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a make-style depfile (g++ -MMD, nvcc --dependency-output)."""
    body = text.replace("\\\n", " ")
    _, _, deps = body.partition(": ")
    out, cur = [], ""
    for tok in deps.split(" "):
        if tok.endswith("\\"):  # an escaped space inside a path
            cur += tok[:-1] + " "
            continue
        cur += tok
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def workspace_names(build_dir: str) -> list[str]:
    """Every file and folder of the workspace whose build folder is `build_dir`, outside build/ and .cuda_agent/:
    what an include lookup or `__has_include` in that workspace can find (folders end in "/")."""
    root = os.path.dirname(os.path.abspath(build_dir))
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d not in STATE_DIRS]
        names += [os.path.normpath(os.path.join(rel, d)) + "/" for d in dirnames]
        names += [os.path.normpath(os.path.join(rel, f)) for f in filenames]
    return sorted(names)


def _names_hash(build_dir: str) -> str:
    return hashlib.sha256("\0".join(workspace_names(build_dir)).encode()).hexdigest()


def _in_workspace(path: str, build_dir: str) -> bool:
    root = os.path.dirname(os.path.abspath(build_dir))
    full = os.path.abspath(os.path.join(build_dir, path))
    return full.startswith(root + os.sep)


def _key(cmd: list[str], out: str, dep: str, source: str) -> str | None:
    src = _file_hash(source)
    if src is None:
        return None
    neutral = [("<out>" if a == out else "<dep>" if a == dep else a) for a in cmd]
    host = _identity("c++") if "nvcc" in os.path.basename(cmd[0]) else ""
    env = [os.environ.get(k, "") for k in ENV_INPUTS]
    parts = [VERSION, _identity(cmd[0]), host, json.dumps(neutral), json.dumps(env), src]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _lookup(folder: str, out: str, dep: str, ws_names: str) -> str | None:
    """A kept entry compiled among the same workspace names whose headers all still hash the same: copies its
    object and depfile into place and returns the compiler output kept with it."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if entry.get("names") == ws_names and all(_file_hash(p) == h for p, h in entry["deps"].items()):
            obj = os.path.join(folder, entry["object"])
            try:
                _atomic_copy(obj, out)
            except OSError:
                continue
            with open(dep, "w") as f:
                f.write(entry["depfile"])
            os.utime(obj)  # recently used: prune() keeps it
            return entry["output"]
    return None


def _atomic_copy(src: str, dst: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)) or ".", prefix=".objcache-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def _store(root: str, folder: str, out: str, dep: str, output: str, names: str, max_bytes: int) -> str | None:
    """Keep the object under `folder` and bound the cache at `root`; why it was not kept, or None."""
    with open(dep) as f:
        text = f.read()
    build_dir = os.path.dirname(os.path.abspath(out))
    deps = {}
    for p in parse_depfile(text):
        data = _read(p)
        if data is None or UNKEYABLE in data:
            return "a header it read is gone" if data is None else "it reads a file no depfile names"
        if _in_workspace(p, build_dir) and any(probe in data for probe in PROBES):
            return f"{p} asks whether a header exists (__has_include)"
        deps[p] = hashlib.sha256(data).hexdigest()
    size = os.path.getsize(out)
    if size > max_bytes:
        return f"the object's {size} bytes are over the cache's limit of {max_bytes}"
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with _locked(root):
        obj_hash = _file_hash(out)
        obj_path = os.path.join(folder, f"{obj_hash}.o")
        _atomic_copy(out, obj_path)
        # the depfile as written: its paths are relative to the build folder, the same in every workspace
        entry = {"deps": deps, "names": names, "object": f"{obj_hash}.o", "output": output, "depfile": text}
        name = hashlib.sha256(json.dumps([deps, names], sort_keys=True).encode()).hexdigest()[:24]
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".entry-")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        entry_path = os.path.join(folder, f"{name}.json")
        os.replace(tmp, entry_path)
        _record(build_dir, [entry_path, obj_path])
        prune(root, max_bytes)
    return None


class _locked:
    """The cache's lock: stores and prunes one at a time, so that no two prunes each see room the other took."""

    def __init__(self, root: str):
        self._path = os.path.join(root, ".lock")

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _record(build_dir: str, paths: list[str]) -> None:
    # one write of a few hundred bytes with O_APPEND: parallel compiles of one build never interleave lines
    fd = os.open(os.path.join(build_dir, KEPT_LIST), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, "".join(p + "\n" for p in paths).encode())
    finally:
        os.close(fd)


def prune(root: str, max_bytes: int = MAX_BYTES) -> None:
    """Drop the least recently used keys until the cache holds at most `max_bytes`."""
    keys = []
    for shard in os.listdir(root):
        for name in os.listdir(os.path.join(root, shard)) if os.path.isdir(os.path.join(root, shard)) else []:
            path = os.path.join(root, shard, name)
            try:
                stats = [os.stat(os.path.join(path, f)) for f in os.listdir(path)]
            except OSError:  # removed meanwhile (the server closing a workspace drops its entries)
                continue
            if stats:
                keys.append((max(s.st_mtime for s in stats), sum(s.st_size for s in stats), path))
    total = sum(k[1] for k in keys)
    for _, size, path in sorted(keys):
        if total <= max_bytes:
            break
        shutil.rmtree(path, ignore_errors=True)
        total -= size


def main(argv: list[str]) -> int:
    # run by path with -I: the jail is reached through the package, which imports only the standard library
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from sandbox.build.jail import confine_here

    max_bytes = MAX_BYTES
    if len(argv) > 2 and argv[1] == "--max-bytes":
        max_bytes, argv = int(argv[2]), [argv[0], *argv[3:]]
    root, sep, *cmd = argv
    if sep != "--" or not cmd:
        print("usage: objcache.py DIR [--max-bytes N] -- COMPILER ARGS...", file=sys.stderr)
        return 2
    out = _value_after(cmd, ("-o",))
    dep = _value_after(cmd, ("-MF", "--dependency-output"))
    source = _value_after(cmd, ("-c",))
    key = _key(cmd, out, dep, source) if out and dep and source else None
    if key is None:
        return subprocess.call(cmd, preexec_fn=confine_here)
    folder = os.path.join(root, key[:2], key)
    names = _names_hash(os.path.dirname(os.path.abspath(out)))
    kept = _lookup(folder, out, dep, names)
    if kept is not None:
        sys.stdout.write(kept + f"{HIT_MARK}{source}\n")
        return 0
    # the compiler runs confined (it reads what a client wrote); this process, which keeps the cache, does not
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=confine_here)
    output = proc.stdout.decode(errors="replace")
    sys.stdout.write(output)
    if proc.returncode == 0:
        try:
            why = _store(root, folder, out, dep, output, names, max_bytes)
            if why:
                print(f"cuda-agent object cache: not kept ({why})")
        except OSError as e:  # a full disk costs the next build time, never this one
            print(f"cuda-agent object cache: not kept ({e})", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
