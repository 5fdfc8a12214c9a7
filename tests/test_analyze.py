"""analyze (issue 66) on the CPU: ncu's table read, the roofline arithmetic, the bottleneck rules, the fallbacks and the
errors. The tables are tests/fixtures/ncu/*.csv (synthetic, in ncu's raw-page layout: make_synthetic.py says why);
the processes are real: the confined target, the network namespace ncu runs in, the torch profiler's fallback. Where
ncu itself is needed, a stand-in program replays a table (no ncu runs on a CPU); the real one is tests/test_analyze_gpu.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES
from sandbox.analyze import ncu_csv, ncu_run, roofline, rules
from sandbox.analyze.analysis import (
    AnalyzeConfig,
    _fallback,
    _with_ncu,
    analyze_workspace,
    cache_key,
    from_kernels,
)
from sandbox.analyze.present import analyze_text
from sandbox.analyze.result import AnalyzeLimits, AnalyzeResult, KernelAnalysis, StallReason, Unavailable
from sandbox.build.compile import extension_path
from sandbox.results import Reason
from sandbox.workspace import Workspace

NCU = FIXTURES / "ncu"
LIMITS = AnalyzeLimits(max_kernels=48, replay_mode="kernel", sections=list(ncu_run.SECTIONS), timeout_s=60)
FP32_PEAK = 2 * 16896 * 1.98e9
DRAM_PEAK = 1843.2 * 2.604e9


def analysed(name: str = "analyze_h200.csv", device: str | None = "NVIDIA H200", **cfg) -> AnalyzeResult:
    return from_kernels(ncu_csv.parse((NCU / name).read_text()), device, AnalyzeConfig(**cfg), LIMITS)


def by_name(kernels: list[KernelAnalysis], fragment: str) -> KernelAnalysis:
    return next(k for k in kernels if fragment in k.name)


# ---- parsing -----------------------------------------------------------------------------------------------------

def test_the_raw_table_is_read_in_base_units_past_ncus_own_lines():
    ks = ncu_csv.parse((NCU / "analyze_h200.csv").read_text())
    assert [k.name.split("(")[0] for k in ks] == [
        "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
        "cublas", "void at::cuda::<unnamed>::spin_kernel", "strided_copy_kernel", "coalesced_copy_kernel",
        "naive_matmul_kernel"]
    strided = ks[2]
    assert strided.id == 2 and strided.grid == [65536, 1, 1] and strided.block == [256, 1, 1]
    assert strided.metrics["gpu__time_duration.sum"] == pytest.approx(301_248e-9)  # nsecond -> seconds
    assert strided.metrics["dram__bytes.sum"] == 148_897_792  # "148,897,792": thousands separators
    assert strided.metrics["launch__registers_per_thread"] == 16


def test_prefixed_units_are_brought_to_base_units():
    text = textwrap.dedent('''\
        ==PROF== Connected to process 1 (/usr/bin/python3)
        "ID","Kernel Name","Block Size","Grid Size","gpu__time_duration.sum","dram__bytes.sum","dram__bytes.sum.per_second","sm__cycles_elapsed.avg.per_second","lts__t_sector_hit_rate.pct"
        "","","","","usecond","Mbyte","Gbyte/second","cycle/nsecond","%"
        "0","k(int)","(32, 1, 1)","(4, 2, 1)","1.50","3.2","2,133.33","1.98","n/a"
        ''')
    (k,) = ncu_csv.parse(text)
    assert k.metrics["gpu__time_duration.sum"] == pytest.approx(1.5e-6)
    assert k.metrics["dram__bytes.sum"] == pytest.approx(3.2e6)
    assert k.metrics["dram__bytes.sum.per_second"] == pytest.approx(2133.33e9)
    assert k.metrics["sm__cycles_elapsed.avg.per_second"] == pytest.approx(1.98e9)
    assert "lts__t_sector_hit_rate.pct" not in k.metrics  # n/a is not a zero
    assert k.grid == [4, 2, 1]


def test_every_spelling_of_a_unit_ncu_writes_is_brought_to_base_units():
    f = ncu_csv._unit_factor
    # ncu 2025.3's short spellings (the H200 capture's raw page), then the long ones of earlier versions
    assert f("ns") == 1e-9 and f("us") == 1e-6 and f("ms") == 1e-3 and f("s") == 1.0
    assert f("byte/s") == 1.0 and f("GB/s") == 1e9 and f("KiB") == 1024 and f("MB") == 1e6
    assert f("nsecond") == 1e-9 and f("Gbyte/second") == 1e9 and f("Ghz") == 1e9
    assert f("cycle/nsecond") == pytest.approx(1e9)
    assert f("hz") == 1.0 and f("byte/cycle") == 1.0 and f("inst/cycle") == 1.0 and f("%") == 1.0
    # counts named by what they count are not a prefixed second or byte
    assert f("SM") == 1.0 and f("pass") == 1.0 and f("cluster") == 1.0 and f("register/thread") == 1.0


def test_a_real_h200_capture_in_ncu_2025_3s_units_reads_as_the_kernels_ran():
    """ncu 2025.3.1 on an H200 (tests/fixtures/ncu/capture_h200_2026-12-02_units.log): durations in "ns", bandwidth
    in "byte/s". Read as base units, a 48 us copy was reported as 48,384,000,000 us at "0 of 4,812 GB/s"."""
    ks = ncu_csv.parse((NCU / "analyze_h200_2026-12-02.csv").read_text())
    coalesced = next(k for k in ks if k.name.startswith("coalesced_copy"))
    assert coalesced.metrics["gpu__time_duration.sum"] == pytest.approx(48_416e-9)
    r = analysed("analyze_h200_2026-12-02.csv")
    strided, copy = by_name(r.kernels, "strided_copy"), by_name(r.kernels, "coalesced_copy")
    assert copy.duration_us == pytest.approx(48.416) and strided.duration_us == pytest.approx(259.104)
    assert copy.dram_share == pytest.approx(0.4915) and copy.dram_share > 3 * strided.dram_share
    assert "(461 of 4,812 GB/s)" in strided.bottleneck[0]
    matmul = by_name(r.kernels, "naive_matmul")
    fp32 = next(x for x in matmul.roofline if x.precision == "fp32")
    assert fp32.flops == pytest.approx(2 * 1024 ** 3, rel=0.01) and 0.05 < fp32.share_of_roof < 0.15
    relu = analysed("relu_h200_2026-12-02.csv").kernels[0]
    assert relu.verdict == "memory-bound" and relu.duration_us == pytest.approx(3251.264)
    assert relu.bottleneck[0].startswith("memory-bound at 82% of peak DRAM bandwidth (3,957 of 4,812 GB/s")
    assert not any("uncoalesced" in s for s in relu.bottleneck)  # float4: 16 sectors a request is its ideal


def test_output_without_a_table_is_an_error_and_its_cause_is_read():
    with pytest.raises(ncu_csv.NcuError):
        ncu_csv.parse("==PROF== Connected\n==WARNING== No kernels were profiled.\n")
    kind, message = ncu_csv.failure((NCU / "counter_permission.txt").read_text())
    assert kind == "counter_permission" and "ERR_NVGPUCTRPERM" in message
    kind, message = ncu_csv.failure("==ERROR== Failed to find metric regex:foo\n")
    assert kind == "ncu_failed" and "Failed to find metric" in message
    assert ncu_csv.failure("==WARNING== No kernels were profiled.\n")[0] == "ncu_failed"
    assert ncu_csv.failure((NCU / "analyze_h200.csv").read_text()) is None
    assert ncu_csv.version("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2025.3.1.0 (build 36398880)") \
        == "2025.3.1.0"


# ---- the roofline ------------------------------------------------------------------------------------------------

def test_peaks_come_from_ncus_peak_metrics_and_the_roofline_from_them():
    ks = ncu_csv.parse((NCU / "analyze_h200.csv").read_text())
    matmul = ks[4]
    pk = roofline.peaks(matmul, device=None)  # no name: ncu's own peaks alone
    assert pk["fp32"] == pytest.approx(FP32_PEAK) and pk["dram"] == pytest.approx(DRAM_PEAK)
    (fp32,) = roofline.roofline(matmul, pk, 1_093_632e-9)  # it computed in fp32 only
    flops = 2 * (1 << 30)
    assert fp32.flops == flops
    assert fp32.intensity == pytest.approx(flops / 9_437_184)
    assert fp32.ridge == pytest.approx(FP32_PEAK / DRAM_PEAK)
    assert fp32.bound == "compute" and fp32.attainable_flops_per_s == pytest.approx(FP32_PEAK)
    assert fp32.achieved_flops_per_s == pytest.approx(flops / 1_093_632e-9)
    assert fp32.share_of_roof == pytest.approx(flops / 1_093_632e-9 / FP32_PEAK)
    assert fp32.ridge_distance == pytest.approx(fp32.intensity / fp32.ridge)


def test_a_memory_side_kernel_gets_the_bandwidth_roof():
    k = ncu_csv.NcuKernel(id=0, name="k", metrics={"dram__bytes.sum": 1e9,
                                                    "sm__sass_thread_inst_executed_op_ffma_pred_on.sum": 1e9})
    (r,) = roofline.roofline(k, {"fp32": 60e12, "dram": 3e12}, 1e-3)
    assert r.intensity == 2.0 and r.bound == "memory"
    assert r.attainable_flops_per_s == pytest.approx(6e12)  # intensity x bandwidth, under the compute roof
    assert r.share_of_roof == pytest.approx(2e12 / 6e12)


def test_without_ncus_peaks_the_device_table_is_used_and_an_unknown_device_gets_no_roofline():
    ks = ncu_csv.parse((NCU / "analyze_h200.csv").read_text())
    bare = ncu_csv.NcuKernel(id=0, name="x", metrics={m: v for m, v in ks[4].metrics.items() if "peak" not in m
                                                      and "elapsed.avg.per_second" not in m})
    assert roofline.peaks(bare, "NVIDIA H200")["dram"] == 4.8e12
    assert roofline.peaks(bare, "NVIDIA H100 80GB HBM3")["dram"] == 3.35e12
    assert roofline.peaks(bare, "NVIDIA H100 PCIe")["dram"] == 2.0e12
    assert roofline.roofline(bare, roofline.peaks(bare, "Some GPU"), 1e-3) == []


def test_the_dram_share_is_ncus_own_percentage_where_it_gave_one():
    """On the H200 the share derived from bytes over duration read about 1e-9 for a coalesced copy near peak: a unit
    taken wrongly in one column cannot move the share ncu computed itself."""
    pk = {"dram": 4.8e12}
    near_peak = ncu_csv.NcuKernel(id=0, name="copy", metrics={"dram__throughput.avg.pct_of_peak_sustained_elapsed": 91.5,
                                                              "dram__bytes.sum": 0.134, "gpu__time_duration.sum": 5.7e-5})
    assert roofline.dram_share(near_peak, 0.134 / 5.7e-5, pk) == pytest.approx(0.915)
    bare = ncu_csv.NcuKernel(id=0, name="copy", metrics={})
    assert roofline.dram_share(bare, 2.4e12, pk) == pytest.approx(0.5)  # no percentage: derived
    assert roofline.dram_share(bare, None, pk) is None and roofline.dram_share(bare, 1e12, {}) is None


def test_a_kernels_numbers_occupancy_and_stalls():
    r = analysed()
    strided = by_name(r.kernels, "strided_copy")
    # ncu's own percentage (10.2973%); the figure derived from bytes, duration and the peak agrees with it
    assert strided.dram_share == pytest.approx(148_897_792 / 301_248e-9 / DRAM_PEAK, rel=1e-4)
    assert strided.load_sectors_per_request == 32.0 and strided.load_efficiency == 0.125
    assert strided.l2_hit == pytest.approx(0.884)
    gemm = by_name(r.eager_kernels, "gemm")
    assert gemm.registers_per_thread == 168 and gemm.shared_mem_per_block == 197_632
    assert gemm.occupancy_limiter == "registers"  # one block per SM by registers and by shared memory: registers named
    matmul = by_name(r.kernels, "naive_matmul")
    assert [s.name for s in matmul.stalls] == ["mio_throttle", "lg_throttle", "long_scoreboard"]
    # selected/not_selected are the scheduler's bookkeeping, not waits: left out of the shares
    waits = 11.6 + 4.4 + 3.1 + 0.9 + 0.7
    assert matmul.stalls[0].share == pytest.approx(11.6 / waits)


# ---- the bottleneck rules ---------------------------------------------------------------------------------------

def test_the_marker_splits_eager_from_the_candidate_and_each_side_is_ranked_by_time():
    r = analysed()
    assert r.ok and [k.name.split("(")[0] for k in r.kernels] == ["naive_matmul_kernel", "strided_copy_kernel",
                                                                  "coalesced_copy_kernel"]
    assert [k.side for k in r.eager_kernels] == ["eager"] and "gemm" in r.eager_kernels[0].name
    assert sum(k.share for k in r.kernels) == pytest.approx(1.0)
    assert not any("spin_kernel" in k.name for k in r.kernels + r.eager_kernels)


def test_the_strided_copy_is_memory_bound_and_uncoalesced_and_its_twin_is_not():
    r = analysed()
    strided, coalesced = by_name(r.kernels, "strided_copy"), by_name(r.kernels, "coalesced_copy")
    assert strided.verdict == "memory-bound"
    assert strided.bottleneck[0].startswith("memory-bound at 10% of peak DRAM bandwidth")
    assert "loads are uncoalesced: 32.0 sectors per request against 4 ideal (12% of each 32-byte sector used)" \
        in strided.bottleneck[1]
    assert coalesced.verdict == "memory-bound" and coalesced.bottleneck[0].startswith("memory-bound at 93% of peak")
    assert not any("uncoalesced" in s for s in coalesced.bottleneck)


def test_the_naive_matmul_is_compute_bound_with_its_stall_and_the_summary_leads_with_it():
    r = analysed()
    matmul = by_name(r.kernels, "naive_matmul")
    assert matmul.verdict == "compute-bound"
    assert matmul.bottleneck[0].startswith("compute-bound: SM throughput at 86% of peak")
    assert any(s.startswith("warps stall mostly on mio_throttle (56% of stalls)") for s in matmul.bottleneck)
    assert r.summary[0].startswith("naive_matmul_kernel(const float *, const float *, float *, int) (77% of ModelNew")
    assert "memory-bound at 10%" in r.summary[-1]  # the strided copy takes over a fifth of the time
    text = analyze_text(r)
    assert text.index("1. naive_matmul") < text.index("ModelNew's kernels:") < text.index("eager's")


def test_a_tensor_core_gemm_is_not_called_memory_bound_for_counting_no_flops():
    gemm = analysed().eager_kernels[0]
    assert gemm.roofline[0].flops == 0  # its tensor-core work is not in ncu's per-instruction counts
    assert gemm.verdict == "compute-bound"


def test_a_tiny_idle_kernel_is_latency_bound_and_a_register_limited_launch_says_so():
    tiny = KernelAnalysis(name="k", side="candidate", duration_us=2.0, share=1.0, dram_share=0.02, sm_share=0.05,
                          memory_share=0.03)
    kind, lines = rules.bottleneck(tiny)
    assert kind == "latency-bound" and "launch this short is mostly overhead" in lines[0]
    heavy = KernelAnalysis(name="k", side="candidate", duration_us=500.0, share=1.0, dram_share=0.3, sm_share=0.4,
                           memory_share=0.35, achieved_occupancy=0.12, theoretical_occupancy=0.125,
                           occupancy_limiter="registers", registers_per_thread=255,
                           stalls=[StallReason(name="long_scoreboard", warps_per_issue=9.0, share=0.8)])
    kind, lines = rules.bottleneck(heavy)
    assert any("occupancy 12% (at most 12%) limited by 255 registers per thread" in s for s in lines)
    assert any(s.startswith("warps stall mostly on long_scoreboard (80% of stalls): waiting on global-memory loads")
               for s in lines)
    assert len(lines) <= 3


def test_a_limit_spent_on_eager_leaves_no_candidate_kernel_and_says_why():
    ks = ncu_csv.parse((NCU / "analyze_h200.csv").read_text())
    eager_only = [ks[0]] * 4  # the limit reached before the marker
    r = from_kernels(eager_only, "NVIDIA H200", AnalyzeConfig(max_kernels=4), LIMITS)
    assert not r.ok and r.unavailable == Unavailable.ncu_failed and r.limits.truncated
    assert "the limit of 4 kernels was spent on the reference's" in r.message
    assert len(r.eager_kernels) == 4


# ---- processes: the fallback, the stand-in ncu, confinement, the cache ---------------------------------------------

@pytest.fixture
def example_ws(built_example_workspace, tmp_path) -> Workspace:
    dst = tmp_path / "ws"
    shutil.copytree(built_example_workspace, dst, symlinks=True)
    return Workspace(dst)


def request(ws: Workspace) -> dict:
    return dict(task=str(ws.reference_path), extension=str(extension_path(ws)), model_new=str(ws.root / "model_new.py"),
                device="cpu", seed=1, eager=True)


def test_the_cpu_backend_says_why_and_gives_the_torch_profilers_table_then_the_cache(example_ws):
    r = analyze_workspace(example_ws)
    assert not r.ok and r.reason is None and r.unavailable == Unavailable.cpu_backend
    assert r.fallback[0].name == "forward (whole call)" and r.fallback[0].total_us > 0
    assert {row.name for row in r.fallback_eager} >= {"forward (whole call)", "aten::silu"}
    assert any(n.startswith("confinement: landlock") for n in r.sandbox_notes), r.sandbox_notes
    again = analyze_workspace(example_ws)
    assert again.cached and not r.cached and again.fallback == r.fallback and again.key == r.key
    assert "torch profiler's table of ModelNew's forward instead" in analyze_text(r)


def test_torch_compiles_kernels_come_from_the_cached_baseline_once_a_profile_kept_one(example_ws, tmp_path, monkeypatch):
    """What the candidate competes with, beside eager's: torch.compile's top kernels, which a profile's baseline
    lists once (tests/test_compile_cache.py measures them for real); an analysis cached before the baseline existed
    shows them once it does."""
    from sandbox.config import ProfileConfig
    from sandbox.timing.baseline import baseline_key, store
    from sandbox.timing.profile import device_identity

    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path / "cache"))  # a fake baseline must reach no other test
    first = analyze_workspace(example_ws)
    assert first.compiled_kernels == [] and "torch.compile's" not in analyze_text(first)
    device, torch_version = device_identity("cpu")
    rows = [{"name": "triton_poi_fused_mul_sigmoid_0", "total_ms": 0.25, "calls": 1, "percent": 80.0},
            {"name": "forward (outside ATen ops)", "total_ms": 0.0625, "calls": 1, "percent": 20.0}]
    store(baseline_key(example_ws.meta.task_sha256, device, torch_version, "cpu", ProfileConfig()),
          {"eager": {}, "compiled_kernels": rows})
    again = analyze_workspace(example_ws)
    assert again.cached and [(k.name, k.total_us, k.calls) for k in again.compiled_kernels] == \
        [("triton_poi_fused_mul_sigmoid_0", 250.0, 1), ("forward (outside ATen ops)", 62.5, 1)]
    assert "torch.compile's" in analyze_text(again) and "triton_poi_fused_mul_sigmoid_0" in analyze_text(again)


def test_the_cache_key_follows_the_builds_content(example_ws):
    cfg = AnalyzeConfig()
    key = cache_key(example_ws, "NVIDIA H200", "2025.3.1.0", cfg)
    assert key == cache_key(example_ws, "NVIDIA H200", "2025.3.1.0", AnalyzeConfig(timeout_s=5))
    assert key != cache_key(example_ws, "NVIDIA H100", "2025.3.1.0", cfg)
    assert key != cache_key(example_ws, "NVIDIA H200", "2025.3.1.0", AnalyzeConfig(max_kernels=8))
    mn = example_ws.root / "model_new.py"
    mn.write_text(mn.read_text() + "\n# changed\n")
    assert key != cache_key(example_ws, "NVIDIA H200", "2025.3.1.0", cfg)


def test_an_unbuilt_workspace_is_the_candidates_failure(example_ws):
    extension_path(example_ws).unlink()
    r = analyze_workspace(example_ws)
    assert not r.ok and r.reason == Reason.not_compiled and r.unavailable is None


STAND_IN = """#!{python}
# A stand-in for ncu (none runs on a CPU): replays a recorded table into --log-file, records its network namespace,
# and runs the target command it was given, as ncu does.
import os, subprocess, sys
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
open({netns!r}, "w").write(os.readlink("/proc/self/ns/net"))
start = next(i for i in range(len(args) - 1) if args[i + 1] == "-P")
if {hang}:  # a profiler that never lets its target start (as ncu did with the target in a namespace of its own)
    import time
    time.sleep(600)
