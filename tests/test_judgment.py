"""One judgment, one candidate process (sandbox/timing/judgment.py): real workers, real verifies and profiles on the
CPU. The candidate is verified and then timed in the same `judged` process; a verify that fails ends the judgment;
the candidate is stopped from before its verify's lock goes until its timing holds the device; a candidate that
faulted at other sizes is timed, as before, in a process of its own."""

import fcntl
import os

import pytest

from conftest import FIXTURES, model_new_calling
from sandbox.api import compile_workspace, evaluate, init_workspace, judge_workspace
from sandbox.config import ProfileConfig, VerifyConfig
from sandbox.confinement.processes import Session
from sandbox.confinement.reaper import REAPER
from sandbox.timing import device_lock as device_lock_mod
from sandbox.timing import timing_bound
from sandbox.timing.profile import ProfileRun

FAST = VerifyConfig(trials=2, signed_trials=0)
# the CI machine's neighbours move a microsecond-scale task's rounds (conftest.profile_scored): these tests are of
# which processes time, not of the noise rule
CALM = ProfileConfig(noise_max_spread=ProfileConfig().noise_max_spread * 4,
                     baseline_max_drift=ProfileConfig().baseline_max_drift * 4,
                     candidate_max_spread=ProfileConfig().candidate_max_spread * 4)


@pytest.fixture
def spawned(monkeypatch):
    """Every worker the judgments of a test start or take, by role, in order: [(role, worker)]. A baseline's own
    process (the first profile of a task) is left out: it times the reference alone, before or after a judgment."""
    seen: list = []
    real = Session.spawn

    def spawn(self, role, *args, **kwargs):
        w = real(self, role, *args, **kwargs)
        if role != "baseline":
            seen.append((role, w))
        return w

    monkeypatch.setattr(Session, "spawn", spawn)
    yield seen
    assert REAPER.drain(60)


def model_new(ws, forward: str) -> None:
    (ws.root / "model_new.py").write_text(model_new_calling(forward))


def test_a_judgment_verifies_and_times_the_candidate_in_one_process(cpu_ws, spawned):
    c, v, p, r = evaluate(cpu_ws, profile=CALM)
    assert c.ok and v.ok, v.message
    assert p is not None and (p.ok or p.reason == "timing_noisy"), p.message
    # the task's process and one candidate process: no second candidate process (the profile's timer), no second
    # task process (on the CPU none is kept between operations, so separate calls start two)
    assert [role for role, _ in spawned] == ["eager", "judged"]
    assert p.phases["candidate_carried"] == 1.0
    assert p.phases["timing"] > 0 and "setup" not in p.phases  # timed, and never set up again
    assert v.phases["candidate_setup_work"] > 0 and "candidate_wait" in v.phases
    if p.ok:
        assert p.speedup_vs_eager and p.paired.rounds and r.reward > 0
    spawned.clear()
    v2, p2 = judge_workspace(cpu_ws, FAST, CALM)  # and again: a judgment's processes are its own
    assert v2.ok and p2 is not None
    assert [role for role, _ in spawned] == ["eager", "judged"]
    assert spawned[1][1].proc.pid not in {w.proc.pid for _, w in spawned[:1]}


def test_a_wrong_candidate_ends_the_judgment_at_its_verify(cpu_ws, spawned):
    model_new(cpu_ws, "return cuda_extension.wrong_values(x, self.bias)\n")
    v, p = judge_workspace(cpu_ws, FAST, CALM)
    assert not v.ok and v.reason == "value_mismatch" and p is None
    assert [role for role, _ in spawned] == ["eager", "judged"]
    assert REAPER.drain(60)
    assert all(w.proc.poll() is not None for _, w in spawned)


def test_a_candidate_that_turns_wrong_after_its_verify_is_caught_in_the_same_process(cpu_ws, spawned):
    # right for its verify's calls, wrong from the 12th call of the process on: in a timer of its own the count
    # would start again, here it goes on from the verify's, and the spot checks still see the wrong answers
    model_new(cpu_ws, """\
        self.calls += 1
        if self.calls < 12:
            return cuda_extension.correct(x, self.bias)
        return cuda_extension.wrong_values(x, self.bias)
        """)
    v, p = judge_workspace(cpu_ws, FAST, CALM)
    assert v.ok, v.message
    assert p is not None and not p.ok and p.reason == "spot_check_failed", p.message
    assert p.phases["candidate_carried"] == 1.0


def test_the_candidate_is_stopped_and_the_lock_free_while_its_baseline_is_read(cpu_ws, spawned, monkeypatch,
                                                                               tmp_path):
    """Between the verify's shared hold and the timing's exclusive one the candidate runs nothing: another
    judgment may be timing on the device then."""
    # a lock of this test's own: the host's is held by whatever else judges beside it (another pytest worker)
    monkeypatch.setenv(device_lock_mod.LOCK_DIR_ENV, str(tmp_path / "locks"))
    seen = {}
    real = ProfileRun.baseline

    def baseline(self, refresh=None):
        if refresh is None:
            judged = next(w for role, w in spawned if role == "judged")
            with open(f"/proc/{judged.proc.pid}/stat") as f:
                seen["state"] = f.read().rsplit(")", 1)[1].split()[0]
            path = device_lock_mod.lock_dir() / device_lock_mod.device_key(self.device)
            fd = os.open(path.with_suffix(".lock"), os.O_RDONLY)
            try:  # no shared holder left: the verify's hold is gone
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                seen["lock_free"] = True
            except BlockingIOError:
                seen["lock_free"] = False
            finally:
                os.close(fd)
        return real(self, refresh)

    monkeypatch.setattr(ProfileRun, "baseline", baseline)
    v, p = judge_workspace(cpu_ws, FAST, CALM)
    assert v.ok and p is not None and (p.ok or p.reason == "timing_noisy"), p.message
    assert seen == {"state": "T", "lock_free": True}


