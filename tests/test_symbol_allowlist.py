"""The symbol scan's allow-list (sandbox/scan/symbol_allowlist.py) on real ELF files.

Shared objects are built here with the compiler the judge uses, importing exact names (asm labels) and
linked like an extension (RUNPATH torch's lib/, so the scan can ask which library defines a name): each
refused family's examples must be refused under that family, the imports of honest builds must pass, and
an undefined function of the agent's own must be left to the import. Every honest extension of the
repository is built and scanned: the CPU ones through compile_workspace, the CUDA ones with nvcc. The rule
as agents read it must be the same block in skills/SKILL.md and docs/judge-evidence.md, listing the scan's families.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox.api import compile_workspace, init_workspace
from sandbox.build import pybind_interface
from sandbox.build.compile import INFRA_SECTIONS, extension_path
from sandbox.build.ninja_file import cuda_flags, host_flags, thin_flags
from sandbox.build.toolchain import Toolchain, get_toolchain
from sandbox.scan import object_scan, symbol_scan
from sandbox.scan.symbol_allowlist import FAMILIES, classify, qualified_name
from sandbox.workspace import INFRA_DIR, Workspace

REPO = Path(__file__).resolve().parent.parent
HONEST_IMPORTS = REPO / "tests" / "fixtures" / "symbols" / "honest_imports.txt"
RULE = re.compile(r"<!-- symbol-rule[^\n]*-->\n(.*?)<!-- /symbol-rule -->", re.S)


@pytest.fixture(scope="module")
def cpu_tc() -> Toolchain:
    return get_toolchain("cpu")


def importing(symbols: list[str], out: Path, tc: Toolchain) -> Path:
    """A shared object whose undefined dynamic symbols are exactly `symbols`, with the extension's RUNPATH."""
    decls = "".join(f'extern "C" void ref{i}() __asm__("{s}");\n' for i, s in enumerate(symbols))
    refs = ", ".join(f"(void*)&ref{i}" for i in range(len(symbols)))
    src = decls + f'extern "C" void* const imported[] = {{{refs}}};\n'
    rpath = [f"-Wl,-rpath,{d}" for d in tc.library_dirs]
    # -nostdlib: no library resolves anything at link (some toolchains link parts of libstdc++ statically)
    subprocess.run([tc.cxx, "-shared", "-nostdlib", "-fPIC", "-x", "c++", "-", "-o", str(out), *rpath], input=src,
                   text=True, check=True, capture_output=True)
    assert symbol_scan.imported_symbols(out) >= set(symbols)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_examples_are_refused_from_a_real_elf(family, cpu_tc, tmp_path):
    examples = list(FAMILIES[family].examples)
    so = importing(examples, tmp_path / f"{family}.so", cpu_tc)
    assert symbol_scan.refusals(symbol_scan.imported_symbols(so), so) == {family: sorted(examples)}
    msg = symbol_scan.scan(so)
    assert msg is not None and FAMILIES[family].label in msg and FAMILIES[family].advice in msg, msg
    assert symbol_scan.display_names(sorted(examples)[:1])[0] in msg