rc = subprocess.call(args[start:])
open(log, "w").write(open({table!r}).read())
sys.exit(rc if {run_ok} else 1)
"""


def stand_in(tmp_path: Path, table: Path, run_ok: bool = True, hang: bool = False) -> tuple[str, Path]:
    netns = tmp_path / "netns"
    path = tmp_path / "ncu"
    path.write_text(STAND_IN.format(python=sys.executable, netns=str(netns), table=str(table), run_ok=run_ok,
                                    hang=hang))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path), netns


def test_ncus_table_through_the_confined_target_in_a_network_namespace_of_its_own(example_ws, tmp_path):
    ncu, netns = stand_in(tmp_path, NCU / "analyze_h200.csv")
    base = dict(backend="cuda", device="NVIDIA H200")
    r = _with_ncu(request(example_ws), ncu, AnalyzeConfig(), base, LIMITS, "NVIDIA H200", 0.0)
    assert r.ok, r.message
    assert by_name(r.kernels, "strided_copy").verdict == "memory-bound"
    if os.getuid() == 0:  # unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN
        assert netns.read_text() != os.readlink("/proc/self/ns/net"), "ncu ran in the judge's network namespace"
        assert not any("kept the host's network" in n for n in r.sandbox_notes)
    assert any(n.startswith("confinement: landlock") for n in r.sandbox_notes), r.sandbox_notes


@pytest.mark.skipif(os.getuid() != 0, reason="a network namespace needs CAP_SYS_ADMIN")
def test_the_namespace_ncu_runs_in_has_a_loopback_and_nothing_else():
    probe = textwrap.dedent("""
        import socket
        from sandbox.analyze import netns
        assert netns.leave_network()
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
        socket.create_connection(srv.getsockname(), timeout=2).close()  # ncu may reach its target on loopback
        try:
            socket.create_connection(("192.0.2.1", 80), timeout=2)
        except OSError as e:
            print("outside:", e.errno)
        """)
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "outside: 101"  # ENETUNREACH: no route out at all


def test_no_counter_permission_is_a_structured_error_with_the_torch_table(example_ws, tmp_path):
    ncu, _ = stand_in(tmp_path, NCU / "counter_permission.txt", run_ok=False)
    r = _with_ncu(request(example_ws), ncu, AnalyzeConfig(), dict(backend="cuda"), LIMITS, None, 0.0)
    assert not r.ok and r.unavailable == Unavailable.counter_permission and r.reason is None
    assert "ERR_NVGPUCTRPERM" in r.message and "NVreg_RestrictProfilingToAdminUsers=0" in r.message
    assert r.fallback and r.fallback[0].name == "forward (whole call)"
    assert "[counter_permission]" in analyze_text(r)


def test_a_target_that_never_opens_its_device_under_ncu_is_given_up_early(example_ws, tmp_path):
    ncu, _ = stand_in(tmp_path, NCU / "analyze_h200.csv", hang=True)
    r = _with_ncu(request(example_ws), ncu, AnalyzeConfig(attach_s=3, timeout_s=300), dict(backend="cuda"), LIMITS,
                  None, 0.0)
    assert r.unavailable == Unavailable.ncu_failed and "did not open its device under ncu within 3 s" in r.message
    assert r.fallback, "the torch profiler's table instead"


def test_no_ncu_is_found_where_none_is_named_or_installed(monkeypatch, tmp_path):
    monkeypatch.setenv(ncu_run.NCU_ENV, "off")
    assert ncu_run.find_ncu() is None
    monkeypatch.setenv(ncu_run.NCU_ENV, str(tmp_path / "absent"))
    assert ncu_run.find_ncu() is None


def test_a_hung_analysis_is_killed_at_its_limit(example_ws, tmp_path):
    mn = example_ws.root / "model_new.py"
    mn.write_text(mn.read_text() + "\nimport time\ntime.sleep(600)\n")
    r = _fallback(request(example_ws), AnalyzeConfig(timeout_s=20), dict(backend="cpu"), Unavailable.cpu_backend,
                  "the CPU backend", 0.0)
    assert "did not finish within 20 s" in r.message and not r.fallback


def test_the_analysed_process_cannot_write_outside_its_scratch_nor_reach_the_network(example_ws, tmp_path):
    """What the candidate does under analysis cannot reach a later judgment: no file in the workspace or the
    judge's cache, no connection out (here the torch-profiler path, which runs the same confined target)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    cache = Path(os.environ["CUDA_AGENT_CACHE"])
    targets = [example_ws.root / "pwned", cache / "pwned", example_ws.root / "kernels" / "pwned.cu"]
    mn = example_ws.root / "model_new.py"
    mn.write_text(mn.read_text() + textwrap.dedent(f"""
        import socket as _s
        for _p in {[str(t) for t in targets]!r}:
            try:
                open(_p, "w").write("x")
            except OSError:
                pass
        try:
            _s.create_connection(("127.0.0.1", {port}), timeout=2).close()
        except OSError:
            pass
        """))
    # past the static scan (which refuses this model_new.py: one wall), to the process's confinement (the other)
    r = _fallback(request(example_ws), AnalyzeConfig(), dict(backend="cpu"), Unavailable.cpu_backend, "cpu", 0.0)
    assert r.reason is None and r.fallback, r.message  # it ran; its writes and its connection were refused
    assert not any(t.exists() for t in targets)
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_the_command_line_prints_the_result_model(example_ws, tmp_path):
    run = subprocess.run([sys.executable, "-m", "cuda_agent", "analyze", str(example_ws.root), "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stderr  # no counters on the CPU: a failure result, with its table
    r = AnalyzeResult.model_validate(json.loads(run.stdout))
    assert r.unavailable == Unavailable.cpu_backend and r.fallback
    bad = subprocess.run([sys.executable, "-m", "cuda_agent", "analyze", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2


def test_the_mcp_tool_through_the_sdks_client(tmp_path):
    """The `analyze` tool in-process through the SDK's real client, on the CPU: read-only, its result model as the
    structured content, the short text first (the GPU test does the same over HTTP with ncu)."""
    import anyio
    from mcp import Client
    from test_mcp import call, make_app, write_solution

    async def episode() -> None:
        app = make_app(tmp_path)
        async with Client(app.mcp) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert tools["analyze"].annotations.read_only_hint
            assert "kernels" in tools["analyze"].output_schema["properties"]
            assert "Why is my kernel slow?" in tools["analyze"].description
            ws = (await call(client, "open_task", {"task": "example/swish_bias"}))["workspace_id"]
            await write_solution(client, ws, "cpu")
            assert (await call(client, "compile", {"workspace_id": ws}))["ok"]
            r = await client.call_tool("analyze", {"workspace_id": ws})
            assert not r.is_error, r.content[0].text
            result = AnalyzeResult.model_validate(r.structured_content)
            assert result.unavailable == Unavailable.cpu_backend and result.fallback
            assert r.content[0].text.startswith("analyze (cpu") and "[cpu_backend]" in r.content[0].text
        app.shutdown()

    anyio.run(episode)
