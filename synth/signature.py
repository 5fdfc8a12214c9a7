"""What a task computes, as a signature that ignores the form it is written in, and how close two are.

(About 400 lines, kept whole: the canonicalizing rules below and the similarity over their labels change together.)

Input: the plain-JSON trace of `sandbox/worker/trace.py` (every ATen op forward dispatched on the meta
device, its tensor arguments as references to the op or leaf that produced them). Canonicalizing:
  - layout-only ops (view, reshape, t, transpose, permute, expand, squeeze, contiguous, clone, dtype
    casts, detach) are transparent: their output is their input;
  - ops whose tensor arguments are all constants (torch.ones, arange, a mask built in forward) are
    constants, and every tensor leaf (input, parameter, buffer, constant) is one kind of leaf, `T`;
  - aliases and decompositions become one form: addmm and `linear` are mm then add, baddbmm is bmm then
    add, mean is sum then scale, clamp_min(0)/threshold(0)/clamp(min=0) are relu, hardtanh/relu6 are
    clamp, mul/div by a scalar (a number or a one-element tensor) is `scale`, add/sub of one is
    `shift`, x * sigmoid(x) is silu, 1/sqrt is rsqrt, _safe_softmax/_softmax are softmax, in-place
    twins (relu_) are their op, and split/select/slice/unbind are one `slice`;
  - ops the outputs do not depend on are dropped.
Labels: `names` the op, marked `~b` for an elementwise op whose operands broadcast (a bias add, not a
residual add); `ops` that with its reduction dims relative to the input's rank (softmax(dim=1) of a
matrix is softmax[-1]); `fine` that plus the output's dtype class and rank and each operand's role
(input, weight, constant, intermediate) and broadcast relation. Sizes and constants appear nowhere, so
other sizes, slopes or scales change nothing.

Similarity (`similarity`): Jaccard over five views, weighted: the three label levels and the sets of
dataflow bigrams and trigrams (paths along edges, `ops` labels). A task whose `names` multiset equals a
problem's scores 1: the same operators in another order, wiring or over other dims is the same problem
re-spelled (KernelBench passes reduction dims as constants: 47_Sum_reduction_over_a_dimension takes
`dim` from get_init_inputs).

About 400 lines: the op tables and canonicalization rules (most of it), then the signature and the similarity
between two (the last 70 lines, which read only `Signature` and could move to a module of their own).

About 405 lines, a little past the project's ~400: the canonical forms and the distance over them are one
table of rules read together; split, each half would need the other's op lists.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

TRANSPARENT = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "expand_as",
               "squeeze", "unsqueeze", "flatten", "unflatten", "alias", "detach", "clone", "contiguous",
               "_to_copy", "to", "lift_fresh", "lift_fresh_copy", "view_as", "broadcast_to", "movedim",
               "as_strided", "_reshape_alias", "type_as", "_unsafe_split"}
SLICE = {"slice", "select", "split", "unsafe_split", "split_with_sizes", "unsafe_split_with_sizes", "chunk",
         "unbind", "narrow", "diagonal"}
CREATE_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
ELEMENTWISE2 = {"add", "sub", "mul", "div", "maximum", "minimum", "pow", "where", "mask", "eq", "ne", "lt",
                "le", "gt", "ge", "atan2", "fmod", "remainder", "hypot", "logical_and", "logical_or", "xlogy",
                "bitwise_and", "bitwise_or", "copysign", "lerp", "clamp"}
COMMUTATIVE = {"add", "mul", "maximum", "minimum", "eq", "ne", "hypot", "logical_and", "logical_or",
               "bitwise_and", "bitwise_or"}
REDUCTIONS = {"sum", "amax", "amin", "argmax", "argmin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp",
              "norm", "any", "all", "softmax", "log_softmax", "cumsum", "cumprod", "max", "min", "median",
              "mode", "topk", "sort", "kthvalue", "cummax", "cummin", "cat", "stack", "nansum", "count_nonzero"}
RENAME = {"_softmax": "softmax", "_safe_softmax": "softmax", "_log_softmax": "log_softmax",
          "linalg_vector_norm": "norm", "native_layer_norm": "layer_norm", "native_batch_norm": "batch_norm",
          "_native_batch_norm_legit_no_training": "batch_norm", "_native_batch_norm_legit": "batch_norm",
          "native_group_norm": "group_norm", "max_pool1d_with_indices": "max_pool1d",
          "max_pool2d_with_indices": "max_pool2d", "max_pool3d_with_indices": "max_pool3d",
          "_adaptive_avg_pool2d": "adaptive_avg_pool2d", "_adaptive_avg_pool3d": "adaptive_avg_pool3d",
          "hardtanh": "clamp", "relu6": "clamp", "_cdist_forward": "cdist", "nll_loss_forward": "nll_loss",
          "_fused_rms_norm": "rms_norm", "true_divide": "div", "multiply": "mul", "subtract": "sub",
          "max.dim": "amax", "min.dim": "amin", "max.other": "maximum", "min.other": "minimum",
          "max.default": "amax", "min.default": "amin", "square": "pow", "special_expit": "sigmoid",
          # one product: einsum reaches bmm with a batch of 1 where `@` reaches mm, and a batched GEMM copy
          # of a level 1 GEMM problem is still that problem
          "mm": "matmul", "bmm": "matmul", "mv": "matmul", "dot": "matmul", "vdot": "matmul"}

WEIGHTS = {"names": 0.1, "ops": 0.2, "fine": 0.2, "edges": 0.25, "paths": 0.25}
# as sets: a net that repeats a block more or fewer times (an MLP of 3 layers or 8) is the same problem;
# `fine` keeps the counts, so depth still costs something
AS_SETS = ("names", "ops")
DEFAULT_THRESHOLD = 0.8


@dataclass
class _Node:
    name: str
    attr: str
    inputs: list  # operand values: ("node", index) or ("leaf", role, numel, leaf index)
    rank: int
    dtype: str
    operands: tuple = ()  # (role, relation) per tensor operand, for the fine label


@dataclass(frozen=True)
class Signature:
    names: Counter
    ops: Counter
    fine: Counter
    edges: frozenset
    paths: frozenset

    def to_json(self) -> dict:
        return {"names": dict(self.names), "ops": dict(self.ops), "fine": dict(self.fine),
                "edges": sorted(self.edges), "paths": sorted(self.paths)}

    @classmethod
    def from_json(cls, d: dict) -> Signature:
        return cls(Counter(d["names"]), Counter(d["ops"]), Counter(d["fine"]),
                   frozenset(tuple(e) for e in d["edges"]), frozenset(tuple(p) for p in d["paths"]))


class _Canon:
    """Raw trace -> canonical DAG. A value is ("leaf", role, numel, leaf index) or ("node", index)."""

    def __init__(self, trace: dict):
        self.trace = trace
        self.nodes: list[_Node] = []
        self.values: dict[tuple, tuple] = {}  # (raw node, output index) -> value

    def value(self, ref: dict) -> tuple:
        if "leaf" in ref:
            leaf = self.trace["leaves"][ref["leaf"]]
            numel = 1
            for s in leaf["shape"]:
                numel *= s
            role = "c" if leaf["role"] == "const" else "w" if leaf["role"] in ("param", "buffer") else "in"
            return ("leaf", role, numel, ref["leaf"])
        return self.values.get((ref["node"], ref.get("out", 0)), ("leaf", "c", 0, -1))

    def add(self, name: str, attr: str, operands: list[tuple], out: dict | None) -> tuple:
        """operands: (value, shape) of each tensor operand. Returns the new node's value.

        Scaling commutes with products and composes with itself, so it is moved after a matmul and
        chains collapse: sdpa's scaled q and k, `(q @ k.T) / sqrt(d)` and `(x * 2) @ w` meet one form."""
        if name in ("matmul", "scale"):
            moved = 0
            for i, (v, s) in enumerate(operands):
                p = self.producer(v)
                if p is not None and p.name == "scale":
                    operands = [*operands[:i], (p.inputs[0], s), *operands[i + 1:]]
                    moved += 1
            if name == "matmul" and moved:
                return self.add("scale", "", [(self.add(name, attr, operands, out), out["shape"] if out else [])], out)
        rank = len(out["shape"]) if out else 0
        shape = out["shape"] if out else []
        roles = []
        for v, s in operands:
            role = v[1] if v[0] == "leaf" else "x"
            roles.append((role, "=" if list(s) == list(shape) else "b") if name in ELEMENTWISE2 else (role, len(s)))
        if name in COMMUTATIVE:
            roles.sort()
        node = _Node(name, attr, [v for v, _ in operands], rank,
                     out["dtype"] if out else "f", tuple(roles))
        self.nodes.append(node)
        return ("node", len(self.nodes) - 1)

    def producer(self, v: tuple) -> _Node | None:
        return self.nodes[v[1]] if v[0] == "node" else None