def test_what_honest_builds_import_passes(cpu_tc, tmp_path):
    names = [ln for ln in HONEST_IMPORTS.read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(names) > 300
    so = importing(names, tmp_path / "honest.so", cpu_tc)
    assert symbol_scan.refusals(symbol_scan.imported_symbols(so), so) == {}
    assert symbol_scan.scan(so) is None


def test_an_undefined_function_of_the_agents_own_is_left_to_the_import(cpu_tc, tmp_path):
    """A launcher declared in the binding but never defined (or defined under another signature) is no
    library's: the scan passes it and the import reports the undefined symbol, as SKILL.md explains. The same
    names refused once a library defines them: `sgemm_` next to the agent's own `scale_`."""
    own = ["_Z14launch_missingPf", "launch_relu_c", "scale_", "_ZN2my6kernel3runEPf"]
    assert symbol_scan.scan(importing(own, tmp_path / "own.so", cpu_tc)) is None
    so = importing([*own, "sgemm_", "uv_tcp_connect"], tmp_path / "lib.so", cpu_tc)
    assert symbol_scan.refusals(symbol_scan.imported_symbols(so), so) == {"blas": ["sgemm_"],
                                                                        "not_allowed": ["uv_tcp_connect"]}
    # without the extension to ask, nothing on no list passes (the conservative answer)
    assert symbol_scan.forbidden({"launch_relu_c"}) == ["launch_relu_c"]


@pytest.mark.parametrize(("symbol", "family"), [
    ("_ZNK2at10TensorBase8data_ptrIdEEPT_v", None),  # its letters run "...ptrIdEEPT": no library's name inside
    ("_ZNK2at6Tensor4itemIfEET_v", None),
    ("_ZNK2at6Tensor5relu_Ev", "aten_compute"),
    ("_ZN2at4_ops10empty_like10redispatchEN3c1014DispatchKeySetERKNS_6TensorE", "dispatcher"),  # an allowed op too
    ("_ZN2at4_ops15unfold_backward4callERKNS_6TensorEN3c108ArrayRefINS4_6SymIntEEElll", "aten_compute"),
    ("_ZN2at4_ops9to_mkldnn4callERKNS_6TensorESt8optionalIN3c1010ScalarTypeEE", "cpu_kernel_libraries"),
    ("_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE", None),  # torch/extension.h under nvcc
    ("_ZN3c104impl26raw_local_dispatch_key_setE", "dispatcher"),
    ("_ZTHN3c104impl26raw_local_dispatch_key_setE", "dispatcher"),
    ("_ZN3c1010TensorImplC1ENS_7StorageENS_14DispatchKeySetEN6caffe28TypeMetaE", None),
    ("_ZN2at6detail13empty_genericEN3c108ArrayRefIlEEPNS1_9AllocatorENS1_14DispatchKeySetENS1_10ScalarTypeESt8optionalINS1_12MemoryFormatEE",
     "dispatcher"),
    ("_ZN2at4cuda25getCurrentCUDABlasHandleEv", "cuda_libraries"),
    ("_ZN3c104cuda20getCurrentCUDAStreamEa", None),
    # a std:: instantiation libtorch exports, not libstdc++: std:: passes only where the runtime defines it
    ("_ZNSt10_HashtableIN2at6native21LapackLstsqDriverTypeESt4pairIKS2_PFvciiiPdiS5_iS5_iPiS6_dS6_S5_S5_S6_EESaIS9_"
     "ENSt8__detail10_Select1stESt8equal_toIS2_ESt4hashIS2_ENSB_18_Mod_range_hashingENSB_20_Default_ranged_hashENSB_"
     "20_Prime_rehash_policyENSB_17_Hashtable_traitsILb0ELb0ELb1EEEE9_M_rehashEmRKm", "not_allowed"),
    ("_ZNSt6localeD1Ev", None), ("_Znwm", None), ("expf", None), ("pthread_create", None), ("stderr", None),
    ("__tls_get_addr", None), ("syscall", None), ("dladdr", None), ("PyFrame_GetBack", None),
    ("dl_iterate_phdr", "dynamic_loader"), ("__libc_dlopen_mode", "dynamic_loader"),
    ("cpuinfo_initialize", "not_allowed"), ("Sleef_expf8_u10", "vector_math"), ("cblas_sgemm", "blas"),
])
def test_classify(symbol, family):
    assert classify(symbol) == family


def test_qualified_names():
    assert qualified_name("_ZNK2at10TensorBase8data_ptrIfEEPT_v") == ("at", "TensorBase", "data_ptr")
    assert qualified_name("_ZN3c10lsERSoRKNS_6DeviceE") == ("c10", "ls")
    assert qualified_name("_ZN3c108toStringB5cxx11ERKNS_12OperatorNameE") == ("c10", "toString")
    assert qualified_name("_ZTIN3c105ErrorE") == ("c10", "Error")
    assert qualified_name("_ZN2at4_ops4relu10redispatchEN3c1014DispatchKeySetERKNS_6TensorE") == (
        "at", "_ops", "relu", "redispatch")
    assert qualified_name("_Z16THPVariable_WrapRKN2at10TensorBaseE") == ("THPVariable_Wrap",)
    assert qualified_name("sgemm_") is None


# --- the rule as agents read it ---------------------------------------------------------------------------

def _rule(path: Path) -> str:
    m = RULE.search(path.read_text())
    assert m, f"{path} has no symbol-rule block"
    return m.group(1)


def test_the_rule_is_one_block_in_skill_and_judge_listing_the_scans_families():
    skill, judge = _rule(REPO / "skills" / "SKILL.md"), _rule(REPO / "docs" / "judge-evidence.md")
    assert skill == judge
    rows = [ln for ln in skill.splitlines() if ln.startswith("| `")]
    keys = [re.match(r"\| `(\w+)`", ln).group(1) for ln in rows]
    assert keys == list(FAMILIES)
    for key, row in zip(keys, rows, strict=True):
        shown = set(re.findall(r"`([^`]+)`", row.split("|")[2]))
        examples = set(FAMILIES[key].examples) | set(symbol_scan.display_names(list(FAMILIES[key].examples)))
        assert shown & examples, (key, shown)  # a real example, refused from a real ELF above
    for word in ("cuBLAS", "CUTLASS", "forbidden_symbol", "dispatcher", "Sleef", "fbgemm"):
        assert word in skill


def test_skill_md_no_longer_says_cuda_libraries_are_allowed():
    text = (REPO / "skills" / "SKILL.md").read_text()
    for sentence in re.split(r"(?<=[.;])\s", text.replace("\n", " ")):
        if re.search(r"cuBLAS|cuDNN|cublas", sentence):
            assert "allowed" not in sentence or "refused" in sentence, sentence


# --- every honest extension of the repository ------------------------------------------------------------

def test_honest_cpu_extensions_pass(built_example_workspace, built_cpu_workspace, small_task_path, tmp_path):
    """The bundled solution and the multi-variant fixture (built once for the session, through the scan), and
    a file that uses as much of the tensor plumbing as an honest CPU kernel might."""
    for root in (built_example_workspace, built_cpu_workspace):
        assert symbol_scan.scan(extension_path(Workspace(root))) is None
    ws, _ = init_workspace(str(small_task_path), tmp_path / "plumbing", backend="cpu", check=False)
    shutil.copytree(REPO / "tests" / "fixtures" / "symbols" / "cpu_plumbing" / "kernels", ws.root / "kernels",
                    dirs_exist_ok=True)
    r = compile_workspace(ws)
    assert r.ok, (r.reason, r.message, r.log_tail)
    assert symbol_scan.scan(extension_path(ws)) is None


def _pyelftools_symbols(path: Path) -> tuple[set[str], set[str]]:
    """What the scan read before it decoded the tables itself: pyelftools' own symbols, undefined and functions."""
    from elftools.elf.elffile import ELFFile

    undefined, functions = set(), set()
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        for name in (".dynsym", ".symtab"):
            sec = elf.get_section_by_name(name)
            for sym in sec.iter_symbols() if sec is not None else ():
                if sym.name and sym["st_shndx"] == "SHN_UNDEF":
                    undefined.add(sym.name.split("@", 1)[0])
                elif sym.name and sym["st_info"]["type"] == "STT_FUNC":
                    functions.add(sym.name)
    return undefined, functions


def test_the_scans_own_table_reader_reads_what_pyelftools_reads(built_example_workspace, built_cpu_workspace):
    """The symbol tables are decoded with struct (pyelftools took a second a build for a CUDA extension): the
    same names, on extensions, their objects, the shared infrastructure object and a torch library."""
    import torch

    files = [extension_path(Workspace(r)) for r in (built_example_workspace, built_cpu_workspace)]
    files += sorted((built_cpu_workspace / "build").glob("*.o"))[:2]
    files += [Path(torch.__file__).parent / "lib" / "libc10.so"]
    for path in files:
        undefined, functions = _pyelftools_symbols(path)
        assert undefined or functions, path
        assert symbol_scan.imported_symbols(path) == undefined, path
        assert symbol_scan.defined_functions(path) == functions, path


def _cuda_solutions() -> dict[str, Path]:
    dirs = [*(REPO / "tasks" / "examples" / "solutions").glob("*/cuda/kernels"),
            *(REPO / "bench" / "solutions").glob("*/kernels"), REPO / "tests" / "fixtures" / "cuda_multi" / "kernels",
            *(REPO / "tests" / "fixtures" / "harness" / "solutions").rglob("kernels"),
            REPO / "tests" / "exploits" / "cuda_kernels", REPO / "tests" / "fixtures" / "symbols" / "cuda_plumbing" / "kernels",
            REPO / "tests" / "fixtures" / "symbols" / "honest_idioms_cuda" / "kernels"]
    return {str(d.relative_to(REPO)): d for d in sorted(dirs) if any(d.glob("*.cu"))}


def _kernelbench_style(tmp: Path) -> Path:
    from harness.inline_convert import convert_load_inline

    src = REPO / "tests" / "fixtures" / "harness" / "solutions" / "kernelbench_style" / "level_1_problem_20_sample_0_kernel.py"
    for rel, text in convert_load_inline(src.read_text()).files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return tmp / "kernels"


@pytest.fixture(scope="module")
def cuda_tc() -> Toolchain:
    tc = get_toolchain("cuda")
    if not tc.nvcc or not os.path.exists(tc.nvcc):
        pytest.skip("no nvcc")
    return tc


def _cuda_extra(tc: Toolchain) -> list[str]:
    # a CPU torch ships c10/cuda without its generated header
    return [] if any(Path(d, "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in tc.include_dirs) else [
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]


def _compile_jobs(tc: Toolchain, sources: list[Path], incs: list[str], out: Path,
                  more: list[str] | None = None, thin_incs: list[str] | None = None) -> tuple[list[Path], list[str]]:
    """Objects as compile_workspace builds them (the same flags), two at a time, and the names of the .cpp sources
    that did not compile thin. `thin_incs`: compile each .cpp thin first (against those include folders), as the
    judge does, and against the full header where that fails."""
    extra = [*_cuda_extra(tc), *(more or [])]

    def one(src: Path) -> tuple[subprocess.CompletedProcess, bool]:
        cu = src.suffix == ".cu"
        obj = ["-c", str(src), "-o", str(out / (src.name + ".o"))]
        if not cu and thin_incs is not None:
            thin = subprocess.run([tc.cxx, *thin_flags(tc, thin_incs), *extra, *obj], capture_output=True, text=True)
            if thin.returncode == 0:
                return thin, False
        cmd = [tc.nvcc if cu else tc.cxx, *(cuda_flags(tc, incs) if cu else host_flags(tc, incs)), *extra, *obj]
        return subprocess.run(cmd, capture_output=True, text=True), not cu and thin_incs is not None

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(one, sources))
    for proc, _ in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [out / (src.name + ".o") for src in sources], [src.name for src, (_, full) in zip(sources, done, strict=True) if full]


@pytest.fixture(scope="module")
def cuda_infra(cuda_tc, tmp_path_factory) -> tuple[Path, Path]:
    """The infrastructure object and the header folder as the judge makes them with GCC (sandbox/build/
    pybind_interface.py): bindings compiled against that header leave pybind11's members to the object, so
    linking each solution checks that the object holds every member a real CUDA binding needs (pybind11's
    symbols are hidden: one it lacks fails the link)."""
    out = tmp_path_factory.mktemp("infra")
    header, text = out / "binding_registry.h", (INFRA_DIR / "binding_registry.h").read_text()
    header.write_text(text)
    headers: list[str] = []
    if pybind_interface.is_gcc(cuda_tc.cxx):
        flags = [*host_flags(cuda_tc, [str(out)]), *_cuda_extra(cuda_tc)]
        headers = pybind_interface.pybind_headers(cuda_tc.cxx, flags, header, 600)
        assert headers, "g++ -H listed no pybind11 header"
    pybind_interface.write_infra_sources(out, headers, text, (INFRA_DIR / "binding.cpp").read_text())
    return _compile_jobs(cuda_tc, [out / "binding.cpp"], [str(out)], out, INFRA_SECTIONS)[0][0], out


# honest bindings that only def functions of tensors and numbers: the thin compile must take them (a converted
# load_inline solution includes torch/extension.h for its declarations, and so compiles against the full header)
THIN_SOLUTIONS = {"bench/solutions/relu/kernels", "tasks/examples/solutions/swish_bias/cuda/kernels",
                  "tests/fixtures/harness/solutions/level1/19_ReLU/kernels",
                  "tests/fixtures/harness/solutions/level1/23_Softmax/kernels"}


@pytest.mark.full  # one GCC build per CUDA solution; honest builds pass the scan in tests/exploits (built_lib) and test_demo_solution.py
@pytest.mark.slow
@pytest.mark.parametrize("name", [*_cuda_solutions(), "kernelbench_style (converted)"])
def test_honest_cuda_extensions_pass(name, cuda_tc, cuda_infra, tmp_path):
    """Linked without libraries: a CPU torch has no libc10_cuda, and the undefined symbols are the same. Built
    the judge's way with GCC: against the interface header, linked with the infrastructure object and
    --gc-sections (sandbox/build/pybind_interface.py)."""
    kernels = _kernelbench_style(tmp_path / "src") if name.startswith("kernelbench") else _cuda_solutions()[name]
    out = tmp_path / "build"
    out.mkdir()
    sources = [*sorted(kernels.glob("*.cu")), *sorted(kernels.glob("*.cpp"))]
    obj, header_dir = cuda_infra
    # the header's folder first, as the judge's build has its precompiled header's; each .cpp thin first, as the
    # judge compiles it: bindings that only def functions of the thin stand-in's types compile thin
    incs = [str(kernels.parent), str(kernels)]
    objects, full = _compile_jobs(cuda_tc, sources, [str(header_dir), *incs], out, thin_incs=[str(header_dir), *incs])
    if name in THIN_SOLUTIONS:
        assert full == [], f"{full} did not compile against the thin stand-in"
    so = out / "cuda_extension.so"
    link = subprocess.run([cuda_tc.cxx, "-shared", "-Wl,--gc-sections", *map(str, objects), str(obj), "-o", str(so)],
                          capture_output=True, text=True)
    assert link.returncode == 0, link.stderr[-3000:]
    assert symbol_scan.scan(so) is None, symbol_scan.scan(so)
    # and the agent's own objects, read before the link, import no Python beyond pybind11's def and casters
    assert object_scan.refusals(objects) == {}, object_scan.message(object_scan.refusals(objects))


@pytest.mark.full  # two nvcc compiles of pybind11's header, side by side (about half a minute on two cores)
@pytest.mark.slow
def test_cu_files_under_nvcc_an_honest_binding_compiles_and_a_python_route_is_named(cuda_tc, tmp_path):
    """A .cu may hold its own binding: nvcc's C++20 front end read the stand-in's `module& def(...)` lines as module
    declarations and failed (H200, 2026-12-02: every Python route in tests/exploits/python_kernels as a .cu was
    refused compile_error, not for what it did). Compiled as the judge compiles a .cu (cuda_flags), the header in the
    workspace's root as init puts it there. And the route's object, refused, names what it did among the names shown:
    nvcc's object imports dozens of pybind11's internals beside them (sorted first, they hid PyEval_GetBuiltins)."""
    shutil.copy2(INFRA_DIR / "binding_registry.h", tmp_path / "binding_registry.h")
    (tmp_path / "kernels").mkdir()
    src = tmp_path / "kernels" / "relu.cu"
    src.write_text('#include "../binding_registry.h"\n\n'
                   "__global__ void relu(const float* x, float* y, long n) {\n"
                   "  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;\n"
                   "  if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;\n}\n\n"
                   "static at::Tensor relu_forward(const at::Tensor& x) {\n"
                   "  at::Tensor y = at::empty_like(x);\n"
                   "  relu<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());\n"
                   "  return y;\n}\n\n"
                   "static void register_relu(pybind11::module& m) { m.def(\"relu_forward\", &relu_forward); }\n"
                   "REGISTER_BINDING(relu, register_relu);\n")
    route = tmp_path / "kernels" / "builtins_exec.cu"
    shutil.copy2(REPO / "tests" / "exploits" / "python_kernels" / "builtins_exec.cpp", route)
    flags = [*cuda_flags(cuda_tc, [str(tmp_path)]), *_cuda_extra(cuda_tc)]
    procs = [subprocess.Popen([cuda_tc.nvcc, *flags, "-c", str(f), "-o", str(tmp_path / f"{f.name}.o")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in (src, route)]
    (_, err), (_, route_err) = (p.communicate() for p in procs)
    assert procs[0].returncode == 0, err[-3000:]
    assert "#3189" not in err, err[-2000:]  # the module-keyword warning that preceded the errors
    assert procs[1].returncode == 0, route_err[-3000:]
    found = object_scan.refusals([tmp_path / "builtins_exec.cu.o"])
    assert len(found["builtins_exec.cu.o"]) > 12, found  # more than the message shows
    msg = object_scan.message(found)
    assert "PyEval_GetBuiltins" in msg and "PyDict_GetItemString" in msg and "more." in msg, msg
