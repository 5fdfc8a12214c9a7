"""Comparing the candidate's outputs with the reference's (runs in the reference process only)."""

from __future__ import annotations

import math
import sys
import time

import torch

from sandbox.worker.exchange import rebuild_tensor, type_name
from sandbox.worker.protocol import AFTER_REPLY

_CHUNK = 1 << 26
# seconds spent opening the candidate's tensors (a CUDA IPC handle, or a file) in this compare request: on an H200
# under eight judgments 0.25 s of a verify's 1.0 s of comparisons ([4096, 4096], five trials)
OPENED = {"s": 0.0}
_WARMED: set[str] = set()  # the devices warm() ran on in this process


def open_tensor(spec: dict, device, shm_dir: str, local: list | None = None) -> torch.Tensor:
    """rebuild_tensor, its time added to OPENED."""
    t = time.perf_counter()
    try:
        return rebuild_tensor(spec, device, shm_dir, local)
    finally:
        OPENED["s"] += time.perf_counter() - t


def warm(device: torch.device) -> None:
    """Launch, on a few thousand float32 values, the kernels a comparison and the reference's checks of its own
    outputs and of the inputs use. CUDA loads a kernel at its first launch in a process (lazy loading): on an H200 a
    process's first comparison of a 6 GiB output took 0.22 s and every later one 0.06 s (3daac8d:bench/compare_cost.py), and
    each verify and profile starts a task process. A role queues this after its set-up's reply (protocol.AFTER_REPLY)
    to overlap the candidate's set-up. Nothing here draws from a random generator."""
    if device.type != "cuda" or str(device) in _WARMED:
        return
    x = torch.linspace(-1.0, 1.0, 4096, device=device)
    compare_tensor("warm-up", x, x * (1 + 1e-7), 1e-5, 1e-5)
    bool(torch.isfinite(x).all())
    torch.equal(x, x.clone())
    torch.cuda.synchronize(device)
    _WARMED.add(str(device))


def queue_warm(device: torch.device) -> None:
    """warm(device) after this request's reply, where it is still to do (a kept process warms once)."""
    if device.type == "cuda" and str(device) not in _WARMED:
        AFTER_REPLY.append(("compare_warm", lambda: warm(device)))