def _scalar_like(v: tuple) -> bool:
    return v[0] == "leaf" and v[2] <= 1


def _dims(args: dict, rank: int, name: str) -> str:
    """Reduction dims as negative indices of the input's rank, sorted; `all` for every dim."""
    if name == "layer_norm":
        k = len(args.get("normalized_shape", {}).get("list", []))
        dims = list(range(-k, 0))
    else:
        d = args.get("dim", {})
        if "list" in d:
            dims = [x.get("v") for x in d["list"]]
        elif d.get("v") is not None:
            dims = [d["v"]]
        else:
            dims = []
        dims = [x for x in dims if isinstance(x, int)]
        if not dims and name in ("cat", "stack"):
            dims = [0]
    if not dims and name not in ("cat", "stack"):
        return "[all]"
    norm = sorted({x - rank if x >= 0 else x for x in dims})
    if rank and len(norm) >= rank and name not in ("cat", "stack"):
        return "[all]"
    return "[" + ",".join(str(x) for x in norm) + "]"


def _tensor_args(args: dict) -> list[dict]:
    """Every tensor argument in schema order, the tensors of a list argument (cat's) included."""
    return [x for v in args.values() for x in ([v] if "shape" in v else v.get("list", [])) if "shape" in x]


def _num(args: dict, key: str):
    v = args.get(key, {})
    return v.get("v") if isinstance(v, dict) else None


