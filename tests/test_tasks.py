from pathlib import Path

import pytest

from sandbox.correctness.taskcheck import check_task
from tasks import TaskError, list_tasks, load_task


def test_kernelbench_ids_resolve_by_name_and_number(small_kernelbench):
    t = load_task("kernelbench/level1/19_ReLU")
    assert t.id == "kernelbench/level1/19_ReLU"
    assert "torch.relu" in t.source
    assert load_task("kernelbench/level1/19").id == t.id
    assert len(t.sha256) == 64 and t.sha256 == load_task("kernelbench/level1/19_ReLU").sha256


def test_kernelbench_levels_listed_in_numeric_order(small_kernelbench):
    level1 = list_tasks("kernelbench:level1")
    assert [t.id for t in level1] == [f"kernelbench/level1/{n}" for n in (
        "1_Square_matrix_multiplication_", "2_Standard_matrix_multiplication_", "3_Batched_matrix_multiplication",
        "19_ReLU", "20_LeakyReLU", "23_Softmax", "26_GELU_")]
    assert [t.name.split("_")[0] for t in list_tasks("kernelbench:level2")] == ["1", "12", "14", "66"]
    every = list_tasks("kernelbench")
    assert [t.id.split("/")[1] for t in every] == ["level1"] * 7 + ["level2"] * 4 + ["level3"] * 3
    assert len(every) == len(list(small_kernelbench.glob("level*/*.py")))


def test_the_real_suite_lists_its_250_problems(real_kernelbench):
    level1 = list_tasks("kernelbench:level1")
    assert len(level1) == 100
    assert level1[0].id == "kernelbench/level1/1_Square_matrix_multiplication_"
    assert level1[1].name.startswith("2_")
    assert len(list_tasks("kernelbench:level2")) == 100
    assert len(list_tasks("kernelbench")) == 250


def test_example_and_file_tasks(tmp_path):
    assert load_task("example/swish_bias").id == "example/swish_bias"
    f = tmp_path / "mytask.py"
    f.write_text(load_task("example/swish_bias").source)
    t = load_task(str(f))
    assert t.id == "mytask" and t.path == f.resolve()
    assert [x.id for x in list_tasks(tmp_path)] == [f"{tmp_path.name}/mytask"]


@pytest.mark.parametrize("source, needle", [
    ("def broken(:\n", "not valid Python"),
    ("import torch\ndef get_inputs(): return []\ndef get_init_inputs(): return []\n", "does not define Model"),
    ("class Model: pass\ndef get_init_inputs(): return []\n", "get_inputs"),
])
def test_static_errors_name_the_problem(tmp_path, source, needle):
    f = tmp_path / "bad.py"
    f.write_text(source)
    with pytest.raises(TaskError, match=needle):
        load_task(str(f))


def test_unknown_tasks(small_kernelbench):
    with pytest.raises(TaskError, match="unknown KernelBench task"):
        load_task("kernelbench/level1/99999_Nope")
    with pytest.raises(TaskError, match="not found"):
        load_task("/no/such/file.py")


RUNTIME_BAD = {
    "import": ("import torch\nimport not_a_module_xyz\nclass Model(torch.nn.Module): pass\n"
               "def get_inputs(): return []\ndef get_init_inputs(): return []\n", "does not import"),
    "get_inputs": ("import torch\nclass Model(torch.nn.Module):\n  def forward(self, x): return x\n"
                   "def get_inputs(): raise ValueError('boom')\ndef get_init_inputs(): return []\n",
                   "get_inputs\\(\\) raised.*boom"),
    "model_type": ("import torch\nclass Model: pass\n"
                   "def get_inputs(): return []\ndef get_init_inputs(): return []\n", "subclass of torch.nn.Module"),
}


@pytest.mark.parametrize("case", sorted(RUNTIME_BAD))
def test_runtime_errors_name_the_problem(tmp_path, case):
    source, needle = RUNTIME_BAD[case]
    f = tmp_path / "bad.py"
    f.write_text(source)
    with pytest.raises(TaskError, match=needle):
        check_task(load_task(str(f)))


def test_check_runs_on_meta_device_so_huge_inputs_cost_nothing(small_kernelbench):
    # level1/19 allocates 6 GB of inputs; on the meta device this is instant
    info = check_task(load_task("kernelbench/level1/19_ReLU"))
    assert info["input_bytes"] == 4096 * 393216 * 4


def test_fixture_task_is_valid(small_task_path: Path):
    check_task(load_task(str(small_task_path)))
