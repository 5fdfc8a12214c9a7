"""Judgments spread over a host's GPUs (sandbox.backend.on_gpu, GpuRing): what a pinned judgment's workers
see, which device lock it takes, and that baselines are shared by every GPU of one kind. CPU-only checks of
the mechanism; the GPU measurement is in docs/benchmarks.md."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sandbox.backend import GpuRing, cuda_visible_devices, on_gpu, visible_gpus
from sandbox.config import ProfileConfig
from sandbox.confinement.environment import worker_env
from sandbox.timing.baseline import baseline_key
from sandbox.timing.device_lock import device_key, device_lock


def test_a_pinned_judgment_gives_its_workers_that_gpu_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert worker_env()["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert device_key("cuda") == "cuda-4_5-0"
    with on_gpu("5"):
        assert cuda_visible_devices() == "5"
        assert worker_env()["CUDA_VISIBLE_DEVICES"] == "5"
        assert device_key("cuda") == "cuda-5-0"
        with on_gpu(None):  # an inner context can go back to the environment's choice
            assert worker_env()["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert cuda_visible_devices() == "4,5"


def test_the_pin_belongs_to_the_thread_that_set_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    seen: dict[str, str | None] = {}
    go = threading.Barrier(2)

    def judge(gpu: str) -> None:
        with on_gpu(gpu):
            go.wait(5)  # both pinned at once
            time.sleep(0.05)
            seen[gpu] = worker_env()["CUDA_VISIBLE_DEVICES"]

    ts = [threading.Thread(target=judge, args=(g,)) for g in ("0", "1")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert seen == {"0": "0", "1": "1"}


def _overlap(devices: list[str]) -> bool:
    """Whether two exclusive timings, each pinned to its GPU, held their locks at the same time."""
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timing(gpu: str) -> None:
        with on_gpu(gpu), device_lock("cuda", exclusive=True):
            t0 = time.monotonic()
            time.sleep(0.3)
            with lock:
                spans.append((t0, time.monotonic()))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(timing, devices))
    (a0, a1), (b0, b1) = sorted(spans)
    return b0 < a1


def test_timings_on_two_gpus_run_together_and_on_one_gpu_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _overlap(["0", "1"]), "each GPU has a lock of its own"
    assert not _overlap(["1", "1"]), "two timings pinned to one GPU wait for each other"


def test_the_ring_hands_gpus_out_in_turn(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert visible_gpus() == ["0", "1", "2"]
    ring = GpuRing("cuda")
    got = []
    for _ in range(6):
        with ring.next():
            got.append(cuda_visible_devices())
    assert got == ["0", "1", "2", "0", "1", "2"]
    chosen = GpuRing("cuda", ["3", "7"])
    with chosen.next():
        assert cuda_visible_devices() == "3"
    # one GPU, or the CPU backend: nothing to spread, the environment decides
    assert GpuRing("cpu").gpus == []
    with GpuRing("cuda", ["2"]).next():
        assert cuda_visible_devices() == "0,1,2"


def test_baselines_are_keyed_by_the_device_kind_not_by_which_gpu(monkeypatch):
    cfg = ProfileConfig()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    a = baseline_key("sha", "NVIDIA H100 80GB HBM3", "2.11", "cuda", cfg)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert baseline_key("sha", "NVIDIA H100 80GB HBM3", "2.11", "cuda", cfg) == a
    assert baseline_key("sha", "NVIDIA H200", "2.11", "cuda", cfg) != a


def test_the_trainers_judge_spreads_over_the_configured_gpus(tmp_path, monkeypatch):
    from training.ppo.config import PPOConfig
    from training.ppo.warmup import Judge, WarmupConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    from sandbox.confinement import processes

    monkeypatch.setattr(processes, "_POOL", None)
    cfg = WarmupConfig(ppo=PPOConfig(), tasks=[], out=tmp_path)
    assert Judge(cfg, "cuda").ring.gpus == ["0", "1"]
    assert Judge(WarmupConfig(ppo=PPOConfig(), tasks=[], out=tmp_path, judge_gpus=["1"]), "cuda").ring.gpus == ["1"]
    assert Judge(cfg, "cpu").ring.gpus == []
    # made, not yet judging: no pool of workers started (one started at construction outlived this test, 16 idle
    # processes, and the next test that counts live processes failed)
    assert processes._POOL is None
