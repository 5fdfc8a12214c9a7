"""Loading the task, seeding, and drawing its inputs on the device."""

from __future__ import annotations

import importlib.util
import random
import sys
import types

import torch


def load_module(path: str, name: str, source: str | None = None) -> types.ModuleType:
    """`source`: the file's text as the judge read it, run instead of reading the file here: a task process kept
    for later judgments of the same task (sandbox/confinement/kept.py) runs exactly the text its key hashes, and a
    later judgment's copy of the task lies where its confinement lets it read nothing."""
    if source is not None:
        mod = types.ModuleType(name)
        mod.__file__ = path
        sys.modules[name] = mod
        exec(compile(source, path, "exec"), mod.__dict__)  # noqa: S102  (the task's own code, as exec_module runs it)
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def seed_everything(seed: int) -> None:
    # what torch.manual_seed does for the CPU and CUDA generators, without its walk over every other
    # backend (0.7 ms a call): timing draws a fresh input set per call
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(o, device) for o in obj)
    return obj


def make_inputs(mod: types.ModuleType, seed: int, device: torch.device, variant: str = "original",
                shapes: dict | None = None) -> list:
    """Inputs drawn on the device itself: generating gigabytes on the CPU costs tens of seconds.

    `signed` maps each floating input x to 4x - 2: tasks often draw from U[0, 1), where ReLU,
    HardTanh and friends are the identity and a kernel that skips them would pass. `shapes`
    overrides module-level sizes that only get_inputs() reads, for the generalization check.
    """
    seed_everything(seed)
    saved = {k: mod.__dict__[k] for k in (shapes or {}) if k in mod.__dict__}
    try:
        mod.__dict__.update({k: int(v) for k, v in (shapes or {}).items()})
        with torch.device(device):
            inputs = mod.get_inputs()
    finally:
        mod.__dict__.update(saved)
    inputs = list(to_device(list(inputs), device))
    if variant == "signed":
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x.mul_(4).sub_(2)
    return inputs


def make_init_inputs(mod: types.ModuleType, seed: int, device: torch.device) -> list:
    seed_everything(seed)
    with torch.device(device):
        return list(mod.get_init_inputs())


def build_reference(mod, init_inputs: list, seed: int, device: torch.device) -> torch.nn.Module:
    seed_everything(seed)
    with torch.device(device):
        model = mod.Model(*init_inputs)
    return model.to(device).eval()


def refill_inputs(held: list | None, fresh: list) -> list:
    """`fresh`'s values in `held`'s tensors, copied in place where shape, dtype and layout allow."""
    if held is None or len(held) != len(fresh):
        return fresh
    out = []
    for h, f in zip(held, fresh, strict=True):
        if (isinstance(h, torch.Tensor) and isinstance(f, torch.Tensor) and h.shape == f.shape
                and h.dtype == f.dtype and h.device == f.device and h.stride() == f.stride()):
            h.copy_(f)
            out.append(h)
        else:
            out.append(f)
    return out
