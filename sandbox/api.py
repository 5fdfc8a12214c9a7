"""The sandbox's operations in one place, for the CLI, the MCP server and the harness."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from sandbox.build.compile import compile_workspace
from sandbox.config import CompileConfig, ProfileConfig, RewardConfig, VerifyConfig
from sandbox.correctness.taskcheck import check_task
from sandbox.correctness.verify import verify_workspace
from sandbox.results import CompileResult, InitResult, ProfileResult, RewardResult, TaskInfo, VerifyResult
from sandbox.reward import milestone_reward
from sandbox.timing.profile import profile_workspace
from sandbox.workspace import Workspace
from tasks import Task, load_task

__all__ = ["CompileConfig", "CompileResult", "InitResult", "ProfileConfig", "ProfileResult", "RewardConfig",
           "Evaluation", "RewardResult", "VerifyConfig", "VerifyResult", "Workspace", "compile_workspace", "evaluate", "init_workspace",
           "milestone_reward", "profile_workspace", "task_info", "verify_workspace"]


def task_info(task: Task) -> TaskInfo:
    return TaskInfo(id=task.id, name=task.name, sha256=task.sha256, path=str(task.path) if task.path else None)


def init_workspace(task: str | Task, workdir: str | Path, backend: str | None = None,
                   check: bool = True) -> tuple[Workspace, InitResult]:
    """Create a workspace for a task (a path, a task id or a Task), validating the task first."""
    t = task if isinstance(task, Task) else load_task(task)
    if check:
        check_task(t)
    ws = Workspace.create(t, workdir, backend)
    return ws, InitResult(ok=True, workdir=str(ws.root), task=task_info(t), backend=ws.backend,
                          files=ws.list_files())


class Evaluation(BaseModel):
    """compile + verify + profile + reward, as one result."""

    ok: bool
    compile: dict
    verify: dict | None = None
    profile: dict | None = None
    reward: dict


def evaluate(ws: Workspace, compile_mode: str = "default", profile: ProfileConfig | None = None,
             reward: RewardConfig | None = None):
    """compile, then verify if it built, then profile if it verified; the milestone reward of the three.
    `profile` replaces the default profile settings (its own compile_mode then applies); `reward` the milestone
    settings, for the reward and for the profile's early stop alike."""
    c = compile_workspace(ws)
    v = verify_workspace(ws) if c.ok else None
    pcfg = profile or ProfileConfig(compile_mode=compile_mode)
    if reward is not None:
        pcfg = pcfg.model_copy(update={"reward": reward})
    p = profile_workspace(ws, pcfg) if v and v.ok else None
    r = milestone_reward(c, v, p, pcfg.reward)
    return c, v, p, r