def canonical(trace: dict) -> list[_Node]:
    c = _Canon(trace)
    for i, raw in enumerate(trace["nodes"]):
        vals = [(c.value(a), a["shape"]) for a in _tensor_args(raw["args"])]
        result = _one(c, raw["op"], raw.get("overload", ""), raw.get("view", False), raw["args"], vals, raw["out"])
        for j in range(len(raw["out"])):  # every output of a multi-output op (split, max.dim) is its node
            c.values[(i, j)] = result
    live = _live(c, trace)
    return [n if k in live else None for k, n in enumerate(c.nodes)]


def _one(c: _Canon, op: str, overload: str, view: bool, args: dict, vals: list, outs: list) -> tuple:
    """One raw op into the canonical DAG (zero, one or two nodes); returns the value of its output."""
    out = next((o for o in outs if o), None)
    base = op[:-1] if op.endswith("_") and not op.endswith("__") and op != "_" else op
    name = RENAME.get(f"{base}.{overload}", RENAME.get(base, base))
    if base == "copy" and "src" in args and "shape" in args["src"]:
        return c.value(args["src"])
    if not vals or base in CREATE_LIKE or all(v[0] == "leaf" and v[1] == "c" for v, _ in vals):
        numel = 1
        for s in (out or {}).get("shape", []):
            numel *= s
        return ("leaf", "c", numel, -1)
    if base in TRANSPARENT or (view and base not in SLICE and base != "unfold"):
        return vals[0][0]
    if base in SLICE:
        return c.add("slice", "", vals[:1], out)
    if base in ("addmm", "baddbmm", "addmv", "addbmm", "linear"):
        if base == "linear":
            x, w = vals[0], vals[1]
            bias = vals[2] if len(vals) > 2 else None
        else:
            bias, x, w = vals[0], vals[1], vals[2]
        prod = c.add("matmul", "", [x, w], out)
        return c.add("add", "", [(prod, out["shape"]), bias], out) if bias else prod
    if base in ("addcmul", "addcdiv"):
        prod = c.add("mul" if base == "addcmul" else "div", "", vals[1:3], out)
        return c.add("add", "", [(prod, out["shape"]), vals[0]], out)
    if base == "mean":
        s = c.add("sum", _dims(args, len(vals[0][1]), "sum"), vals[:1], out)
        return c.add("scale", "", [(s, out["shape"])], out)
    if base in ("clamp_min", "threshold", "clamp", "clamp_max") and len(vals) == 1:
        lo = _num(args, "min") if base == "clamp" else _num(args, "min" if base == "clamp_min" else "threshold")
        hi = _num(args, "max") if base == "clamp" else None
        if base == "clamp_max":
            lo, hi = None, _num(args, "max")
        if base in ("clamp_min", "threshold") or (base == "clamp" and hi is None):
            name = "relu" if lo == 0 and (base != "threshold" or _num(args, "value") == 0) else "clamp_min"
        elif lo is None:
            name = "clamp_max"
        else:
            name = "clamp"
        return c.add(name, "", vals[:1], out)
    if base in ("maximum", "minimum", "max", "min") and len(vals) == 2 and any(_scalar_like(v) for v, _ in vals):
        keep = [v for v in vals if not _scalar_like(v[0])] or vals[:1]
        return c.add("clamp_min" if base in ("maximum", "max") else "clamp_max", "", keep[:1], out)
    masked = _masking(c, base, vals, out)
    if masked is not None:
        return masked
    if base in ("mul", "div", "add", "sub", "rsub") and len(vals) <= 2:
        tensors = [v for v in vals if not _scalar_like(v[0])]
        if len(tensors) == 1 and (len(vals) == 1 or len(tensors) < len(vals)):
            kind = "scale" if base in ("mul", "div") else "shift"
            return c.add(kind, "", tensors, out)
        if base == "mul" and len(vals) == 2:
            for a, b in (vals, vals[::-1]):
                p = c.producer(b[0])
                if p is not None and p.name == "sigmoid" and p.inputs == [a[0]]:
                    return c.add("silu", "", [a], out)
                if a[0] == b[0]:
                    return c.add("pow", "", [a], out)
        if base == "rsub":
            vals = vals[::-1]
            name = "sub"
    if base == "reciprocal":
        p = c.producer(vals[0][0])
        if p is not None and p.name == "sqrt":
            return c.add("rsqrt", "", [(p.inputs[0], vals[0][1])], out)
    if name == "batch_norm" and (_num(args, "training") or base == "_native_batch_norm_legit"):
        # normalized by the input's own statistics: InstanceNorm reaches ATen this way (a batch norm of
        # the reshaped input), a model in eval mode's BatchNorm does not (running statistics)
        return c.add("batch_norm_stats", "", vals[:1], out)
    if base in ("convolution", "_convolution", "conv2d", "conv1d", "conv3d", "conv_transpose2d"):
        w = args.get("weight", {})
        nd = max(len(w.get("shape", [0, 0, 0, 0])) - 2, 1)
        transposed = bool(_num(args, "transposed")) or "transpose" in base
        groups = _num(args, "groups") or 1
        attr = f"{nd}d" + ("T" if transposed else "") + ("g" if groups != 1 else "")
        return c.add("conv" + attr, "", vals, out)  # 1d/2d/3d, transposed, grouped: other ops, not constants
    attr = _dims(args, len(vals[0][1]), name) if name in REDUCTIONS or name == "layer_norm" else ""
    return c.add(name, attr, vals, out)


COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "logical_not", "bitwise_not"}


def _masking(c: _Canon, base: str, vals: list, out) -> tuple | None:
    """Masking as one `mask` op: masked_fill(x, m, v), where(m, x, v) and x + where(m, 0, -inf) (what sdpa
    makes of a boolean mask) all fill x where m holds, and a mask compared with a scalar first
    (`bias == 0`) is that mask."""
    def is_const(v):
        return _scalar_like(v[0]) or (v[0][0] == "leaf" and v[0][1] == "c")

    def source(v):
        p = c.producer(v[0])
        while p is not None and p.name in COMPARE and len(p.inputs) == 1:
            v = (p.inputs[0], v[1])
            p = c.producer(v[0])
        return v

    if base == "masked_fill" and len(vals) >= 2:
        return c.add("mask", "", [vals[0], source(vals[1])], out)
    if base == "where" and len(vals) == 3 and sum(is_const(v) for v in vals[1:]) == 1:
        x = vals[1] if not is_const(vals[1]) else vals[2]
        return c.add("mask", "", [x, source(vals[0])], out)
    if base == "add" and len(vals) == 2:
        for x, m in (vals, vals[::-1]):
            p = c.producer(m[0])
            if p is not None and p.name == "where" and len(p.inputs) == 3 and all(
                    i[0] == "leaf" and i[1] == "c" for i in p.inputs[1:]):
                return c.add("mask", "", [x, source((p.inputs[0], m[1]))], out)
    return None


