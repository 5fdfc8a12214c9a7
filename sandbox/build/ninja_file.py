"""What a workspace's build.ninja says: the compile, link and header rules, the flags from the toolchain, one
build statement per source, and every name and path in it escaped as ninja and the shell require.

A source's name comes from a client: it goes into build.ninja only if it passes the workspace's name rule
(sandbox.workspace.name_problem) and a shell-safe set, escaped for ninja all the same; the machine's own paths
go into variables, shell-quoted. Each compile runs through a launcher (the object cache, or the jail alone)
and the link through the jail, so every tool that reads a client's text runs confined (sandbox/build/jail.py).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from sandbox.build import jail
from sandbox.build.objcache import ENV_INPUTS
from sandbox.build.toolchain import Toolchain
from sandbox.workspace import Workspace, WorkspaceError, name_problem

EXTENSION_NAME = "cuda_extension"
EXTENSION_FILE = f"{EXTENSION_NAME}.so"


def quote_all(items: list[str]) -> str:
    return " ".join(shlex.quote(i) for i in items)


def host_opt(tc: Toolchain) -> str:
    """The host compiler's optimisation level. On the CPU backend the .cpp sources hold the kernels: -O3. On CUDA
    they are the glue (the pybind11 binding, shape checks, launches) and the kernels are nvcc's: -O1, which halves
    GCC's optimisation and code generation of the binding's template instantiations (3.8 to 2.1 s of a 5.1 s
    compile, 3daac8d:bench/build_flags.py), and a launch's host path does not need more."""
    return "-O3" if tc.backend == "cpu" else "-O1"


def host_flags(tc: Toolchain, include_dirs: list[str]) -> list[str]:
    flags = ["-std=c++20", host_opt(tc), "-fPIC", f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(tc.cxx11_abi)}", "-Wno-unused-parameter"]
    if tc.backend == "cpu":
        flags += ["-march=native", "-fopenmp"]
    else:  # binding_registry.h brings the CUDA stream and guard headers on this backend only
        flags.append("-DCUDA_AGENT_CUDA")
    flags += [f"-I{d}" for d in include_dirs]
    for d in tc.include_dirs:
        flags += ["-isystem", d]
    return flags


THIN_DEFINE = "-DCUDA_AGENT_THIN_BINDING"


def thin_flags(tc: Toolchain, include_dirs: list[str]) -> list[str]:
    """A thin compile's flags: the host flags with pybind11 replaced by binding_registry.h's stand-in."""
    return [*host_flags(tc, include_dirs), THIN_DEFINE]


def cuda_flags(tc: Toolchain, include_dirs: list[str]) -> list[str]:
    flags = ["-std=c++20", "-O3", "-lineinfo", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(tc.cxx11_abi)}", *tc.arch_flags]
    flags += [f"-I{d}" for d in include_dirs]
    for d in tc.include_dirs:
        flags += ["-isystem", d]
    return flags


def link_flags(tc: Toolchain, stubs: Path | None = None) -> list[str]:
    """`stubs`: a folder of stand-ins for torch's libraries (sandbox/build/link_stubs.py), searched first; the
    RUNPATH names the real folders all the same."""
    # --gc-sections: the infrastructure object holds all of pybind11's members, a section each (compile.
    # infra_object); only those a binding reaches stay, with only the Python C API they import
    flags = ["-shared", "-Wl,--gc-sections"]
    if tc.linker:
        flags.append(f"-fuse-ld={tc.linker}")
    if stubs is not None:
        flags.append(f"-L{stubs}")
    for d in tc.library_dirs:
        flags += [f"-L{d}", f"-Wl,-rpath,{d}"]
    libs = [f"-l{lib}" for lib in tc.libraries]
    # a stand-in defines nothing, so a linker that drops unused libraries (--as-needed, some distributions'
    # default) would drop them all: each stays needed, as torch's libraries are loaded in every worker anyway
    flags += ["-Wl,--push-state,--no-as-needed", *libs, "-Wl,--pop-state"] if stubs is not None else libs
    if tc.backend == "cpu":
        flags.append("-fopenmp")
    return flags


