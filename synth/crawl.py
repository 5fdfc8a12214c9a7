"""Seed operators from torch and (optionally) transformers.

Introspection where it works: every public `torch.nn.functional` function, argument-free
`torch.nn` module and elementwise tensor op (one with an in-place twin, like `sin_`) is tried on a
sample tensor, and kept as a shape-preserving operator if it returns a finite float tensor of the
same shape that is not the input itself. A recipe table covers operators that need arguments or
change shapes. transformers code is inlined into the task (its source, decorators stripped,
checked to compute what the original computes), so a task never needs transformers to run.
This runs only library code (torch, transformers), never a task's.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings

from synth.ops import HEADER, OpSpec

# containers, identities and operators whose meaning needs arguments the probe cannot guess
_SKIP_MODULES = {"Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Container",
                 "Identity", "Flatten", "Unflatten", "LazyLinear", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d"}

RECIPES: list[OpSpec] = [
    OpSpec("torch.nn.LayerNorm", "torch", "lastdim", "{m}({x})", "nn.LayerNorm({d})"),
    OpSpec("torch.nn.RMSNorm", "torch", "lastdim", "{m}({x})", "nn.RMSNorm({d})"),
    OpSpec("torch.nn.functional.softmax", "torch", "lastdim", "F.softmax({x}, dim=-1)"),
    OpSpec("torch.nn.functional.log_softmax", "torch", "lastdim", "F.log_softmax({x}, dim=-1)"),
    OpSpec("torch.nn.functional.normalize", "torch", "lastdim", "F.normalize({x}, dim=-1)"),
    OpSpec("torch.cumsum", "torch", "lastdim", "torch.cumsum({x}, dim=-1)"),
    OpSpec("torch.nn.Linear", "torch", "linear", "{m}({x})", "nn.Linear({d}, {n})"),
    OpSpec("torch.matmul", "torch", "matmul", "torch.matmul({x}, {y0})"),
    OpSpec("torch.add", "torch", "binary", "torch.add({x}, {y0})"),
    OpSpec("torch.mul", "torch", "binary", "torch.mul({x}, {y0})"),
    OpSpec("torch.maximum", "torch", "binary", "torch.maximum({x}, {y0})"),
    OpSpec("torch.nn.BatchNorm2d", "torch", "channels", "{m}({x})", "nn.BatchNorm2d({c})"),
    OpSpec("torch.nn.GroupNorm", "torch", "channels", "{m}({x})", "nn.GroupNorm({g}, {c})"),
    OpSpec("torch.nn.InstanceNorm2d", "torch", "channels", "{m}({x})", "nn.InstanceNorm2d({c})"),
    OpSpec("torch.nn.Conv2d", "torch", "conv", "{m}({x})", "nn.Conv2d({c}, {n}, 3, padding=1)"),
    OpSpec("torch.nn.MaxPool2d", "torch", "pool", "{m}({x})", "nn.MaxPool2d(2)"),
    OpSpec("torch.nn.AvgPool2d", "torch", "pool", "{m}({x})", "nn.AvgPool2d(2)"),
    OpSpec("torch.sum", "torch", "reduce", "torch.sum({x}, dim=-1)"),
    OpSpec("torch.mean", "torch", "reduce", "torch.mean({x}, dim=-1)"),
    OpSpec("torch.amax", "torch", "reduce", "torch.amax({x}, dim=-1)"),
    OpSpec("torch.nn.functional.scaled_dot_product_attention", "torch", "heads",
           "F.scaled_dot_product_attention({x}, {x}, {x})"),
]


def _same_shape_op(fn, x) -> str | None:
    """None if fn(x) is a usable shape-preserving operator, else why not."""
    import torch

    before = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            y = fn(x)
        except Exception:
            return "needs_arguments"
    if not torch.equal(before, x):
        return "mutates_input"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return "changes_shape_or_dtype"
    if not torch.isfinite(y).all():
        return "nan_on_randn"
    if torch.equal(y, x):
        return "identity"
    return None


def crawl_torch(dropped: list[dict]) -> list[OpSpec]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    found: dict[str, OpSpec] = {}

    def consider(name: str, fn, spec: OpSpec) -> None:
        why = _same_shape_op(fn, x.clone())
        if why is None:
            found.setdefault(name, spec)
        else:
            dropped.append({"op": name, "reason": why})

    for n in sorted(dir(F)):
        fn = getattr(F, n)
        if n.startswith("_") or n.endswith("_") or not callable(fn) or inspect.isclass(fn):
            continue
        if getattr(fn, "__module__", "") not in ("torch.nn.functional", "torch._C._nn", None) and not inspect.isbuiltin(fn):
            continue
        consider(f"torch.nn.functional.{n}", fn, OpSpec(f"torch.nn.functional.{n}", "torch", "unary",
                                                        f"F.{n}({{x}})", how="introspection"))
    for n in sorted(dir(nn)):
        cls = getattr(nn, n)
        if n in _SKIP_MODULES or n.startswith("Lazy") or not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = cls().eval()  # eval: the judge runs references in eval mode
        except Exception:
            dropped.append({"op": f"torch.nn.{n}", "reason": "needs_arguments"})
            continue
        consider(f"torch.nn.{n}", m, OpSpec(f"torch.nn.{n}", "torch", "unary", "{m}({x})", f"nn.{n}()",
                                            how="introspection"))
    for n in sorted(dir(torch.Tensor)):
        # an op with an in-place twin (sin / sin_) and a torch.* function is elementwise or nearly so
        if n.startswith("_") or not hasattr(torch.Tensor, n + "_") or not callable(getattr(torch, n, None)):
            continue
        consider(f"torch.{n}", getattr(torch, n), OpSpec(f"torch.{n}", "torch", "unary", f"torch.{n}({{x}})",
                                                         how="introspection"))
    return list(found.values())


def _recipe_ok(spec: OpSpec) -> bool:
    import torch.nn as nn

    if spec.module and spec.module.startswith("nn."):
        return hasattr(nn, spec.module[3:].split("(", 1)[0])
    return True


# ----------------------------------------------------------------------------------------------
# transformers

_ROTARY_WRAPPER = '''
class RotaryEmbedding(nn.Module):
    """cos/sin tables of the default RoPE (inv_freq = base ** (-2i / dim)), applied to one tensor."""

    def __init__(self, seq_len, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos()[None], persistent=False)
        self.register_buffer("sin", emb.sin()[None], persistent=False)

    def forward(self, x):
        return apply_rotary_pos_emb(x, x, self.cos, self.sin)[0]
'''


def _inline(obj) -> str:
    """An object's source without decorators (they reach into the hub or the library's registry)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            node.decorator_list = []
    # annotations name types the library imported (Tensor, Optional...) that a task file lacks
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            node.returns = None
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                a.annotation = None
            for a in (node.args.vararg, node.args.kwarg):
                if a is not None:
                    a.annotation = None
    return ast.unparse(tree) + "\n"


