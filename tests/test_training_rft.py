"""RFT end to end on the CPU: scripted judged episodes in a run's JSONL, `cuda-agent train rft` selects
and fine-tunes a tiny model made here, the training loss falls, and the checkpoint reloads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the train extra is not installed")

from typer.testing import CliRunner  # noqa: E402

from cuda_agent.cli import app  # noqa: E402
from harness.trajectory import TrajectoryWriter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "training"))
from episodes import call, episode, good  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    res = CliRunner().invoke(app, ["train", "tiny-model", str(out), "--layers", "2", "--hidden", "64",
                                   "--vocab", "1024"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["vocab"] == 1024 and info["parameters"] > 0
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    with TrajectoryWriter(run / "episodes.jsonl") as w:
        for i in range(32):  # kept: 8 tasks x at most 4
            w.append(good(task=f"task_{i % 8}", sample=i, kernel=f"__global__ void k{i}() {{}}"))
        for i in range(3):
            w.append(episode([(None, [call("compile")])], milestone="correct", sample=100 + i, task=f"slow_{i}"))
        w.append(episode([(None, [call("make_it_fast")])], sample=200, task="bad"))
    return run


def test_rft_lowers_the_loss_and_the_checkpoint_reloads(tiny, run_dir, tmp_path):
    out = tmp_path / "rft"
    res = CliRunner().invoke(app, [
        "train", "rft", "--data", str(run_dir), "--model", str(tiny), "--out", str(out), "--max-steps", "30",
        "--learning-rate", "3e-3", "--batch-size", "2", "--grad-accum", "1", "--logging-steps", "5",
        "--save-steps", "15", "--eval-fraction", "0.1", "--max-length", "1024", "--warmup", "0",
        "--lr-scheduler", "constant", "--no-gradient-checkpointing", "--report-to", "tensorboard"])
    assert res.exit_code == 0, res.output
    sel = json.loads((out / "selection.json").read_text())
    assert sel["total"] == 36 and sel["kept"] == 32
    assert sel["dropped"] == {"outcome": 3, "invalid_tool_call": 1}
    assert sel["train"] + sel["eval"] == 32 and sel["eval"] == 3
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert len(losses) >= 5
    assert losses[-1] < 0.7 * losses[0], losses
    assert any("eval_loss" in r for r in logs)
    assert (out / "checkpoint-15").is_dir() and (out / "checkpoint-30").is_dir()
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # TensorBoard logs

    from training.models import ModelSpec, load_model
    from training.records import tokenize_row

    model, tok = load_model(ModelSpec(str(out / "final"), device="cpu"))
    base, _ = load_model(ModelSpec(str(tiny), device="cpu"))
    row = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    enc = tokenize_row(tok, row)
    import torch

    ids = torch.tensor([enc["input_ids"]])
    labels = ids.clone()
    labels[0, torch.tensor(enc["loss_mask"]) == 0] = -100
    with torch.no_grad():
        tuned, untuned = model(ids, labels=labels).loss.item(), base(ids, labels=labels).loss.item()
    assert tuned < 0.7 * untuned  # the saved weights are the trained ones


def test_rft_resumes_from_its_last_checkpoint(tiny, run_dir, tmp_path):
    out = tmp_path / "rft"
    common = ["train", "rft", "--data", str(run_dir), "--model", str(tiny), "--out", str(out), "--batch-size", "2",
              "--grad-accum", "1", "--save-steps", "4", "--max-length", "512", "--no-gradient-checkpointing",
              "--report-to", "none", "--logging-steps", "1", "--eval-fraction", "0"]
    res = CliRunner().invoke(app, [*common, "--max-steps", "4"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, [*common, "--max-steps", "6", "--resume"])
    assert res.exit_code == 0, res.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps[:4] == [1, 2, 3, 4] and steps[4:] == [5, 6]  # the second run went on from step 4


def test_rft_select_only_and_bad_input(run_dir, tmp_path):
    res = CliRunner().invoke(app, ["train", "rft", "--data", str(run_dir), "--model", "unused", "--out",
                                   str(tmp_path / "o"), "--select-only", "--min-milestone", "correct"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["kept"] == 35
    res = CliRunner().invoke(app, ["train", "rft", "--data", str(tmp_path / "nope"), "--model", "m", "--out",
                                   str(tmp_path / "o2")])
    assert res.exit_code == 2 and "no such run folder" in res.output
    res = CliRunner().invoke(app, ["train", "rft", "--data", str(run_dir), "--model", "m", "--out",
                                   str(tmp_path / "o3"), "--min-milestone", "fastest"])
    assert res.exit_code == 2