RULES = """ninja_required_version = 1.3
rule cxx
  command = $launcher $cxx -MD -MF $out.d $cflags -c $in -o $out
  depfile = $out.d
  deps = gcc
  description = CXX $in
rule nvcc
  command = $launcher $nvcc --generate-dependencies-with-compile --dependency-output $out.d $cuda_cflags -c $in -o $out
  depfile = $out.d
  deps = gcc
  description = NVCC $in
rule link
  command = $jail $cxx $in $infra $ldflags -o $out
  description = LINK $out
rule objscan
  command = $objscan $out $in
  description = SCAN $out
"""
# the object scan (sandbox/scan/object_scan.py) runs between the compiles and the link: the agent's objects,
# read before pybind11's infrastructure is linked in, may not import the Python C API; a refusal stops the build
SCAN_STAMP = "objects.scanned"
_OBJECT_SCAN = Path(__file__).resolve().parent.parent / "scan" / "object_scan.py"
# A .cpp is compiled thin first (binding_registry.h's stand-in for pybind11, thin_flags); where that fails it is
# compiled again as before, and says so (FULL_MARK), while the thin compile's words are dropped: a source that does
# not compile thin is either one that uses more of pybind11, or one with an error the full compile reports itself.
FULL_MARK = "cuda-agent: compiled against the pybind11 header: "
THIN_RULE = """rule cxxthin
  command = $launcher $cxx -MD -MF $out.d $thin_cflags -c $in -o $out > $out.thin 2>&1 && cat $out.thin || { echo "FULL_MARK$in"; $launcher $cxx -MD -MF $out.d $cflags -c $in -o $out; }
  depfile = $out.d
  deps = gcc
  description = CXX $in
""".replace("FULL_MARK", FULL_MARK)
PCH_RULE = """rule pch
  command = $cxx $cflags -x c++-header $in -o $out
  description = PCH $in
"""


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def object_name(rel: str) -> str:
    """A source's object, one folder for all: its folders joined with `@`, which NAME_RULE keeps out of names,
    so two sources never share an object (kernels/a/b.cpp is a@b.cpp.o, kernels/a_b.cpp a_b.cpp.o). Every
    object ends in .cpp.o, .cc.o or .cu.o, so none is another's depfile ($out.d) or one of the build's files."""
    return rel.removeprefix("kernels/").replace("/", "@") + ".o"


# what a source's $in and $out may hold: ninja quotes them for /bin/sh itself, but names of this set need no
# quoting at all, so the build's safety rests on no quoting being right
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_./+@-]+")


