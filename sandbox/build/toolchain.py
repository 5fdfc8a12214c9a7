"""Compiler flags and paths for building against the installed torch.

Probing needs `import torch` (seconds), so the result is cached per interpreter, torch version,
backend and visible GPU; a compile then only runs ninja.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

from pydantic import BaseModel

from sandbox import PACKAGE_ROOT
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

    @property
    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


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
    return Toolchain(
        backend=backend,
        torch_version=torch.__version__,
        cxx=os.environ.get("CXX") or shutil.which("c++") or "g++",
        nvcc=nvcc,
        include_dirs=includes,
        library_dirs=libdirs,
        libraries=libs,
        cxx11_abi=bool(torch.compiled_with_cxx11_abi()),
        arch_flags=arch,
        device_name=device,
    )


def _cache_key(backend: str) -> str:
    try:
        tv = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        tv = "none"
    parts = [sys.executable, tv, backend, os.environ.get("CUDA_VISIBLE_DEVICES", ""), os.environ.get("CXX", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def get_toolchain(backend: str) -> Toolchain:
    path = cache_dir() / "toolchain" / f"{_cache_key(backend)}.json"
    if path.is_file():
        try:
            return Toolchain.model_validate_json(path.read_text())
        except ValueError:
            pass
    if "torch" in sys.modules:
        tc = _probe(backend)
    else:
        out = subprocess.run([sys.executable, "-m", "sandbox.build.toolchain", backend],
                             capture_output=True, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": _pkg_root()})
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
