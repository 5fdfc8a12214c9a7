"""The demo's bundled CPU solution: exact enough for strict verify, also on a ragged row length and on
inputs far past exp's range (the vector exp clamps), and the demo's closing line."""

import shutil

from sandbox.build.compile import compile_workspace
from sandbox.config import CompileConfig, VerifyConfig
from sandbox.correctness.verify import verify_workspace
from sandbox.present import demo_summary
from sandbox.results import RewardResult
from sandbox.workspace import Workspace
from tasks.loader import EXAMPLES_DIR

SOLUTION = EXAMPLES_DIR / "solutions" / "swish_bias" / "cpu"


def test_cpu_solution_is_exact_on_ragged_rows_and_huge_inputs(tmp_path):
    from sandbox.api import init_workspace

    task = tmp_path / "swish_bias_ragged.py"
    task.write_text((EXAMPLES_DIR / "swish_bias.py").read_text()
                    .replace("batch_size = 2048", "batch_size = 7").replace("features = 2048", "features = 1003")
                    .replace("return [torch.randn(batch_size, features)]",
                             "return [torch.randn(batch_size, features) * 60]"))
    ws, _ = init_workspace(str(task), tmp_path / "ws", "cpu")
    shutil.copytree(SOLUTION, ws.root, dirs_exist_ok=True)
    ws = Workspace(ws.root)
    assert compile_workspace(ws, CompileConfig()).ok
    v = verify_workspace(ws, VerifyConfig(trials=2, strict=True))
    assert v.ok, v.message


def test_demo_closing_line_says_what_the_numbers_mean():
    r = RewardResult(reward=2, milestone="faster_than_eager", compiled=True, correct=True,
                     speedup_vs_eager=1.234, speedup_vs_compile=0.9)
    line = demo_summary(r, "cpu")
    assert line.startswith("ModelNew is 1.23x eager and 0.90x torch.compile on this CPU: "
                           "milestone faster_than_eager, reward 2")
    failed = RewardResult(reward=-1, milestone="failed", compiled=False, correct=False)
    assert "not timed on this GPU" in demo_summary(failed, "cuda") and "reward -1" in demo_summary(failed, "cuda")


def test_the_gpu_demo_runs_the_same_model_past_launch_overhead():
    """The CUDA demo's task is the CPU demo's model at sizes where an H100's eager time is in the
    1-100 ms band (two passes over >= 512 MiB), and it loads and runs on the meta device."""
    from sandbox.commands import DEMO_TASKS
    from sandbox.correctness.taskcheck import check_task
    from tasks import load_task

    small, large = load_task(DEMO_TASKS["cpu"]), load_task(DEMO_TASKS["cuda"])

    def body(src: str) -> str:  # the model and its inputs, without sizes and docstring
        src = src.split("class Model", 1)[1]
        return src.split('"""')[0] + src.split('"""')[-1].split("batch_size")[0]

    assert body(small.source) == body(large.source)
    assert check_task(large)["input_bytes"] >= 512 << 20
    assert check_task(small)["input_bytes"] <= 64 << 20  # the CPU demo stays seconds on two cores