def compare_tensor(path: str, ref: torch.Tensor, cand: torch.Tensor, atol: float, rtol: float,
                   rel_norm_tol: float = 0.05) -> dict:
    out = {"path": path, "ok": False, "shape": list(ref.shape), "dtype": str(ref.dtype).removeprefix("torch."),
           "numel": ref.numel()}
    a = ref.detach().reshape(-1)
    b = cand.detach().reshape(-1)
    exact = not (ref.is_floating_point() or ref.is_complex())
    mismatched = 0
    max_abs = 0.0
    max_rel = 0.0
    nan_bad = 0
    sq_ref = sq_err = 0.0
    first = None
    for start in range(0, a.numel(), _CHUNK):
        x = a[start:start + _CHUNK]
        y = b[start:start + _CHUNK]
        if exact:
            bad = x != y
            diff = (x.double() - y.double()).abs() if x.dtype != torch.bool else bad.double()
            rel = diff / x.double().abs().clamp_min(1e-12)
        else:
            if x.is_complex():
                x, y = torch.view_as_real(x).reshape(-1), torch.view_as_real(y).reshape(-1)
            x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            y32 = y.to(x32.dtype)
            fast = _finite_chunk(x32, y32, atol, rtol)
            if fast is not None:
                n_bad, chunk_abs, chunk_rel, ref2, err2 = fast
                sq_ref += ref2
                sq_err += err2
                max_abs = max(max_abs, chunk_abs)
                max_rel = max(max_rel, min(chunk_rel, sys.float_info.max))
                if n_bad and first is None:
                    bad = (x32 - y32).abs() > atol + rtol * x32.abs()
                    first = start + int(torch.argmax(bad.to(torch.uint8)))
                mismatched += n_bad
                continue
            diff = (x32 - y32).abs()
            odd = torch.isnan(diff)  # NaN or Inf in either operand (inf - inf is NaN too)
            if bool(odd.any()) or bool(torch.isinf(diff).any()):
                x_nan, y_nan = torch.isnan(x32), torch.isnan(y32)
                x_inf, y_inf = torch.isinf(x32), torch.isinf(y32)
                nan_pos = (x_nan != y_nan) | (x_inf != y_inf) | (x_inf & y_inf & (torch.sign(x32) != torch.sign(y32)))
                nan_bad += int(nan_pos.sum())
                finite = ~(x_nan | x_inf) & ~(y_nan | y_inf)
                zero = torch.zeros((), dtype=x32.dtype, device=x32.device)
                diff = torch.where(finite, diff, zero)
                xf = torch.where(finite, x32, zero)
                bad = (diff > atol + rtol * xf.abs()) | nan_pos
            else:
                xf = x32
                bad = diff > atol + rtol * x32.abs()
            rel = diff / xf.abs().clamp_min(torch.finfo(x32.dtype).tiny)
            sq_ref += float(torch.linalg.vector_norm(xf, dtype=torch.float64)) ** 2
            sq_err += float(torch.linalg.vector_norm(diff, dtype=torch.float64)) ** 2
        n_bad = int(bad.sum())
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
            # against a zero reference the float32 quotient overflows to inf, which JSON writes as null and the
            # verify tool's output schema (a number) rejects: the MCP client then fails the call, not the kernel
            max_rel = max(max_rel, min(float(rel.max()), sys.float_info.max))
        if n_bad and first is None:
            idx = start + int(torch.argmax(bad.to(torch.uint8)))
            first = idx
        mismatched += n_bad
    out.update(mismatched=mismatched, max_abs_error=max_abs, max_rel_error=max_rel)
    if not exact and not nan_bad and not mismatched:
        # elementwise tolerance lets a near-zero output pass as zeros; the error norm does not
        ref_norm, err_norm = math.sqrt(sq_ref), math.sqrt(sq_err)
        out["rel_error_norm"] = err_norm / ref_norm if ref_norm > 0 else err_norm
        if ref_norm > 0 and out["rel_error_norm"] > rel_norm_tol:
            out["reason"] = "value_mismatch"
            out["message"] = (f"{path}: every element is within atol={atol:g}/rtol={rtol:g}, but the relative error "
                              f"norm |out - ref| / |ref| is {out['rel_error_norm']:.3g} (limit {rel_norm_tol:g}): the "
                              "output does not follow the reference (constant or near-zero output?)")
            return out
    if first is not None:
        flat_ref, flat_cand = a[first], b[first]
        out["first_mismatch_index"] = [int(i) for i in torch.unravel_index(torch.tensor(first), ref.shape)] \
            if ref.dim() else []
        out["expected_value"] = _num(flat_ref)
        out["actual_value"] = _num(flat_cand)
    if nan_bad:
        out["reason"] = "nan_inf_mismatch"
        out["message"] = f"{path}: NaN/Inf at {nan_bad} position(s) where the reference differs"
    elif mismatched:
        out["reason"] = "value_mismatch"
        out["message"] = (f"{path}: {mismatched} of {ref.numel()} elements differ beyond atol={atol:g} rtol={rtol:g} "
                          f"(max abs error {max_abs:.4g}, max rel error {max_rel:.4g}; first at index "
                          f"{out.get('first_mismatch_index')}: expected {out.get('expected_value')}, "
                          f"got {out.get('actual_value')})")
    else:
        out["ok"] = True
    return out


