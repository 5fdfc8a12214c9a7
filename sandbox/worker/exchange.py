"""Exporting outputs without pickle (CUDA IPC handle or raw file), and rebuilding them in the judge."""

from __future__ import annotations

import base64
import math
import os

import torch


def type_name(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def export_tree(obj, keep: list, shm_dir: str, prefix: str):
    """Describe an output tree as JSON; tensor data goes by CUDA IPC handle or a raw file."""
    if isinstance(obj, torch.Tensor):
        spec = {"kind": "tensor", "type": type_name(obj), "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape), "device": str(obj.device)}
        if type(obj) is not torch.Tensor:
            return spec  # subclasses are refused by type; their data is never trusted
        t = obj.detach()
        if t.numel() == 0:
            return spec
        if t.is_cuda:
            storage = t.untyped_storage()
            (dev, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
            keep.append(t)
            spec["ipc"] = {
                "device": dev, "handle": base64.b64encode(handle).decode(), "size_bytes": size_bytes,
                "offset_bytes": offset_bytes, "ref_counter_handle": base64.b64encode(rc_handle).decode(),
                "ref_counter_offset": rc_offset,
                "event_handle": base64.b64encode(ev_handle).decode() if ev_handle else None,
                "event_sync_required": bool(ev_sync), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            }
        else:
            path = os.path.join(shm_dir, f"{prefix}.bin")
            flat = t.contiguous().reshape(-1)
            flat.view(torch.uint8).numpy().tofile(path)
            spec["file"] = path
        return spec
    if obj is None or isinstance(obj, bool | int | float):
        value = obj
        if isinstance(obj, float) and not math.isfinite(obj):
            value = repr(obj)
        return {"kind": "scalar", "type": type(obj).__name__, "value": value}
    if type(obj) in (tuple, list):
        return {"kind": type(obj).__name__,
                "items": [export_tree(o, keep, shm_dir, f"{prefix}_{i}") for i, o in enumerate(obj)]}
    if type(obj) is dict and all(isinstance(k, str) for k in obj):
        return {"kind": "dict", "items": {k: export_tree(v, keep, shm_dir, f"{prefix}_{i}")
                                          for i, (k, v) in enumerate(obj.items())}}
    return {"kind": "unsupported", "type": type_name(obj)}


def export_local(obj, store: list):
    """Like export_tree, for comparing two results inside one process (no IPC, no files)."""
    if isinstance(obj, torch.Tensor):
        store.append(obj)
        return {"kind": "tensor", "type": type_name(obj), "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape), "device": str(obj.device), "local": len(store) - 1}
    if type(obj) in (tuple, list):
        return {"kind": type(obj).__name__, "items": [export_local(o, store) for o in obj]}
    if type(obj) is dict:
        return {"kind": "dict", "items": {k: export_local(v, store) for k, v in obj.items()}}
    return export_tree(obj, [], "", "")


_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")}


def rebuild_tensor(spec: dict, device: torch.device, shm_dir: str, local: list | None = None) -> torch.Tensor:
    """`local` (tensors of this very process) is honoured only for the judge's own self-comparisons."""
    if local is not None:
        return local[int(spec["local"])]
    dtype = _DTYPES[spec["dtype"]]
    shape = [int(s) for s in spec["shape"]]
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if "ipc" in spec:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        ipc = spec["ipc"]
        ev = ipc["event_handle"]
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shape), tuple(int(s) for s in ipc["stride"]), int(ipc["storage_offset"]),
            torch.storage.TypedStorage, dtype, int(ipc["device"]), base64.b64decode(ipc["handle"]),
            int(ipc["size_bytes"]), int(ipc["offset_bytes"]), False, base64.b64decode(ipc["ref_counter_handle"]),
            int(ipc["ref_counter_offset"]), base64.b64decode(ev) if ev else None, bool(ipc["event_sync_required"]),
        )
    path = os.path.realpath(spec["file"])
    if os.path.dirname(path) != os.path.realpath(shm_dir):
        raise ValueError("output file outside the exchange directory")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if os.path.getsize(path) != numel * itemsize:
        raise ValueError("output file has the wrong size")
    return torch.from_file(path, shared=False, size=numel, dtype=dtype).reshape(shape).to(device)


_CLONE = torch.Tensor.clone  # captured when the worker starts, before any candidate code runs


def snapshot_tree(obj):
    """A timed call's outputs as they are the moment the call returned: plain tensors copied (a kept reference
    would let an output be filled in later, once the candidate saw it was kept), anything else as it is (a
    tensor subclass is refused by type when exported; its data is never trusted)."""
    if type(obj) is torch.Tensor:
        return _CLONE(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot_tree(o) for o in obj)
    if isinstance(obj, dict):
        return {k: snapshot_tree(v) for k, v in obj.items()}
    return obj


def leaves(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in leaves(o)]
    return []


def largest_tensor_bytes(obj) -> int:
    return max((t.numel() * t.element_size() for t in leaves(obj)), default=0)


def storage_bytes(obj) -> int:
    """Bytes actually backing the outputs (an expanded view writes only its storage)."""
    seen: dict[int, int] = {}
    for t in leaves(obj):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(o) for o in obj)
    return 0
