"""Operators as composable recipes, shape rules, and the rendering of a chain into a task file.

An operator is a constructor template (a module held as `self.opK`) or a plain call, plus a shape
family: the rule that says which input shapes it accepts, what parameters it needs, and what shape
it returns. Composition (`synth.compose`) chains operators by these rules alone, so a chain's
shapes are consistent by construction; the filter then executes it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

Shape = tuple[int, ...]

HEADER = "import math\n\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"

# starting shapes per backend: big enough on a GPU for the 1-100 ms band, small on a CPU
SIZES: dict[str, dict[str, Shape]] = {
    "cpu": {"2d": (16, 256), "3d": (4, 32, 128), "img": (4, 8, 16, 16), "heads": (2, 4, 32, 16)},
    "cuda": {"2d": (4096, 16384), "3d": (16, 1024, 2048), "img": (32, 64, 128, 128),
             "heads": (16, 16, 1024, 128)},
}


@dataclass(frozen=True)
class OpSpec:
    name: str                 # where it comes from, e.g. "torch.nn.GELU"
    library: str              # "torch" | "transformers"
    family: str               # a key of FAMILIES
    call: str                 # forward template: {x} the running tensor, {m} the module, {y0}.. extra inputs
    module: str | None = None  # constructor template, e.g. "nn.Linear({d}, {n})"
    prelude: str = ""         # inlined helper source (transformers code), self-contained
    how: str = "recipe"       # "introspection" | "recipe" | "inlined"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Step:
    op: OpSpec
    params: dict[str, int] = field(default_factory=dict)
    extra: list[Shape] = field(default_factory=list)  # shapes of extra inputs this step reads
    out: Shape = ()


# ----------------------------------------------------------------------------------------------
# shape families: (shape, rng) -> (params, extra input shapes, output shape), or None if not accepted

def _divisor(c: int, rng: random.Random) -> int:
    opts = [g for g in (2, 4, 8) if c % g == 0]
    return rng.choice(opts) if opts else 1


def _width(d: int, rng: random.Random, cap: int) -> int:
    return max(8, min(cap, rng.choice([d // 2, d, 2 * d])))


def _plan(family: str, s: Shape, rng: random.Random, cap: int):
    r = len(s)
    if family == "unary":
        return ({}, [], s) if r >= 1 else None
    if family == "lastdim":
        return ({"d": s[-1]}, [], s) if r >= 2 else None
    if family == "linear":
        if r < 2:
            return None
        n = _width(s[-1], rng, cap)
        return {"d": s[-1], "n": n}, [], s[:-1] + (n,)
    if family == "mlp":
        return ({"d": s[-1], "h": min(cap, 2 * s[-1])}, [], s) if r >= 2 else None
    if family == "matmul":
        if r != 2:
            return None
        n = _width(s[-1], rng, cap)
        return {"d": s[-1], "n": n}, [(s[-1], n)], s[:-1] + (n,)
    if family == "binary":
        return ({}, [s], s) if r >= 1 else None
    if family == "channels":
        return ({"c": s[1], "g": _divisor(s[1], rng)}, [], s) if r == 4 else None
    if family == "conv":
        if r != 4:
            return None
        n = max(4, min(cap // 16 or 4, rng.choice([s[1], 2 * s[1]])))
        return {"c": s[1], "n": n}, [], (s[0], n, s[2], s[3])
    if family == "pool":
        return ({}, [], s[:2] + (s[2] // 2, s[3] // 2)) if r == 4 and s[2] >= 8 and s[3] >= 8 else None
    if family == "reduce":
        return ({}, [], s[:-1]) if r >= 3 else None
    if family == "heads":
        return ({"s": s[2], "d": s[3]}, [], s) if r == 4 and s[3] % 2 == 0 else None
    raise KeyError(family)


FAMILIES = ("unary", "lastdim", "linear", "mlp", "matmul", "binary", "channels", "conv", "pool", "reduce", "heads")
START = {"unary": "2d", "lastdim": "3d", "linear": "2d", "mlp": "3d", "matmul": "2d", "binary": "2d",
         "channels": "img", "conv": "img", "pool": "img", "reduce": "3d", "heads": "heads"}


def plan_step(op: OpSpec, shape: Shape, rng: random.Random, backend: str) -> Step | None:
    cap = max(SIZES[backend]["2d"][-1], 64)
    got = _plan(op.family, shape, rng, cap)
    if got is None:
        return None
    params, extra, out = got
    return Step(op, params, list(extra), tuple(out))


# ----------------------------------------------------------------------------------------------
# rendering

def _shape_expr(s: Shape, names: dict[int, str]) -> str:
    return ", ".join(names.get(i, str(v)) for i, v in enumerate(s))


def render(steps: list[Step], input_shape: Shape, title: str) -> str:
    """A KernelBench task file: Model(nn.Module) chaining the steps, get_inputs, get_init_inputs."""
    preludes: list[str] = []
    for st in steps:
        if st.op.prelude and st.op.prelude not in preludes:
            preludes.append(st.op.prelude)
    init, body, extra_inputs = [], [], []
    for k, st in enumerate(steps):
        fmt = dict(st.params)
        ys = []
        for s in st.extra:
            ys.append(f"y{len(extra_inputs)}")
            # an operand shaped like the running tensor shares its batch, so resizing the batch resizes both
            extra_inputs.append((s, st.op.family == "binary"))
        fmt.update({f"y{i}": y for i, y in enumerate(ys)})
        if st.op.module:
            init.append(f"        self.op{k} = {st.op.module.format(**fmt)}")
            fmt["m"] = f"self.op{k}"
        fmt["x"] = "x"
        body.append(f"        x = {st.op.call.format(**fmt)}  # {st.op.name}")
    args = ", ".join(["x"] + [f"y{i}" for i in range(len(extra_inputs))])
    lines = [HEADER, *(p.rstrip() + "\n\n" for p in preludes),
             "class Model(nn.Module):",
             f'    """{title}"""',
             "",
             "    def __init__(self):",
             "        super().__init__()",
             *init,
             "",
             f"    def forward(self, {args}):",
             *body,
             "        return x",
             "",
             "",
             f"batch_size = {input_shape[0]}",
             "",
             "",
             "def get_inputs():",
             f"    x = torch.randn({_shape_expr(input_shape, {0: 'batch_size'})})",
             *[f"    y{i} = torch.randn({_shape_expr(s, {0: 'batch_size'} if lead else {})})"
               for i, (s, lead) in enumerate(extra_inputs)],
             f"    return [{args}]",
             "",
             "",
             "def get_init_inputs():",
             "    return []",
             ""]
    return "\n".join(lines)


def steps_to_json(steps: list[Step]) -> list[dict]:
    return [{"op": st.op.name, "family": st.op.family, "params": st.params, "extra": [list(s) for s in st.extra],
             "out": list(st.out)} for st in steps]
