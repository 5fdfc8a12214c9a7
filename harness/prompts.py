"""The system prompt (SKILL.md behind a short preamble) and the task prompt of an episode."""

from __future__ import annotations

from skills import skill_text
from tasks import Task

PREAMBLE = """\
You are an expert GPU performance engineer. You work in a sandboxed workspace through the tools you \
are given: read and write files, compile, verify, profile, and analyze (Nsight Compute's roofline and \
bottleneck for each kernel: call it after verify passes and before you rewrite a kernel for speed). Your goal is a ModelNew that computes \
exactly what the reference Model computes, with all of the work done by your own kernels, and that \
runs faster than PyTorch eager and torch.compile. Work in small verified steps. When you are done, \
reply with a short summary and no tool call: the workspace as you leave it is then compiled, verified \
and timed by the judge, and only that result counts.

Your operating manual follows.

"""

CPU_NOTE = """
This workspace uses the CPU backend (there is no GPU here): write C++ in kernels/*.cpp, no .cu files. \
Each file includes "binding_registry.h" and registers its functions with REGISTER_BINDING exactly as \
described for binding files; ModelNew calls them through cuda_extension as usual.
"""

TRUNCATED_NOTE = (
    "[harness] Your last response was cut off at the {limit}-token limit before it was complete. "
    "Continue from where you were, and keep each response shorter: write large files in several steps "
    "(write_file, then edit_file).")


def system_prompt() -> str:
    return PREAMBLE + skill_text()


def task_prompt(task: Task, backend: str) -> str:
    device = "an NVIDIA GPU (cuda backend)" if backend == "cuda" else "the CPU backend"
    parts = [
        f"Task: {task.id}",
        f"Target: {device}.",
        "",
        "Your workspace is open and every tool acts on it, so you never pass a workspace id. It holds "
        "model.py (the reference, shown below), SKILL.md, the fixed binding infrastructure, a placeholder "
        "model_new.py and an empty kernels/ folder.",
        "",
        "model.py:",
        "```python",
        task.source.rstrip(),
        "```",
        "",
        "Write your kernels under kernels/ and ModelNew in model_new.py, then compile, verify and profile. "
        "Finish with a final verify of the exact code you leave behind, then answer without calling a tool.",
    ]
    if backend == "cpu":
        parts.append(CPU_NOTE)
    return "\n".join(parts)
