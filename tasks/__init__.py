"""Task formats and loaders (KernelBench-style model files)."""

from tasks.loader import Task, TaskError, kernelbench_root, list_tasks, load_task

__all__ = ["Task", "TaskError", "kernelbench_root", "list_tasks", "load_task"]