def _lock_state(device: str) -> str:
    """"exclusive" (a timing holds the device), "shared" (only shared holders), or "free", as another process sees it."""
    path = device_lock_mod.lock_dir() / device_lock_mod.device_key(device)
    fd = os.open(path.with_suffix(".lock"), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "exclusive"
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "shared"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "free"
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["judgment", "profile", "off"])
def test_a_timings_untimed_start_runs_before_the_exclusive_hold(cpu_ws, spawned, monkeypatch, path):
    """Both sides' time_begin (warm-up, estimate) and their first batch's inputs run under the shared hold; the
    exclusive one starts at the round-trip probes, and every timed batch is inside it."""
    from sandbox.api import profile_workspace

    seen: list[tuple[str, str, int]] = []
    real = timing_bound.Run._timed  # every request of a timing, clocked (batches, probes) or not

    def request(self, op, what, clocked=True, **args):
        if any(self.w is w for _, w in spawned):  # the pairing's, not a first baseline's (a process of its own)
            seen.append((f"{self.variant}:{op}", _lock_state("cpu"), args.get("calls", -1)))
        return real(self, op, what, clocked, **args)

    monkeypatch.setattr(timing_bound.Run, "_timed", request)
    if path == "profile":
        p = profile_workspace(cpu_ws, CALM)
    else:
        v, p = judge_workspace(cpu_ws, FAST, CALM if path == "judgment" else CALM.model_copy(update={"timing_ahead": False}))
        assert v.ok, v.message
    assert p is not None and (p.ok or p.reason == "timing_noisy"), p.message
    if path == "off":  # set up inside the exclusive hold, as before
        assert [(op, state) for op, state, _ in seen[:4]] == [("eager:time_batch", "exclusive")] * 3 + [
            ("eager:time_begin", "exclusive")]
        assert "ahead" not in p.phases
        return
    first = {op for op, state, _ in seen if state != "exclusive"}
    # the first pairing's start: each side's time_begin and one time_prepare, beside other work (shared)
    assert [(op, state) for op, state, _ in seen[:4]] == [("eager:time_begin", "shared"), ("eager:time_prepare", "shared"),
                                                         ("candidate:time_begin", "shared"),
                                                         ("candidate:time_prepare", "shared")]
    assert first == {"eager:time_begin", "eager:time_prepare", "candidate:time_begin", "candidate:time_prepare"}
    timed = [(op, state) for op, state, calls in seen if op.endswith("time_batch")]
    assert timed and all(state == "exclusive" for _, state in timed)  # probes (calls=0) and batches alike
    # the first batch of each side found its inputs drawn: no second time_prepare before it
    inside = [op for op, _, _ in seen[4:13]]
    assert inside == ["eager:time_batch"] * 3 + ["candidate:time_batch"] * 3 + [  # the round-trip probes
        "eager:time_batch", "candidate:time_batch", "eager:time_prepare"]  # batch 0 of each, then eager's batch 1
    assert p.phases["ahead"] >= 0 and p.phases["timing_ahead"] > 0


def test_a_profile_without_the_untimed_start_waits_for_eagers_work_after_its_set_up(cpu_ws, monkeypatch):
    """Eager's process queues device work after its set-up's reply (protocol.AFTER_REPLY: the comparison's kernels on
    CUDA). With no untimed start ahead, no other request to it follows under the shared hold: the profile asks it to
    settle there, before the hold goes and the exclusive one is asked for."""
    from sandbox.api import profile_workspace
    from sandbox.confinement.worker_process import Worker

    seen: list[tuple[str, str]] = []
    real = Worker.request

    def request(self, op, *args, **kwargs):
        seen.append((op, _lock_state("cpu")))
        return real(self, op, *args, **kwargs)

    monkeypatch.setattr(Worker, "request", request)
    p = profile_workspace(cpu_ws, CALM.model_copy(update={"timing_ahead": False}))
    assert p.ok or p.reason == "timing_noisy", p.message
    assert ("settle", "shared") in seen, seen
    settled = seen.index(("settle", "shared"))
    assert all(state != "exclusive" for _, state in seen[:settled]), seen
    assert any(state == "exclusive" for _, state in seen[settled:]), seen


def test_a_candidate_that_faulted_at_other_sizes_is_timed_in_a_process_of_its_own(tmp_path, spawned):
    """The failure at other sizes is reported, never the verdict; its process is not timed on."""
    task = tmp_path / "sized_task.py"
    task.write_text((FIXTURES / "cpu_multi" / "small_task.py").read_text()
                    .replace("def get_inputs():\n    return [torch.randn(64, 256)]",
                             "batch_size = 64\n\n\ndef get_inputs():\n    return [torch.randn(batch_size, 256)]"))
    ws, _ = init_workspace(str(task), tmp_path / "ws", backend="cpu", check=False)
    import shutil

    shutil.copytree(FIXTURES / "cpu_multi" / "kernels", ws.root / "kernels", dirs_exist_ok=True)
    model_new(ws, """\
        if x.shape[0] != 64:
            raise RuntimeError("written for 64 rows only")
        return cuda_extension.correct(x, self.bias)
        """)
    assert compile_workspace(ws).ok
    v, p = judge_workspace(ws, VerifyConfig(trials=2, signed_trials=0, generalize=True), CALM)
    assert v.ok and v.generalization is not None and not v.generalization.ok, v
    assert p is not None and (p.ok or p.reason == "timing_noisy"), p.message
    assert "candidate_carried" not in p.phases
    assert [role for role, _ in spawned][:2] == ["eager", "judged"] and "timer" in [role for role, _ in spawned]
