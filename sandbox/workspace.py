"""One workspace per episode: the reference, the agent's files, protected infrastructure.

Layout (the paper's convention):
    model.py            reference (protected)
    model_new.py        the agent's ModelNew
    kernels/            the agent's sources
    binding.cpp         fixed infrastructure (protected)
    binding_registry.h  fixed infrastructure (protected)
    SKILL.md            instructions (protected)
    build/              build output
    .cuda_agent/        judge state: metadata and the pristine reference
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from pydantic import BaseModel

from sandbox.backend import resolve_backend
from skills import SKILL_PATH
from tasks import Task

INFRA_DIR = Path(__file__).parent / "build" / "infra"
STATE_DIR = ".cuda_agent"
BUILD_DIR = "build"
PROTECTED = ("model.py", "binding.cpp", "binding_registry.h", "SKILL.md")
RESERVED_DIRS = (STATE_DIR, BUILD_DIR)
MAX_FILE_BYTES = 1 << 20

# The one rule for what a file the agent writes may be called. A source's name goes into build.ninja and, through
# ninja's $in, into a /bin/sh command line: a small ASCII set keeps both inert without quoting (no space, `$`,
# `:`, newline, quote or shell metacharacter), and no leading `.` or `-` keeps a part from being a hidden file (the
# writer's own temporary files start with one), `.`/`..`, or a compiler option. `@` is left out: the build uses it
# to flatten a source's folders into its object's name (sandbox/build/compile.py).
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
MAX_PATH_CHARS = 1024
NAME_RULE = ("file names may use only A-Z a-z 0-9 _ . + - in each part of the path (between the '/'s), 1 to 128 "
             "characters starting with a letter, digit or _, like kernels/relu.cu, kernels/relu_binding.cpp or "
             "kernels/sub/v2-fast.cuh")

MODEL_NEW_TEMPLATE = '''import torch
import torch.nn as nn

import cuda_extension  # built from kernels/ by `compile`


class ModelNew(nn.Module):
    """Same constructor signature and parameters as Model; all compute goes through cuda_extension."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        raise NotImplementedError("write ModelNew: see SKILL.md")

    def forward(self, *inputs):
        raise NotImplementedError
