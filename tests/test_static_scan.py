"""The static scan of model_new.py (sandbox/scan/static_scan.py): an allow-list, read from the AST alone.

Every construct a policy could use to compute outside cuda_extension, or to switch the op recorder off,
is refused with a named reason; every honest model_new.py in the repository passes.
"""

from __future__ import annotations

import ast
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

from sandbox.scan.static_scan import (
    ALLOWED_IMPORTS,
    CHILDREN,
    CUDA_ALLOWED,
    Finding,
    refusal,
    refusal_message,
    scan_model_new,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "exploits"))
from catalogue import EXPLOITS, HONEST, SLOW_RELU, model_new  # noqa: E402

HEAD = "import torch\nimport torch.nn as nn\nimport cuda_extension\n"


def forward(body: str, head: str = "", init: str = "") -> str:
    """A ModelNew whose forward is `body` (indented here), with extra module-level lines `head`."""
    lines = "\n".join("        " + line for line in body.strip("\n").splitlines())
    init_body = "\n".join("        " + line for line in init.strip("\n").splitlines()) if init else ""
    return (HEAD + head + "\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + (init_body + "\n" if init_body else "") + "\n    def forward(self, x):\n" + lines + "\n")


def refused(source: str) -> list[Finding]:
    found = scan_model_new(source)
    assert found, f"not refused:\n{source}"
    return found


# --- the issue's two exploits --------------------------------------------------------------------------

ISSUE_DISPATCH = forward(
    "y = cuda_extension.identity(x)\n"
    "pd = getattr(torch.utils, '_python' + '_dispatch')\n"
    "with pd._disable_current_modes():\n"
    "    return torch.relu(y)")
ISSUE_NUMPY = forward(
    "import numpy as np\n"
    "y = cuda_extension.identity(x)\n"
    "return torch.from_numpy(np.maximum(y.numpy(), 0.0))")


def test_the_issue_exploits_are_refused_with_reasons():
    whats = {f.what for f in refused(ISSUE_DISPATCH)}
    assert "torch.utils" in whats and "pd._disable_current_modes" in whats
    assert any(w.startswith("getattr(torch.utils") for w in whats)
    found = refused(ISSUE_NUMPY)
    assert {"import numpy", "torch.from_numpy", "y.numpy"} <= {f.what for f in found}
    assert next(f for f in found if f.what == "import numpy").why == "compute outside cuda_extension"


# --- variants: (id, source, a word the finding's text must contain) ------------------------------------

VARIANTS = [
    # reaching the dispatcher's internals
    ("getattr_concat", forward("m = getattr(torch, 'ut' + 'ils')\nreturn x"), "computed name"),
    ("getattr_fstring", forward("n = 'utils'\nm = getattr(torch.nn, f'{n}')\nreturn x"), "computed name"),
    ("getattr_as_value", forward("g = getattr\nreturn g(torch.utils, '_python_dispatch')"), "getattr used as a value"),
    ("getattr_default_arg", forward("return x", init="self.f = (lambda o, g=getattr: g(o, 'numpy'))"),
     "getattr used as a value"),
    ("getattr_literal_private", forward("return getattr(x, '_version')"), "private attribute"),
    ("getattr_literal_numpy", forward("return getattr(x, 'numpy')()"), "conversion out of torch"),
    ("getattr_on_module", forward("return getattr(torch, 'relu')(x)"), "used as a value"),
    ("hasattr_computed", forward("n = 'x'\nreturn x if hasattr(x, n) else x"), "computed name"),
    ("dict_of_module", forward("pd = torch.utils.__dict__['_python_dispatch']\nreturn x"), "computed name"),
    ("vars_of_module", forward("pd = vars(torch.utils)['_python_dispatch']\nreturn x"), "patching module state"),
    ("dunder_import", forward("np = __import__('numpy')\nreturn x"), "importing around the scan"),
    ("import_private", forward("return x", head="import torch.utils._python_dispatch as pd"), "dispatcher internals"),
    ("from_private", forward("return x", head="from torch.utils import _python_dispatch"), "dispatcher internals"),
    ("from_torch_C", forward("return x", head="from torch import _C"), "dispatcher internals"),
    ("torch_C", forward("torch._C._set_dispatch_mode(None)\nreturn x"), "dispatcher internals"),
    ("private_on_tensor", forward("v = x._version\nreturn x"), "private attribute"),
    ("private_on_other", forward("return self.inner._foo", init="self.inner = nn.Identity()"), "private attribute"),
    ("private_nn_internals", forward("return x", init="self._apply(lambda t: t)"), "private attribute"),
    ("torch_sys", forward("np = torch.sys.modules['numpy']\nreturn x"), "reaching modules"),
    ("torch_os", forward("torch.os.system('true')\nreturn x"), "reaching modules"),
    ("torch_builtins", forward("e = torch.builtins.eval\nreturn x"), "reaching modules"),
    ("torch_importlib", forward("np = torch.importlib.import_module('numpy')\nreturn x"), "reaching modules"),
    ("functional_np", forward("return torch.from_numpy(torch.nn.functional.np.maximum(x.numpy(), 0))"), "np"),
    ("F_np", forward("return x", head="import torch.nn.functional as F\nnp = F.np"), "compute or code"),
    ("typing_sys", forward("np = typing.sys.modules['numpy']\nreturn x", head="import typing"), "reaching modules"),
    ("typing_operator", forward("f = typing.operator.attrgetter('num' + 'py')\nreturn f(x)()", head="import typing"),
     "reaching modules"),
    ("nn_modules_operator", forward("g = nn.modules.container.operator\nreturn x"), "outside the allow-list"),
    ("print_self", forward("b = print.__self__\nreturn x"), "module behind a builtin"),
    ("globals_builtins", forward("b = globals()['__builtins__']\nreturn x"), "patching module state"),
    ("dunder_builtins", forward("b = __builtins__\nreturn x"), "dunder name"),
    ("class_walk", forward("s = ().__class__.__bases__[0].__subclasses__()\nreturn x"), "class tree"),
    ("getattribute", forward("return x.__getattribute__('num' + 'py')()"), "computed name"),
    ("eval_as_value", forward("e = eval\nreturn e('x')"), "running generated code"),
    ("exec", forward("exec('y = 1')\nreturn x"), "running generated code"),
    ("type_three_args", forward("T = type('T', (torch.Tensor,), {})\nreturn x"), "type() only with one argument"),
    ("torch_dispatch_method", forward("return x", head="class T(torch.Tensor):\n"
                                      "    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):\n"
                                      "        return func(*args)"), "special method"),
    ("class_dunder_assignment", forward("return x", head="class T(torch.Tensor):\n    __torch_function__ = None"),
     "dunder name"),
    ("metaclass", forward("return x", head="class M(type):\n    pass\nclass T(metaclass=M):\n    pass"),
     "metaclass"),
    ("exclude_dispatch_key", forward(
        "with torch.ExcludeDispatchKeyGuard(torch.DispatchKeySet(torch.DispatchKey.Python)):\n"
        "    return torch.relu(x)"), "op recorder"),
    ("redispatch", forward("return torch.ops.aten.relu.default.redispatch(ks, x)"), "op recorder"),
    ("py_impl", forward("return x", head="torch.ops.aten.relu.default.py_impl(1)(lambda x: x)"), "op recorder"),
    ("torch_library", forward("return x", head="lib = torch.library.Library('aten', 'IMPL')\n"
                              "lib.impl('empty_like', lambda x, **kw: x, 'CPU')"), "op recorder"),
    ("torch_library_impl", forward("return x", head="@torch.library.impl('aten::relu', 'CPU')\n"
                                   "def f(x):\n    return x"), "op recorder"),
    ("load_library", forward("return x", head="torch.ops.load_library('/tmp/x.so')"), "op recorder"),
    ("overrides", forward("return x", head="m = torch.overrides.TorchFunctionMode"), "op recorder"),
    # conversions out of torch and Python over elements
    ("numpy_method", forward("return torch.tensor(x.numpy().clip(0))"), "conversion out of torch"),
    ("type_numpy", forward("return type(x).numpy(x)"), "conversion out of torch"),
    ("array_protocol", forward("a = x.__array__()\nreturn x"), "conversion out of torch"),
    ("from_numpy", forward("return torch.from_numpy(a)"), "conversion out of torch"),
    ("dlpack", forward("c = torch.utils.dlpack.to_dlpack(x)\nreturn x"), "conversion out of torch"),
    ("to_dlpack_dunder", forward("c = x.__dlpack__()\nreturn x"), "conversion out of torch"),
    ("storage_tolist", forward("v = x.untyped_storage().tolist()\nreturn x"), "conversion out of torch"),
    ("tolist", forward("return torch.tensor([max(v, 0.0) for v in x.flatten().tolist()])"), "conversion out of torch"),
    ("storage_class", forward("s = torch.UntypedStorage.from_buffer(b)\nreturn x"), "conversion out of torch"),
    ("frombuffer", forward("return torch.frombuffer(b, dtype=torch.float32)"), "conversion out of torch"),
    ("apply_", forward("y = cuda_extension.identity(x)\ny.apply_(lambda v: max(v, 0.0))\nreturn y"),
     "Python code over a tensor's elements"),
    ("map_", forward("y = cuda_extension.identity(x)\ny.map_(x, lambda a, b: max(a, 0.0))\nreturn y"),
     "Python code over a tensor's elements"),
    # other engines
    ("import_numpy", forward("return x", head="import numpy as np"), "compute outside cuda_extension"),
    ("from_numpy_import", forward("return x", head="from numpy import maximum"), "compute outside cuda_extension"),
    ("import_operator", forward("return x", head="import operator"), "attrgetter"),
    ("import_functools", forward("return x", head="import functools"), "partial"),
    ("import_unknown", forward("return x", head="import json"), "not on the import allow-list"),
    ("star_import", forward("return x", head="from torch.nn.functional import *"), "star import"),
    ("relative_import", forward("return x", head="from . import helper"), "relative import"),
    ("torch_compile", forward("return x", init="self.f = torch.compile(cuda_extension.relu)"), "compute or code"),
    ("module_compile", forward("return x", init="self.compile()"), "compute or code"),
    ("jit", forward("return x", head="f = torch.jit.script(lambda x: x)"), "compute or code"),
    ("cuda_graph", forward("g = torch.cuda.CUDAGraph()\nreturn x"), "compute or code"),
    ("cuda_graph_context", forward("with torch.cuda.graph(g):\n    return x"), "device queries"),
    ("jiterator", forward("return x", head="f = torch.cuda.jiterator._create_jit_fn('')"), "compute or code"),
    ("vmap", forward("return torch.vmap(cuda_extension.relu)(x)"), "compute or code"),
    ("script_module", forward("return x", head="m = torch.ScriptModule()"), "TorchScript"),
    ("device_module_by_name", forward("m = torch.get_device_module('cuda')\nreturn x"), "reaching modules by name"),
    ("raw_device_memory", forward("p = torch.cuda.caching_allocator_alloc(1024)\nreturn x"), "raw device memory"),
    ("generator_frame", forward("g = (v for v in [x])\nreturn g.gi_frame.f_back"), "frames"),
    ("type_hints", forward("return x", head="from typing import get_type_hints"), "evaluating strings"),
    ("match_class_attr", forward("match x:\n    case torch.Tensor(numpy=f):\n        return f()\n"
                                 "    case _:\n        return x"), "conversion out of torch"),
    # global state, the judge, aliases and rebinding
    ("set_printoptions", forward("return x", init="torch.set_printoptions(threshold=10**9)"), "global state"),
    ("set_num_threads", forward("return x", init="torch.set_num_threads(1)"), "global state"),
    ("torch_load", forward("return torch.load('/tmp/answer.pt')"), "unpickling"),
    ("patch_torch", forward("return x", head="torch.relu = cuda_extension.relu"), "patching an imported module"),
    ("patch_tensor_class", forward("return x", head="torch.Tensor.relu = cuda_extension.relu"),
     "patching an imported module"),
    ("module_alias", forward("t = torch\nreturn t.relu(x)"), "used as a value"),
    ("module_in_default", forward("return (lambda t=torch.nn: t.functional)(1)"), "used as a value"),
    ("module_rebound", forward("return x", head="def f(torch):\n    return torch.utils"), "rebinding torch"),
    ("module_loop_rebound", forward("for nn in [x]:\n    pass\nreturn x"), "rebinding nn"),
    ("self_rebound", forward("self = x\nreturn self._version"), "private attribute"),
    ("self_with_default", "import torch.nn as nn\nclass ModelNew(nn.Module):\n"
                          "    def f(self=None):\n        return self._version\n", "private attribute"),
    ("unbound_method", forward("return ModelNew.peek(x)", init="self._version = 0")
     + "\n    def peek(self):\n        return self._version\n", "through the class"),
    ("unbound_method_by_getattr", forward("return getattr(ModelNew, 'peek')(x)", init="self._version = 0")
     + "\n    def peek(self):\n        return self._version\n", "through the class"),
    ("class_alias", forward("C = ModelNew\nreturn C.peek(x)", init="self._version = 0")
     + "\n    def peek(self):\n        return self._version\n", "a class used as a value"),
    ("type_alias", forward("T = type(self)\nreturn T.peek(x)", init="self._version = 0")
     + "\n    def peek(self):\n        return self._version\n", "a class used as a value"),
    ("getattr_private_not_own", forward("return getattr(self, '_forward_hooks')"), "private attribute"),
    ("higher_order_ops", forward("return torch.ops.higher_order.cond(True, cuda_extension.relu, None, (x,))"),
     "compute or code"),
    ("torch_func", forward("return torch.func.functional_call(self, {}, (x,))"), "outside the allow-list"),
    ("init_on_foreign_object", forward("ModelNew.__init__(torch.Tensor)\nreturn x"), "through the class"),
    ("patch_through_helper", forward("return x", head="def patch(cls):\n    cls.relu = cuda_extension.relu\n"
                                     "patch(torch.Tensor)"), "anything but a method's self"),
    ("patch_class_alias", forward("return x", head="T = torch.Tensor\nT.relu = cuda_extension.relu"),
     "anything but a method's self"),
    ("decorated_by_extension", "import cuda_extension as torch\nimport torch.nn as nn\nclass M(nn.Module):\n"
                               "    @torch.no_grad()\n    def f(self):\n        self._v = 1\n", "anything but a method's self"),
    ("decorated_self", "import torch.nn as nn\nclass ModelNew(nn.Module):\n    @staticmethod\n"
                       "    def f(self):\n        self._v = 1\n        return self._v\n", "private attribute"),
    ("time", forward("return x", head="import time"), "the clock"),
    ("sandbox", forward("return x", head="import sandbox.worker.recorder"), "the judge itself"),
    ("reference", forward("return x", head="from model import Model"), "the reference model"),
    ("reference_module_name", forward("return cuda_agent_task.Model()(x)"), "the reference model"),
    ("wraps_model", HEAD + "class ModelNew(Model):\n    pass\n", "derive from nn.Module"),
    ("open", forward("return x", head="data = open('/tmp/answer').read()"), "reading files"),
    ("backends", forward("return x", init="torch.backends.cuda.matmul.allow_tf32 = True"), "backend flags"),
    ("cuda_sync", forward("torch.cuda.synchronize()\nreturn x"), "the timer"),
    ("cuda_stream", forward("s = torch.cuda.Stream()\nreturn x"), "side streams"),
    ("frames", forward("return x", head="import sys\nf = sys._getframe(1).f_back"), "frames"),
]


@pytest.mark.parametrize("name, source, says", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_variant_is_refused_with_a_named_reason(name, source, says):
    found = refused(source)
    text = "; ".join(str(f) for f in found)
    assert says in text, text
    assert all(f.line > 0 and f.what and f.why for f in found)


def test_the_refusal_says_what_is_allowed():
    msg = refusal(ISSUE_NUMPY)
    assert msg is not None and msg.startswith("model_new.py uses constructs the judge does not allow: line ")
    for name in ALLOWED_IMPORTS:
        assert name in msg
    assert "call cuda_extension functions" in msg and "literal attribute name" in msg
    assert "docs/judge.md" in msg
    many = refusal_message([Finding(i, f"x{i}", "why") for i in range(1, 12)])
    assert "and 3 more" in many
    assert refusal(HONEST["relu01"]) is None


def test_catalogue_exploits_meant_for_the_scan_are_refused():
    """Entries the catalogue runs with the scan on and expects forbidden_construct, and those it runs with
    the scan off to prove a dynamic layer: the scan refuses both kinds (when it is on)."""
    for name, _cls, _task, source, _op, reasons, overrides in EXPLOITS:
        if source is None:
            continue
        if "forbidden_construct" in reasons or overrides.get("static_checks") is False:
            assert scan_model_new(source), name


# --- honest code ---------------------------------------------------------------------------------------

HONEST_CONSTRUCTS = {
    "super_init": forward("return cuda_extension.relu(x)"),
    "module_init": HEAD + "class ModelNew(nn.Module):\n    def __init__(self):\n        nn.Module.__init__(self)\n",
    "own_private_state": forward("self._calls += 1\nreturn self._run(x)", init="self._calls = 0")
    + "\n    def _run(self, x):\n        return cuda_extension.relu(x)\n",
    "lazy_private_state": forward("c = getattr(self, '_cache', None)\nif c is None or not hasattr(self, '_cache'):\n"
                                  "    self._cache = cuda_extension.prepare(self.w)\nreturn cuda_extension.relu(x)",
                                  init="self.w = nn.Parameter(torch.empty(3))"),
    "attribute_named_func": forward("return self.func(x)", init="self.func = cuda_extension.relu"),
    "private_buffer": forward("return cuda_extension.scale(x, self._scale)",
                              init="self.register_buffer('_scale', torch.empty(3))"),
    "getattr_literal": forward("b = getattr(self, 'bias', None)\nf = getattr(cuda_extension, 'relu_v2', None)\n"
                               "return (f or cuda_extension.relu)(x) if hasattr(cuda_extension, 'relu') else x"),
    "names": forward("return cuda_extension.relu(x)", head="from __future__ import annotations\n"
                     "import math\nfrom typing import Optional\nimport torch.nn.functional as F\n"
                     "from torch import Tensor\nfrom torch.nn import init\nSCALE = math.sqrt(2.0)\n"
                     "if __name__ == '__main__':\n    pass"),
    "metadata": forward("n, c = x.shape\nassert x.is_contiguous() and x.dtype == torch.float32, type(x).__name__\n"
                        "out = torch.empty_like(x)\ncuda_extension.relu_out(x.view(-1), out.view(-1), x.stride(0))\n"
                        "s = self.alpha.item()\nreturn out[:n].reshape(n, c)",
                        init="self.alpha = nn.Parameter(torch.empty(()))"),
    "device_queries": forward("return cuda_extension.relu(x, self.sms)",
                              init="self.sms = torch.cuda.get_device_properties(0).multi_processor_count "
                                   "if torch.cuda.is_available() else 1"),
    "extension_alias": forward("return self.ext.relu(x)", head="ext = cuda_extension", init="self.ext = ext"),
    "aten_ops_namespace": forward("return torch.ops.myext.relu(x)"),
    "layers_as_holders": forward("return cuda_extension.linear(x, self.fc.weight, self.fc.bias)",
                                 init="self.fc = nn.Linear(4, 4)\nself.blocks = nn.ModuleList([nn.Identity()])\n"
                                      "nn.init.zeros_(self.fc.bias)\nfor m in self.modules():\n    pass"),
    "no_grad_decorator": HEAD + "class ModelNew(nn.Module):\n    @torch.no_grad()\n    def forward(self, x):\n"
                                "        self._calls = getattr(self, '_calls', 0) + 1\n"
                                "        return cuda_extension.relu(x)\n\n    @property\n    def calls(self):\n"
                                "        return self._calls\n",
    "tensor_subclass_and_isinstance": forward("assert isinstance(x, torch.Tensor)\nreturn cuda_extension.relu(x)",
                                              head="class Marker(torch.Tensor):\n    pass"),
    "repr": forward("return x") + "\n    def __repr__(self):\n        return type(self).__name__\n",
    "classes_tested": forward("assert type(x) is torch.Tensor and isinstance(self, ModelNew)\n"
                              "return cuda_extension.relu(x).as_subclass(Marker) if False else cuda_extension.relu(x)",
                              head="class Marker(torch.Tensor):\n    pass")
    + "\n    def extra_repr(self):\n        return f'{type(self).__name__} via {ModelNew.__name__}'\n",
    "old_style_super": HEAD + "class ModelNew(nn.Module):\n    def __init__(self):\n"
                              "        super(ModelNew, self).__init__()\n        self.helper = Helper()\n"
                              "    def make(self, h: Helper) -> 'Helper':\n        return h\n"
                              "class Helper:\n    pass\n",
    "annotations": HEAD + "class ModelNew(nn.Module):\n    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
                          "        return cuda_extension.relu(x)\n",
}


@pytest.mark.parametrize("name", sorted(HONEST_CONSTRUCTS))
def test_honest_constructs_pass(name):
    assert scan_model_new(HONEST_CONSTRUCTS[name]) == []


def _strings(node: ast.AST) -> str | None:
    """A string expression of literals (adjacent or joined with +), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _strings(node.left), _strings(node.right)
        return left + right if left is not None and right is not None else None
    return None


def _model_new_literals(path: Path) -> list[str]:
    """ModelNew sources written inline in a Python file (string literals holding `class ModelNew`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = _strings(node)
        if text and "class ModelNew" in text:
            try:
                ast.parse(text)
            except SyntaxError:
                continue
            out.append(text)
    return out


def _markdown_blocks(path: Path) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S) if "class ModelNew" in b]


# files whose inline ModelNew sources are all honest (tests of the dynamic layers write theirs in
# tests/exploits, and those are checked above: refused, or run with the scan off)
INLINE_HONEST = ["tests/test_verify.py", "tests/test_harness_units.py", "tests/test_mcp.py", "tests/test_workspace.py",
                 "tests/test_training_engine.py", "tests/test_ppo_stages.py", "tests/test_verl_real.py",
                 "tests/test_verl_export.py", "tests/test_harness_episode.py", "tests/test_viewer.py",
                 "bench/proofs/family.py", "bench/forgery_bound.py", "sandbox/workspace.py"]


def honest_sources() -> dict[str, str]:
    from harness.inline_convert import convert_load_inline

    found: dict[str, str] = {}
    for path in sorted(REPO.rglob("model_new.py")):
        if ".git" not in path.parts:
            found[str(path.relative_to(REPO))] = path.read_text().replace("VARIANT", "correct")
    for name, source in HONEST.items():
        found[f"catalogue HONEST[{name}]"] = source
    found["catalogue SLOW_RELU"] = SLOW_RELU
    for name, _cls, _task, source, _op, reasons, overrides in EXPLOITS:
        # exploits the scan is not meant to catch: the dynamic layers must see them, so the scan must pass them
        if source is not None and "forbidden_construct" not in reasons and overrides.get("static_checks") is not False:
            found[f"catalogue EXPLOITS[{name}] (for the dynamic layers)"] = source
    found["forgery head"] = model_new("def forward(self, x):\n        return cuda_extension.relu(x)",
                                      head="cuda_extension.forge('clock', 20.0)")
    for rel in INLINE_HONEST:
        for i, text in enumerate(_model_new_literals(REPO / rel)):
            found[f"{rel} #{i}"] = (convert_load_inline(text).files["model_new.py"] if "load_inline" in text
                                    else text)
    for path in sorted((REPO / "tests" / "fixtures" / "harness").rglob("*.py")):
        text = path.read_text()
        if "load_inline(" in text and "class ModelNew" in text:
            found[f"{path.relative_to(REPO)} (converted)"] = convert_load_inline(text).files["model_new.py"]
    for path in [REPO / "skills" / "SKILL.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for i, block in enumerate(_markdown_blocks(path)):
            found[f"{path.relative_to(REPO)} block {i}"] = block
    return found


def test_every_honest_model_new_in_the_repository_passes():
    sources = honest_sources()
    assert len(sources) >= 30, sorted(sources)
    refused_honest = {name: [str(f) for f in scan_model_new(src)] for name, src in sources.items()}
    refused_honest = {k: v for k, v in refused_honest.items() if v}
    assert not refused_honest, refused_honest


# --- the tables against the installed torch -----------------------------------------------------------

def _module_attrs(module) -> dict[str, str]:
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for a in dir(module):
            if a.startswith("_"):
                continue
            try:
                v = getattr(module, a)
            except Exception:
                continue
            if isinstance(v, types.ModuleType):
                out[a] = v.__name__
    return out


ROOTS = {"torch": "torch", "torch.nn": "nn", "torch.nn.functional": "F", "torch.nn.init": "init",
         "torch.cuda": "torch.cuda", "math": "math", "typing": "typing"}


@pytest.mark.parametrize("module", sorted(ROOTS))
def test_every_module_an_allowed_module_carries_is_a_child_or_refused(module):
    """torch.sys, F.np, typing.operator, torch.cuda.jiterator ...: each module-valued attribute of an allowed
    module is either one of the allowed modules (CHILDREN) or refused. A new torch that adds one fails here."""
    import importlib

    mod = importlib.import_module(module)
    head = ("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nimport torch.nn.init as init\n"
            "import math\nimport typing\n")
    missed = []
    for attr, target in _module_attrs(mod).items():
        child = CHILDREN.get(module, {}).get(attr)
        if child is not None:
            assert target == child or (child == "torch.ops"), (module, attr, target)
            continue
        if not scan_model_new(f"{head}y = {ROOTS[module]}.{attr}.anything\n"):
            missed.append(f"{module}.{attr} ({target})")
    assert not missed, missed


def test_torch_cuda_allow_list_names_real_functions():
    import torch

    assert all(hasattr(torch.cuda, name) for name in CUDA_ALLOWED)


@pytest.mark.parametrize("source", ["y = x" + ".a" * 3000 + "\n", "y = " + "-" * 100000 + "1\n"])
def test_what_cannot_be_checked_is_refused(source):
    assert [f.why for f in scan_model_new(source)] == ["too deeply nested to check: write it plainly"]


def test_a_long_file_is_scanned_quickly():
    import time

    source = HONEST["scale_shift"] + "".join(f"\ny{i} = torch.nn.functional.relu.__name__.upper" for i in range(20000))
    t0 = time.perf_counter()
    assert scan_model_new(source) == []
    assert time.perf_counter() - t0 < 120  # a quadratic scan takes hours here; 20 s failed beside another test worker