def ninja_value(text: str) -> str:
    """`text` as the value of a ninja variable: `$` starts ninja's own syntax, and a line break would end the
    value and let the rest be read as ninja statements (a rule, a build edge)."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"{text!r}: a line break cannot go into build.ninja")
    return text.replace("$", "$$")


def ninja_path(path: str) -> str:
    """`path` as a path in a build statement, where a space separates paths and `:` ends the outputs."""
    return ninja_value(path).replace(" ", "$ ").replace(":", "$:")


def source_edge(ws: Workspace, src: Path, rule: str) -> tuple[str, str]:
    """The object and the build statement of one source; WorkspaceError, naming it, for a name the build cannot
    take. Workspace.sources() has refused such names already: this holds even if one slips past it."""
    rel = src.relative_to(ws.root).as_posix()
    problem = name_problem(rel)
    obj, path = object_name(rel), os.path.relpath(src, ws.build_dir)
    if problem or not (_SHELL_SAFE.fullmatch(obj) and _SHELL_SAFE.fullmatch(path)):
        raise WorkspaceError(f"cannot build {rel!r}: {problem or 'its name is not shell-safe'}; rename it")
    return obj, f"build {ninja_path(obj)}: {rule} {ninja_path(path)}"


def _launcher(objects: Path | None, max_bytes: int | None = None) -> str:
    """What runs each compile: the object cache, which confines the compiler it starts, or the jail alone."""
    if objects is None:
        return quote_all(jail.launcher())
    # run by path with -I: the script imports nothing of the package (no pydantic, no torch) per compile
    bound = ["--max-bytes", str(max_bytes)] if max_bytes is not None else []
    return quote_all([sys.executable, "-I", str(Path(__file__).with_name("objcache.py")), str(objects), *bound, "--"])


def jail_env(ws: Workspace, tc: Toolchain, infra_obj: Path) -> dict[str, str]:
    """A workspace build's environment: its compilers read the toolchain, the shared infrastructure and this
    workspace, and write only its build folder (sandbox/build/jail.py)."""
    tools = [os.path.dirname(os.path.dirname(os.path.realpath(t))) for t in (tc.cxx, tc.nvcc) if t and os.sep in t]
    read = [str(ws.root), str(infra_obj.parent), *tc.include_dirs, *tc.library_dirs, *tools]
    # the variables the object cache keys objects by are the ones compilers read: they stay
    return jail.build_env(read, [str(ws.build_dir)], str(ws.build_dir / ".tmp"), keep=ENV_INPUTS)


def write_build_file(ws: Workspace, tc: Toolchain, infra_obj: Path, pch: Path | None = None,
                     objects: Path | None = None, thin: bool = False, thin_pch: Path | None = None,
                     stubs: Path | None = None, objects_max: int | None = None) -> Path:
    """`thin`: compile each .cpp thin first (THIN_RULE), against `thin_pch` where there is one. `stubs`: link
    against these stand-ins for torch's libraries (link_flags). `objects_max`: the object cache's bound."""
    build = ws.build_dir
    build.mkdir(exist_ok=True)
    incs = [os.path.relpath(ws.root, build), os.path.relpath(ws.root / "kernels", build)]
    # the precompiled header's folder first: g++ finds binding_registry.h.gch there before the workspace's copy
    # of the same header (a source's own folder still comes first for quoted includes, as before)
    host_incs = [str(pch), *incs] if pch else incs
    # the machine's paths (the interpreter, the cache, torch's) go into variables, shell-quoted: where one holds
    # a space or a `$`, the build still runs what it means to
    values = {"launcher": _launcher(objects, objects_max), "cxx": shlex.quote(tc.cxx), "cflags": quote_all(host_flags(tc, host_incs)),
              "ldflags": quote_all(link_flags(tc, stubs)), "infra": shlex.quote(str(infra_obj)), "jail": quote_all(jail.launcher()),
              "objscan": quote_all([sys.executable, "-I", str(_OBJECT_SCAN)])}
    if thin:
        values["thin_cflags"] = quote_all(thin_flags(tc, [str(thin_pch), *incs] if thin_pch else incs))
    if tc.backend == "cuda":
        values |= {"nvcc": shlex.quote(tc.nvcc or "nvcc"), "cuda_cflags": quote_all(cuda_flags(tc, incs))}
    try:
        lines = [RULES + (THIN_RULE if thin else ""), *(f"{k} = {ninja_value(v)}" for k, v in values.items())]
        infra_dep = ninja_path(str(infra_obj))
    except ValueError as e:  # the machine's set-up, not the agent's names
        raise RuntimeError(f"the build's own paths cannot go into build.ninja: {e}") from None
    objs = []
    for src in ws.sources():
        obj, edge = source_edge(ws, src, "nvcc" if src.suffix == ".cu" else "cxxthin" if thin else "cxx")
        lines.append(edge)
        objs.append(ninja_path(obj))
    # the shared infrastructure object comes in through $infra (quoted), an implicit input so that a new one relinks
    from sandbox.scan import symbol_scan

    scanned = ""
    if symbol_scan.enabled():  # off only where tests show what the other layers see without it
        lines.append(f"build {SCAN_STAMP}: objscan {' '.join(objs)} | {ninja_path(str(_OBJECT_SCAN))}")
        scanned = f" || {SCAN_STAMP}"
    lines.append(f"build {EXTENSION_FILE}: link {' '.join(objs)} | {infra_dep}{scanned}")
    lines.append(f"default {EXTENSION_FILE}")
    path = build / "build.ninja"
    _write_if_changed(path, "\n".join(lines) + "\n")
    return path
