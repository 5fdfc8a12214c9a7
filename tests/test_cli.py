import json
import subprocess
import sys

from conftest import set_variant
from sandbox.results import CompileResult, InitResult, VerifyResult


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cuda_agent", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


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