def _class_chain(cls, base) -> str:
    """The class and its bases from the same library, base first, down to `base` (nn.Module)."""
    chain = [c for c in cls.__mro__ if c.__module__.startswith("transformers") and c is not base]
    return "\n\n".join(_inline(c) for c in reversed(chain))


def _check_inlined(prelude: str, make, original, x) -> str | None:
    """None if the inlined code builds and computes what the library's object computes."""
    import torch

    ns: dict = {}
    try:
        # dont_inherit: this module's `from __future__ import annotations` must not hide what a task file sees
        exec(compile(HEADER + prelude, "<inlined>", "exec", dont_inherit=True), ns)
        torch.manual_seed(0)
        mine = make(ns)(x)
        torch.manual_seed(0)
        theirs = original(x)
    except Exception as e:
        return f"inline_failed: {type(e).__name__}: {e}"[:200]
    if not isinstance(mine, torch.Tensor) or not torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5):
        return "inline_differs"
    if torch.equal(mine, x):
        return "identity"
    return None


def crawl_transformers(dropped: list[dict]) -> list[OpSpec]:
    import importlib

    import torch
    import torch.nn as nn
    from transformers import activations

    out: list[OpSpec] = []
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    for key, entry in sorted(activations.ACT2CLS.items()):
        cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        name = f"transformers.activations.ACT2CLS[{key!r}]"
        if not cls.__module__.startswith("transformers"):
            dropped.append({"op": name, "reason": "torch_class"})  # crawled as torch.nn already
            continue
        try:
            prelude = _class_chain(cls, nn.Module)
        except (OSError, TypeError) as e:
            dropped.append({"op": name, "reason": f"no_source: {e}"})
            continue
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        why = _check_inlined(prelude, lambda ns, c=cls.__name__, kw=kwargs: ns[c](**kw), cls(**kwargs), x)
        if why:
            dropped.append({"op": name, "reason": why})
            continue
        out.append(OpSpec(f"transformers.activations.{cls.__name__}({args})", "transformers", "unary",
                          "{m}({x})", f"{cls.__name__}({args})", prelude, "inlined"))
    norms = [("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("mistral", "MistralRMSNorm"),
             ("gemma", "GemmaRMSNorm"), ("t5", "T5LayerNorm")]
    for model, cname in norms:
        name = f"transformers.models.{model}.modeling_{model}.{cname}"
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cname)
            prelude = _class_chain(cls, nn.Module)
        except Exception as e:
            dropped.append({"op": name, "reason": f"not_found: {type(e).__name__}"})
            continue
        orig = cls(16)
        with torch.no_grad():
            orig.weight.normal_()  # some norms start at zero weight (Gemma): a check worth doing on random weights
        state = orig.state_dict()

        def make(ns, c=cname, st=state):
            m = ns[c](16)
            m.load_state_dict(st)
            return m

        why = _check_inlined(prelude, make, orig, x)
        if why:
            dropped.append({"op": name, "reason": why})
            continue
        out.append(OpSpec(name, "transformers", "lastdim", "{m}({x})", f"{cname}({{d}})", prelude, "inlined"))
    try:
        llama = importlib.import_module("transformers.models.llama.modeling_llama")
        rope = _inline(llama.rotate_half) + "\n\n" + _inline(llama.apply_rotary_pos_emb) + _ROTARY_WRAPPER
        mlp = "import types\n\nACT2FN = {'silu': nn.SiLU()}\n\n\n" + _inline(llama.LlamaMLP)
        cfg = "types.SimpleNamespace(hidden_size={d}, intermediate_size={h}, hidden_act='silu', mlp_bias=False)"
        out.append(OpSpec("transformers.models.llama.modeling_llama.apply_rotary_pos_emb", "transformers", "heads",
                          "{m}({x})", "RotaryEmbedding({s}, {d})", rope, "inlined"))
        out.append(OpSpec("transformers.models.llama.modeling_llama.LlamaMLP", "transformers", "mlp", "{m}({x})",
                          f"LlamaMLP({cfg})", mlp, "inlined"))
    except Exception as e:
        dropped.append({"op": "transformers.models.llama.modeling_llama", "reason": f"not_found: {type(e).__name__}"})
    return out


def crawl(include_transformers: bool = True) -> tuple[list[OpSpec], list[dict], list[str]]:
    """(operators, dropped candidates with reasons, notes)."""
    dropped: list[dict] = []
    notes: list[str] = []
    ops = crawl_torch(dropped)
    for spec in RECIPES:
        if _recipe_ok(spec):
            ops.append(spec)
        else:
            dropped.append({"op": spec.name, "reason": "not_in_this_torch"})
    if include_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            notes.append("transformers is not installed (pip install 'cuda-agent[synth]'): torch operators only")
        else:
            ops += crawl_transformers(dropped)
    seen: set[str] = set()
    unique = [o for o in ops if not (o.name in seen or seen.add(o.name))]
    return unique, dropped, notes