def _finite_chunk(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> tuple[int, float, float, float,
                                                                                       float] | None:
    """(mismatched, max abs error, max rel error, |x|^2, |x - y|^2) of a chunk in which every difference is finite,
    read back in one device synchronisation; None when some difference is NaN or Inf (the caller's general path
    tells the cases apart). Verify compares gigabytes per input set: on a GPU, the read-backs of the general path
    (seven per chunk) and its extra passes cost more than the arithmetic."""
    diff = torch.sub(x, y).abs_()
    ax = x.abs()
    bad = diff > torch.mul(ax, rtol).add_(atol)
    stats = torch.stack([diff.amax().double(), bad.sum().double(),
                         torch.linalg.vector_norm(x, dtype=torch.float64),
                         torch.linalg.vector_norm(diff, dtype=torch.float64),
                         torch.div(diff, ax.clamp_min_(torch.finfo(x.dtype).tiny)).amax().double()])
    max_abs, n_bad, ref_norm, err_norm, max_rel = stats.tolist()
    if not math.isfinite(max_abs):  # NaN propagates through amax, and an infinite difference shows as inf
        return None
    return int(n_bad), max_abs, max_rel, ref_norm ** 2, err_norm ** 2


def _num(t: torch.Tensor) -> float | None:
    try:
        v = t.item()
        v = float(v.real) if isinstance(v, complex) else float(v)
        return v if math.isfinite(v) else None
    except (TypeError, ValueError, RuntimeError):
        return None


def compare_tree(path: str, ref, spec: dict, device, shm_dir: str, tol: dict, results: list,
                 local: list | None = None) -> None:
    """Walk the reference output and the candidate's spec together; append one dict per leaf."""
    def fail(reason: str, message: str) -> None:
        results.append({"path": path, "ok": False, "reason": reason, "message": message})

    if isinstance(ref, torch.Tensor):
        if spec.get("kind") != "tensor":
            return fail("output_structure", f"{path}: expected a tensor, got {spec.get('type', spec.get('kind'))}")
        if spec["type"] != "torch.Tensor":
            return fail("output_type", f"{path}: expected exactly torch.Tensor, got {spec['type']} "
                        "(tensor subclasses are not accepted)")
        if list(ref.shape) != spec["shape"]:
            return fail("shape_mismatch", f"{path}: expected shape {list(ref.shape)}, got {spec['shape']}")
        ref_dtype = str(ref.dtype).removeprefix("torch.")
        if ref_dtype != spec["dtype"]:
            return fail("dtype_mismatch", f"{path}: expected dtype {ref_dtype}, got {spec['dtype']}")
        if torch.device(spec["device"]).type != ref.device.type:
            return fail("device_mismatch", f"{path}: expected device {ref.device.type}, got {spec['device']}")
        cand = open_tensor(spec, device, shm_dir, local)
        atol, rtol = tol.get(ref_dtype, tol["default"])
        results.append(compare_tensor(path, ref, cand, atol, rtol, tol.get("rel_norm", (0.05,))[0]))
        return
    if ref is None or isinstance(ref, bool | int | float):
        if spec.get("kind") != "scalar" or spec.get("type") != type(ref).__name__:
            return fail("output_type", f"{path}: expected {type(ref).__name__}, got {spec.get('type', spec.get('kind'))}")
        value = spec["value"]
        value = float(value) if isinstance(value, str) else value
        if isinstance(ref, float):
            atol, rtol = tol["default"]
            same = (math.isnan(ref) and math.isnan(value)) or ref == value or abs(ref - value) <= atol + rtol * abs(ref)
        else:
            same = ref == value
        results.append({"path": path, "ok": bool(same), "numel": 1,
                        **({} if same else {"reason": "value_mismatch",
                                            "message": f"{path}: expected {ref!r}, got {value!r}"})})
        return
    if type(ref) in (tuple, list):
        if spec.get("kind") != type(ref).__name__:
            return fail("output_structure", f"{path}: expected a {type(ref).__name__} of {len(ref)}, "
                        f"got {spec.get('kind') if spec.get('kind') != 'unsupported' else spec.get('type')}")
        if len(spec["items"]) != len(ref):
            return fail("output_structure", f"{path}: expected {len(ref)} items, got {len(spec['items'])}")
        for i, (r, s) in enumerate(zip(ref, spec["items"], strict=True)):
            compare_tree(f"{path}[{i}]", r, s, device, shm_dir, tol, results, local)
        return
    if type(ref) is dict:
        if spec.get("kind") != "dict" or sorted(spec["items"]) != sorted(ref):
            return fail("output_structure", f"{path}: expected a dict with keys {sorted(ref)}")
        for k in ref:
            compare_tree(f"{path}[{k!r}]", ref[k], spec["items"][k], device, shm_dir, tol, results, local)
        return
    fail("output_structure", f"{path}: the reference returned an unsupported type {type_name(ref)}")
