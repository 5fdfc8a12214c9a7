import json
import os
import subprocess
import sys

from conftest import set_variant
from sandbox.results import CompileResult, InitResult, VerifyResult


def cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "cuda_agent", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(r) -> str:
    """A plain mistake: exit 2 and one line on stderr, no traceback, no pydantic dump."""
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "validation error" not in r.stderr
    return lines[0]


def test_init_json_is_the_result_model(tmp_path, small_task_path):
    r = cli("init", small_task_path, tmp_path / "ws", "--backend", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    res = InitResult.model_validate_json(r.stdout)
    assert res.backend == "cpu" and res.task.id == "small_task" and "model.py" in res.files


def test_bad_input_exits_2(tmp_path, small_kernelbench):
    r = cli("init", "kernelbench/level1/99999_Nope", tmp_path / "ws", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["ok"] is False and "unknown" in r.stderr
    assert cli("verify", tmp_path / "nowhere").returncode == 2
    assert cli("init", "example/swish_bias", tmp_path / "w2", "--backend", "tpu").returncode == 2
    assert cli("frobnicate").returncode == 2


def test_compile_verify_exit_codes_and_json(cpu_ws):
    r = cli("compile", cpu_ws.root, "--json")
    assert r.returncode == 0 and CompileResult.model_validate_json(r.stdout).up_to_date
    set_variant(cpu_ws.root, "wrong_values")
    r = cli("verify", cpu_ws.root, "--json", "--trials", "1")
    assert r.returncode == 1
    res = VerifyResult.model_validate_json(r.stdout)
    assert res.reason == "value_mismatch"
    set_variant(cpu_ws.root, "correct")
    r = cli("verify", cpu_ws.root, "--trials", "1")
    assert r.returncode == 0 and "verify OK" in r.stdout
    cpu_ws.write_text("kernels/oops.cpp", "int f( {\n")
    r = cli("compile", cpu_ws.root)
    assert r.returncode == 1 and "kernels/oops.cpp:1" in r.stdout


def test_tasks_lists_kernelbench(small_kernelbench):
    r = cli("tasks", "kernelbench:level2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"kernelbench/level2/{f.stem}" for f in  # in numeric order
                                sorted((small_kernelbench / "level2").glob("*.py"), key=lambda f: int(f.stem.split("_")[0]))]


def test_init_accepts_a_relative_task_path(tmp_path, small_task_path):
    import os

    rel = os.path.relpath(small_task_path)
    r = cli("init", rel, tmp_path / "ws", "--backend", "cpu", "--json")
    assert r.returncode == 0, r.stdout + r.stderr


def test_plain_mistakes_are_one_line_and_exit_2(tmp_path):
    assert "unknown backend 'gpu'" in one_line_error(cli("demo", "--backend", "gpu"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert "not a directory" in one_line_error(cli("init", "example/swish_bias", a_file, "--backend", "cpu"))
    assert a_file.read_text() == "mine"
    ws = tmp_path / "ws"
    assert cli("init", "example/swish_bias", ws, "--backend", "cpu", "--no-check").returncode == 0
    line = one_line_error(cli("verify", ws, "--trials", "0"))
    assert "--trials 0: should be greater than or equal to 1" in line
    line = one_line_error(cli("verify", ws, "--atol", "-1", "--timeout", "0"))
    assert "--atol -1.0: should be greater than or equal to 0" in line and "--timeout 0.0: should be greater" in line
    assert "--timeout -1.0" in one_line_error(cli("compile", ws, "--timeout", "-1"))
    assert "unknown compile mode" in one_line_error(cli("profile", ws, "--compile-mode", "fastest"))
    r = cli("verify", ws, "--trials", "1000", "--json")
    assert json.loads(r.stdout) == {"ok": False, "error": "--trials 1000: should be less than or equal to 100"}


def test_cuda_backend_is_refused_up_front_without_a_gpu(tmp_path):
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    line = one_line_error(cli("init", "example/swish_bias", tmp_path / "ws", "--backend", "cuda", env=hidden))
    assert "cuda backend needs a usable GPU" in line and "--backend cpu" in line
    assert not (tmp_path / "ws").exists()
    line = one_line_error(cli("demo", "--workdir", tmp_path / "demo", env={**hidden, "CUDA_AGENT_BACKEND": "cuda"}))
    assert "cuda backend needs a usable GPU" in line and not (tmp_path / "demo").exists()


def test_a_model_new_that_does_not_parse_is_one_line(cpu_ws):
    (cpu_ws.root / "model_new.py").write_text("import torch\n\nclass ModelNew(torch.nn.Module:\n    pass\n")
    r = cli("verify", cpu_ws.root, "--trials", "1")
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "sandbox/" not in r.stdout, r.stdout
    assert lines[0].startswith("verify FAILED [import_error] ") and lines[0].endswith(
        "model_new.py failed to import: SyntaxError: invalid syntax (model_new.py, line 3): "
        "class ModelNew(torch.nn.Module:")


def test_bare_tasks_lists_what_a_fresh_install_has(tmp_path, kernelbench_tree):
    from tasks import list_tasks

    fresh = {"CUDA_AGENT_KERNELBENCH": str(tmp_path / "absent"), "CUDA_AGENT_CACHE": str(tmp_path / "cache")}
    r = cli("tasks", env=fresh)
    assert r.returncode == 0, r.stderr
    ids = r.stdout.split()
    evals = [t.id for t in list_tasks("synth:eval")]
    assert ids[:2] == ["example/swish_bias", "example/swish_bias_large"] and evals
    assert [i for i in ids if i.startswith("synth:eval/")] == evals
    assert not any(i.startswith("kernelbench/") for i in ids)
    assert "KernelBench is not downloaded: `cuda-agent tasks download kernelbench`" in r.stderr
    r = cli("tasks", env={**fresh, "CUDA_AGENT_KERNELBENCH": str(kernelbench_tree)})
    assert "kernelbench/level1/19_ReLU" in r.stdout.split() and "not downloaded" not in r.stderr
    rows = {row["id"]: row for row in json.loads(cli("tasks", "--json", env=fresh).stdout)}
    assert rows[evals[0]]["path"] is None  # a synthesized task lives in the set's file, not a path of its own
    assert rows["example/swish_bias"]["path"].endswith("tasks/examples/swish_bias.py")


def test_help_names_the_shipped_synthesized_ids():
    for command in ("init", "tasks"):
        r = cli(command, "--help", env={"COLUMNS": "200"})
        assert r.returncode == 0 and "synth:eval" in r.stdout, r.stdout


def test_other_commands_name_the_option_and_its_rule(tmp_path):
    assert one_line_error(cli("serve", "--max-workspaces", "0")) == \
        "error: --max-workspaces 0: should be greater than or equal to 1"
    r = cli("train", "ppo", "--tasks", "example/swish_bias", "--model", tmp_path / "none", "--out", tmp_path / "out",
            "--reward", "eager_margin=-1")
    assert one_line_error(r) == "error: --reward eager_margin=-1.0: should be greater than or equal to 0"


def test_a_config_built_from_options_unchecked_is_still_one_line(monkeypatch, capsys):
    """The last net in `cuda-agent`'s entry point: a command that builds a *Config from its options and lets its
    ValidationError go; any other model's error is a bug and keeps its traceback."""
    import pytest
    from pydantic import BaseModel, ValidationError

    import cuda_agent.cli as entry
    from sandbox.config import VerifyConfig

    monkeypatch.setattr(entry, "app", lambda: VerifyConfig(trials=0, rtol=-1))
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: --trials 0: should be greater than or equal to 1; "
                                       "--rtol -1: should be greater than or equal to 0\n")

    class Result(BaseModel):
        ok: bool

    monkeypatch.setattr(entry, "app", lambda: Result(ok="maybe"))
    with pytest.raises(ValidationError):
        entry.main()
