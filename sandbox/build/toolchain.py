"""Compiler flags and paths for building against the installed torch, and the device's name.

Probing needs `import torch` (seconds) and, on CUDA, opens the device, so it always runs in a
subprocess (`python -m sandbox.build.toolchain BACKEND`): the judge's own process (the CLI, the MCP
server's helper) never imports torch or touches a GPU. The result is cached on disk under a key made
of everything the probe's answer depends on that can change without the judge noticing (`_key_parts`);
a compile or a profile then only reads a small JSON file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

from pydantic import BaseModel

from sandbox import PACKAGE_ROOT
from sandbox.backend import cuda_visible_devices
from sandbox.config import cache_dir


class Toolchain(BaseModel):
    backend: str
    torch_version: str
    cxx: str
    nvcc: str | None = None
    include_dirs: list[str]
    library_dirs: list[str]
    libraries: list[str]
    cxx11_abi: bool
    arch_flags: list[str] = []
    device_name: str | None = None
    # what the link runs (g++'s -fuse-ld=), None for the compiler's own default (pick_linker)
    linker: str | None = None

    @property
    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    @property
    def compile_key(self) -> str:
        """The key of what the compiles depend on: all but the linker, so that the infrastructure and the objects
        compiled once serve every linker."""
        return self.model_copy(update={"linker": None}).key


# linkers faster than GNU ld, best first: a link of the example's binding took 0.23 s with GNU ld and 0.07 s with
# lld against torch's own libraries (2 cores), 0.06 and 0.035 s against their stand-ins (link_stubs). gold (0.10 s)
# and mold are not taken: they keep the imports of the sections --gc-sections drops, which the symbol scan
# refuses (tests/test_linker.py)
LINKERS = ("lld",)
LINKER_ENV = "CUDA_AGENT_LINKER"  # a name from LINKERS (or any -fuse-ld= value), or "default" for the compiler's own


def pick_linker(cxx: str) -> str | None:
    """The first linker that links a shared object with this compiler here, or None (the compiler's default):
    the one asked for by CUDA_AGENT_LINKER where it works, else the first of LINKERS that does."""
    asked = os.environ.get(LINKER_ENV, "").strip()
    if asked in ("default", "bfd"):
        return None
    for name in [asked] if asked else LINKERS:
        if links_with(cxx, name):
            return name
    if asked:
        print(f"cuda-agent: {LINKER_ENV}={asked} does not link here; the compiler's default linker is used",
              file=sys.stderr)
    return None


def links_with(cxx: str, name: str) -> bool:
    """Whether `cxx -fuse-ld=name` links a shared object, with a reference to another library, here."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cuda-agent-ld-") as tmp:
        out = Path(tmp) / "probe.so"
        try:
            r = subprocess.run([cxx, "-x", "c++", "-", "-shared", "-fPIC", f"-fuse-ld={name}", "-lm", "-o", str(out)],
                               input="#include <cmath>\ndouble probe(double x) { return std::sqrt(x); }\n",
                               capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return r.returncode == 0 and out.is_file()


def _probe(backend: str) -> Toolchain:
    import torch
    from torch.utils import cpp_extension as ce

    # torch's own CUDA lookups assume a CUDA build of torch; find the toolkit ourselves so the
    # flags can also be produced (and .cu files compiled) next to a CPU build
    home = os.environ.get("CUDA_HOME") or ce.CUDA_HOME or "/usr/local/cuda"
    includes = list(ce.include_paths("cpu"))
    libdirs = list(ce.library_paths("cpu"))
    if backend == "cuda":
        includes.append(os.path.join(home, "include"))
    includes.append(sysconfig.get_paths()["include"])
    libs = ["c10", "torch", "torch_cpu", "torch_python"]
    nvcc = None
    arch: list[str] = []
    device = None
    if backend == "cuda":
        libs += ["c10_cuda", "torch_cuda", "cudart"]
        nvcc = os.path.join(home, "bin", "nvcc")
        if not os.path.exists(nvcc):
            nvcc = shutil.which("nvcc") or nvcc
        libdirs.append(os.path.join(home, "lib64"))
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            device = torch.cuda.get_device_name()
            # the arch-specific variant (sm_90a) unlocks wgmma/setmaxnreg; the build only has to
            # run on the visible GPU
            suffix = "a" if major >= 9 else ""
            cc = f"{major}{minor}{suffix}"
            arch = [f"-gencode=arch=compute_{cc},code=sm_{cc}"]
        else:
            arch = ["-gencode=arch=compute_90a,code=sm_90a"]
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    return Toolchain(
        backend=backend,
        torch_version=torch.__version__,
        cxx=cxx,
        nvcc=nvcc,
        include_dirs=includes,
        library_dirs=libdirs,
        libraries=libs,
        cxx11_abi=bool(torch.compiled_with_cxx11_abi()),
        arch_flags=arch,
        device_name=device,
        linker=pick_linker(cxx),
    )


def _key_parts(backend: str) -> list[str]:
    """What the probe's answer depends on, each cheap to read without importing torch: the interpreter,
    which torch it finds and its version, the CUDA toolkit (CUDA_HOME, the nvcc on PATH), the compiler,
    and which GPUs the process sees (the device name keys cached baselines: a stale one would compare a
    profile against another GPU's timings)."""
    try:
        tv = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        tv = "none"
    try:  # where `import torch` would load from (PYTHONPATH can shadow the installed one); imports nothing
        spec = importlib.util.find_spec("torch")
        where = (spec.origin or "") if spec else "none"
    except (ImportError, ValueError):
        where = "none"
    gpus = Path("/proc/driver/nvidia/gpus")  # one folder per GPU, named by its PCI address
    inventory = ",".join(sorted(p.name for p in gpus.iterdir())) if gpus.is_dir() else ""
    # a judgment pinned to one of the host's GPUs (sandbox.backend.on_gpu) is probed on that GPU
    env = [cuda_visible_devices() or ""]
    env += [os.environ.get(k, "") for k in ("CUDA_DEVICE_ORDER", "CUDA_HOME", "CUDA_PATH", "CXX", LINKER_ENV)]
    # a linker installed or removed since (pick_linker)
    env += [shutil.which(f"ld.{name}") or "" for name in LINKERS]
    # torch's own fallbacks for the toolkit: the nvcc on PATH, then /usr/local/cuda (often a symlink)
    return [sys.executable, tv, where, backend, *env, shutil.which("nvcc") or "", os.path.realpath("/usr/local/cuda"),
            shutil.which("c++") or "", inventory]


def _cache_key(backend: str) -> str:
    return hashlib.sha256("\0".join(_key_parts(backend)).encode()).hexdigest()[:20]


def toolchain_cache_path(backend: str) -> Path:
    return cache_dir() / "toolchain" / f"{_cache_key(backend)}.json"


def get_toolchain(backend: str) -> Toolchain:
    path = toolchain_cache_path(backend)
    if path.is_file():
        try:
            return Toolchain.model_validate_json(path.read_text())
        except ValueError:
            pass
    # never in this process, even where torch is already imported: the probe opens the device
    env = {**os.environ, "PYTHONPATH": _pkg_root()}
    if (visible := cuda_visible_devices()) is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run([sys.executable, "-m", "sandbox.build.toolchain", backend],
                         capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"probing the torch toolchain failed:\n{out.stderr[-2000:]}")
    tc = Toolchain.model_validate_json(out.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    # unique per thread too: judges running in threads of one process probe at the same time
    tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(tc.model_dump_json())
    os.replace(tmp, path)
    return tc


def _pkg_root() -> str:
    here = PACKAGE_ROOT
    extra = os.environ.get("PYTHONPATH")
    return here + (os.pathsep + extra if extra else "")


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1]).model_dump()))