'''


class WorkspaceError(ValueError):
    """Bad path, protected file, or a workspace that is not one: an error the caller can act on."""


def name_problem(rel: str) -> str | None:
    """Why `rel` (workspace-relative, '/'-separated) may not name a file under NAME_RULE; None where it may."""
    if len(rel) > MAX_PATH_CHARS:
        return f"the path is {len(rel)} characters, over the limit of {MAX_PATH_CHARS}"
    for part in rel.split("/"):
        if not _NAME_PART.fullmatch(part):
            return f"the name part {part!r} is not allowed: {NAME_RULE}"
    return None


class WorkspaceMeta(BaseModel):
    version: int = 1
    task_id: str
    task_sha256: str
    task_path: str | None = None
    backend: str
    created: float
    protected: dict[str, str]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pristine_sources() -> dict[str, Path]:
    return {
        "binding.cpp": INFRA_DIR / "binding.cpp",
        "binding_registry.h": INFRA_DIR / "binding_registry.h",
        "SKILL.md": SKILL_PATH,
    }


def check_target(root: Path) -> None:
    """A workspace goes into a new or empty directory: anything else is the caller's mistake, said in one line."""
    if root.exists() and not root.is_dir():
        raise WorkspaceError(f"{root} exists and is not a directory: give a new or empty directory")
    if root.exists() and any(root.iterdir()):
        raise WorkspaceError(f"{root} exists and is not empty")


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        meta_path = self.root / STATE_DIR / "workspace.json"
        if not meta_path.is_file():
            raise WorkspaceError(f"{root} is not a cuda-agent workspace (no {STATE_DIR}/workspace.json); "
                                 "create one with `cuda-agent init TASK DIR`")
        try:
            self.meta = WorkspaceMeta.model_validate_json(meta_path.read_text())
        except ValueError as e:
            raise WorkspaceError(f"workspace metadata is corrupt: {e}") from None

    # ---- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, task: Task, root: str | Path, backend: str | None = None) -> Workspace:
        backend = resolve_backend(backend)
        root = Path(root)
        check_target(root)
        (root / STATE_DIR).mkdir(parents=True, exist_ok=True)
        (root / "kernels").mkdir(exist_ok=True)
        (root / BUILD_DIR).mkdir(exist_ok=True)
        (root / STATE_DIR / "reference.py").write_text(task.source)
        (root / "model.py").write_text(task.source)
        for name, src in _pristine_sources().items():
            shutil.copyfile(src, root / name)
        (root / "model_new.py").write_text(MODEL_NEW_TEMPLATE)
        protected = {name: sha256_bytes((root / name).read_bytes()) for name in PROTECTED}
        meta = WorkspaceMeta(task_id=task.id, task_sha256=task.sha256,
                             task_path=str(task.path) if task.path else None,
                             backend=backend, created=time.time(), protected=protected)
        (root / STATE_DIR / "workspace.json").write_text(meta.model_dump_json(indent=2))
        return cls(root)

    # ---- well-known paths -------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def build_dir(self) -> Path:
        return self.root / BUILD_DIR

    @property
    def backend(self) -> str:
        return self.meta.backend

    @property
    def reference_path(self) -> Path:
        """The judge's copy of the reference, checked against the task hash on every use."""
        return self.state_dir / "reference.py"

    def reference_source(self) -> str:
        try:
            source = self.reference_path.read_text()
        except OSError:
            raise WorkspaceError("the judge's reference copy is missing; re-create the workspace") from None
        if sha256_bytes(source.encode()) != self.meta.task_sha256:
            raise WorkspaceError("the judge's reference copy was modified; re-create the workspace")
        return source

    # ---- confinement ------------------------------------------------------------------------
    def resolve(self, rel: str, *, for_write: bool = False) -> Path:
        """Map a workspace-relative path to a real path inside the workspace, or refuse."""
        if not isinstance(rel, str) or not rel.strip():
            raise WorkspaceError("empty path")
        if "\x00" in rel:
            raise WorkspaceError("path contains a NUL byte")
        p = Path(rel)
        if p.is_absolute():
            raise WorkspaceError(f"{rel}: absolute paths are not allowed; use a path relative to the workspace")
        if any(part == ".." for part in p.parts):
            raise WorkspaceError(f"{rel}: '..' is not allowed; paths stay inside the workspace")
        full = self.root / p
        # follow symlinks of every existing prefix: a link may not lead out
        real = full.resolve()
        if real != self.root and self.root not in real.parents:
            raise WorkspaceError(f"{rel}: resolves outside the workspace")
        norm = real.relative_to(self.root).as_posix()
        if for_write:
            top = norm.split("/", 1)[0]
            if norm in PROTECTED:
                raise WorkspaceError(f"{norm} is protected and cannot be changed")
            if top in RESERVED_DIRS:
                raise WorkspaceError(f"{norm}: {top}/ belongs to the sandbox and cannot be written")
            if norm == ".":
                raise WorkspaceError("cannot write the workspace root")
            # both what was asked for and where it leads: a link inside the workspace may point at a folder that a
            # user made by hand outside the tools, under a name that the build would refuse
            for name in dict.fromkeys((p.as_posix(), norm)):
                problem = name_problem(name)
                if problem:
                    raise WorkspaceError(f"{rel!r}: {problem}")
        return real

    def rel(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    # ---- file access for tools --------------------------------------------------------------
    def read_text(self, rel: str) -> str:
        path = self.resolve(rel)
        if not path.is_file():
            raise WorkspaceError(f"{rel}: no such file")
        data = path.read_bytes()
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise WorkspaceError(f"{rel}: not a UTF-8 text file") from None

    def write_text(self, rel: str, content: str, *, max_bytes: int = MAX_FILE_BYTES) -> Path:
        data = content.encode()
        if len(data) > max_bytes:
            raise WorkspaceError(f"{rel}: {len(data)} bytes is over the {max_bytes}-byte file limit")
        path = self.resolve(rel, for_write=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            raise WorkspaceError(f"{rel}: is a symbolic link")
        # a name of its own per call: concurrent writers of one file (the server's threads share a pid) must
        # never write into, rename or delete each other's temporary file
        tmp = path.with_name(f".{path.name}.{os.urandom(8).hex()}.tmp")
        try:
            with open(tmp, "xb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def list_files(self) -> list[str]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel_dir = Path(dirpath).relative_to(self.root)
            if rel_dir == Path("."):
                dirnames[:] = [d for d in dirnames if d not in RESERVED_DIRS]
            dirnames.sort()
            for f in sorted(filenames):
                out.append((rel_dir / f).as_posix())
        return out

    # ---- protection -------------------------------------------------------------------------
    def ensure_protected(self) -> list[str]:
        """Restore protected files whose content changed on disk; return the ones restored."""
        reference = self.reference_source()
        pristine = {name: p.read_bytes() for name, p in _pristine_sources().items()}
        pristine["model.py"] = reference.encode()
        restored = []
        for name, expected_hash in self.meta.protected.items():
            path = self.root / name
            try:
                ok = path.is_file() and not path.is_symlink() and sha256_bytes(path.read_bytes()) == expected_hash
            except OSError:
                ok = False
            if not ok:
                if sha256_bytes(pristine[name]) != expected_hash:
                    raise WorkspaceError(f"{name} was changed and the pristine copy no longer matches; "
                                         "re-create the workspace")
                if path.is_symlink() or path.is_dir():
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                path.write_bytes(pristine[name])
                restored.append(name)
        return restored

    def sources(self) -> list[Path]:
        """The agent's translation units for this backend. Refuses (WorkspaceError) where one is named against
        NAME_RULE, e.g. a file made outside the tools: such a name never reaches the build."""
        kdir = self.root / "kernels"
        if not kdir.is_dir():
            return []
        exts = {".cu", ".cpp", ".cc"} if self.backend == "cuda" else {".cpp", ".cc"}
        out = []
        for p in sorted(kdir.rglob("*")):
            if p.suffix in exts and p.is_file():
                real = p.resolve()
                if self.root not in real.parents:
                    raise WorkspaceError(f"{p.relative_to(self.root).as_posix()}: links outside the workspace")
                out.append(p)
        bad = [(rel, problem) for rel in (p.relative_to(self.root).as_posix() for p in out)
               if (problem := name_problem(rel))]
        if bad:
            names = ", ".join(repr(rel) for rel, _ in bad)
            raise WorkspaceError(f"cannot build {names}: a source's name goes into the build's commands, and "
                                 f"{NAME_RULE}; rename or delete {'it' if len(bad) == 1 else 'them'}")
        return out

    def summary(self) -> dict:
        return json.loads(self.meta.model_dump_json())
