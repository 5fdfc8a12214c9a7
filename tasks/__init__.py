"""Task formats and loaders (KernelBench-style model files). The ground floor: imports nothing of the
project above it."""

from tasks.loader import kernelbench_root, list_tasks, load_task
from tasks.task import Task, TaskError, check_source

__all__ = ["Task", "TaskError", "check_source", "kernelbench_root", "list_tasks", "load_task"]
