"""The held-out evaluation split: a task is in `eval` when the hash of its id falls under the fraction.

By hash of the id alone, so a task's split never depends on the other tasks: a set grown over several
build slices, or rebuilt on another machine, keeps every earlier task in the split it had, and a model
trained on `train` at any point has seen no task that is `eval` later. A small set may hold no eval task
at all (5% of 10 tasks is most likely none); the report and card say how many each split has.
"""

from __future__ import annotations

import hashlib

from tasks.synthset import SPLITS

EVAL_FRACTION = 0.05
# part of the hash: changing it re-draws every split, so it names the scheme and stays fixed
SALT = "cuda-agent/synth/eval/v1"


def unit(task_id: str, salt: str = SALT) -> float:
    """The id's place in [0, 1), uniform over ids."""
    return int(hashlib.sha256(f"{salt}:{task_id}".encode()).hexdigest()[:15], 16) / 16 ** 15


def split_of(task_id: str, eval_fraction: float = EVAL_FRACTION, salt: str = SALT) -> str:
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"the eval fraction is between 0 and 1, not {eval_fraction}")
    return "eval" if unit(task_id, salt) < eval_fraction else "train"


def assign(task_ids: list[str], eval_fraction: float = EVAL_FRACTION) -> dict[str, list[str]]:
    """Split name -> the ids in it, sorted."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for tid in sorted(task_ids):
        out[split_of(tid, eval_fraction)].append(tid)
    return out