def _live(c: _Canon, trace: dict) -> set[int]:
    """Canonical nodes the outputs depend on (all of them for a trace cut short)."""
    if trace.get("outputs") is None:
        return set(range(len(c.nodes)))
    todo = [v[1] for v in (c.value(r) for r in trace["outputs"]) if v[0] == "node"]
    live: set[int] = set()
    while todo:
        k = todo.pop()
        if k in live:
            continue
        live.add(k)
        todo.extend(v[1] for v in c.nodes[k].inputs if v[0] == "node")
    return live


def _labels(n: _Node) -> tuple[str, str, str]:
    broadcast = n.name in ELEMENTWISE2 and any(rel == "b" for _, rel in n.operands)
    name = n.name + ("~b" if broadcast else "")
    op = name + n.attr
    fine = f"{op}|{n.dtype}{n.rank}|" + ",".join(f"{r}{rel}" for r, rel in n.operands)
    return name, op, fine


MAX_PATHS_PER_NODE = 64  # a concat of 100 branches would otherwise make 100^2 trigrams


def signature(trace: dict) -> Signature:
    nodes = canonical(trace)
    names, ops, fine = Counter(), Counter(), Counter()
    label: dict[int, str] = {}
    for k, n in enumerate(nodes):
        if n is None:
            continue
        a, b, f = _labels(n)
        names[a] += 1
        ops[b] += 1
        fine[f] += 1
        label[k] = b
    edges: set = set()
    paths: set = set()
    for k, n in enumerate(nodes):
        if n is None:
            continue
        parents = [label[v[1]] if v[0] == "node" else "T" for v in n.inputs]
        edges.update((p, label[k]) for p in parents)
        grand = set()
        for v in n.inputs:
            if v[0] != "node":
                continue
            grand.update((label[g[1]] if g[0] == "node" else "T", label[v[1]]) for g in nodes[v[1]].inputs)
            if len(grand) > MAX_PATHS_PER_NODE:
                break
        paths.update((g, p, label[k]) for g, p in grand)
    return Signature(names, ops, fine, frozenset(edges), frozenset(paths))


def _jaccard(a, b) -> float | None:
    """None where both are empty (two single-op tasks have no paths): that view says nothing."""
    if isinstance(a, Counter):
        union = sum((a | b).values())
        return sum((a & b).values()) / union if union else None
    union = len(a | b)
    return len(a & b) / union if union else None


def similarity(a: Signature, b: Signature) -> dict:
    parts = {}
    for k in WEIGHTS:
        x, y = getattr(a, k), getattr(b, k)
        parts[k] = _jaccard(set(x), set(y)) if k in AS_SETS else _jaccard(x, y)
    said = {k: v for k, v in parts.items() if v is not None}
    total = sum(WEIGHTS[k] for k in said)
    score = sum(WEIGHTS[k] * v for k, v in said.items()) / total if total else 0.0
    exact = bool(a.names) and a.names == b.names
    if exact:
        score = 1.0  # the same operators, wired, ordered or reduced otherwise: the same problem re-spelled
    return {"score": round(score, 4), "exact_ops": exact,
            **{k: None if v is None else round(v, 4) for k, v in parts.items()}}


def matched(a: Signature, b: Signature, limit: int = 6) -> dict:
    """What two signatures share: the common operators and the longest common dataflow paths."""
    shared_paths = sorted(a.paths & b.paths, key=lambda p: (sum(x == "T" for x in p), p))
    return {"ops": sorted((a.ops & b.ops).elements()),
            "paths": [" > ".join(p) for p in shared_paths[:limit]]}


def nearest(sig: Signature, ref: list[tuple[str, Signature]]) -> dict:
    best: dict = {"problem": None, "score": -1.0}
    best_sig = None
    for name, other in ref:
        sim = similarity(sig, other)
        if sim["score"] > best["score"]:
            best, best_sig = {"problem": name, **sim}, other
    if best_sig is not None:
        best["matched"] = matched(sig, best_sig)
    return best
