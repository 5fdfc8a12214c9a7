"""Decontamination: how close is a task to any KernelBench problem, and is it too close to keep.

The decision is by computation (`Decontaminator`): each task is traced in an isolated worker
(`synth.tracing`) and its signature (`synth.signature`: the ATen ops forward dispatches, with aliases,
layout ops, names, constants and sizes normalized away) is compared with every level 1-3 problem's.
A task at or above the threshold is dropped. Text is the second opinion, reported for every task,
and the decision only where computation cannot speak: a task that does not trace, or a reference
problem that does not (its imports are missing here, say).

The textual view (`features`, `nearest`) compares a task's source by three views that survive renaming:
  ops     the operators forward applies, as lower-case names with `self.x` resolved to what
          __init__ assigned it (nn.ReLU() and F.relu and torch.relu are all "relu"): a multiset,
          so reordering independent statements changes nothing
  ast     node-type trigrams of the whole module with every identifier and constant erased
  tokens  4-grams of the token stream with identifiers and numbers normalized (API attribute
          names such as `relu` or `Conv2d` kept, since they name operators, not variables)
score = 0.5 ops + 0.25 ast + 0.25 tokens, or 1 when the operator multisets are identical. It is fooled
by form: KernelBench's level2/12 with F.leaky_relu for nn.LeakyReLU, renamed and resized, scores 0.55.
"""

from __future__ import annotations

import ast
import io
import keyword
import tokenize
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

WEIGHTS = (0.5, 0.25, 0.25)
DEFAULT_THRESHOLD = 0.8  # textual score
_NOISE = {"super", "__init__", "forward", "x", "self", "view", "reshape", "size", "contiguous", "to", "float",
          "unsqueeze", "squeeze", "shape"}


@dataclass(frozen=True)
class Features:
    ops: Counter
    ast_grams: frozenset
    token_grams: frozenset


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _ops(tree: ast.Module) -> Counter:
    aliases: dict[str, str] = {}  # self.NAME -> operator it was built from
    calls: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            op = _callee(node.value.func)
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and op:
                    aliases[t.attr] = op
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "forward":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    f = sub.func
                    name = _callee(f)
                    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                        name = aliases.get(f.attr, "module")
                    if name:
                        calls.append(name)
                elif isinstance(sub, ast.BinOp):
                    calls.append(type(sub.op).__name__)
    return Counter(c.lower() for c in calls if c.lower() not in _NOISE)


def _ast_grams(tree: ast.Module) -> frozenset:
    kinds = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, ast.expr_context)]
    return frozenset(zip(kinds, kinds[1:], kinds[2:], strict=False))


def _token_grams(source: str) -> frozenset:
    toks: list[str] = []
    prev = ""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENCODING, tokenize.ENDMARKER):
                continue
            if tok.type == tokenize.STRING:
                if prev in ("", ":"):
                    continue  # docstrings say nothing about the computation
                toks.append("STR")
            elif tok.type == tokenize.NUMBER:
                toks.append("NUM")
            elif tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
                toks.append(tok.string if prev == "." and tok.string != "self" else "ID")
            else:
                toks.append(tok.string)
            prev = tok.string
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return frozenset(zip(toks, toks[1:], toks[2:], toks[3:], strict=False))


def features(source: str) -> Features:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = ast.Module(body=[], type_ignores=[])
    return Features(_ops(tree), _ast_grams(tree), _token_grams(source))


def _jaccard(a, b) -> float:
    if isinstance(a, Counter):
        union = sum((a | b).values())
        return sum((a & b).values()) / union if union else 1.0
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def similarity(a: Features, b: Features) -> dict:
    parts = (_jaccard(a.ops, b.ops), _jaccard(a.ast_grams, b.ast_grams), _jaccard(a.token_grams, b.token_grams))
    score = sum(w * p for w, p in zip(WEIGHTS, parts, strict=True))
    if parts[0] == 1.0 and a.ops:
        # the same operators, whatever the boilerplate around them: the same problem
        score = max(score, 1.0)
    return {"score": round(score, 4), "ops": round(parts[0], 4), "ast": round(parts[1], 4),
            "tokens": round(parts[2], 4)}


@lru_cache(maxsize=4)
def _reference(root: str, levels: tuple[str, ...]) -> tuple[tuple[str, Features], ...]:
    out = []
    for level in levels:
        for f in sorted((Path(root) / level).glob("*.py")):
            try:
                out.append((f"kernelbench/{level}/{f.stem}", features(f.read_text())))
            except (OSError, UnicodeDecodeError):
                continue
    return tuple(out)


def reference_set(root: Path | None = None, levels: tuple[str, ...] = ("level1", "level2", "level3")):
    from tasks.loader import kernelbench_root

    root = root or kernelbench_root()
    ref = _reference(str(root), levels)
    if not ref:
        raise FileNotFoundError(f"no KernelBench problems under {root} (set CUDA_AGENT_KERNELBENCH)")
    return ref


def nearest(source: str, ref) -> dict:
    """The most similar KernelBench problem, with the score and its parts."""
    mine = features(source)
    best: dict = {"problem": None, "score": -1.0}
    for name, feats in ref:
        sim = similarity(mine, feats)
        if sim["score"] > best["score"]:
            best = {"problem": name, **sim}
    return best


class Decontaminator:
    """Judges tasks against KernelBench: by="computation" (default) or by="text" (the textual score alone)."""

    def __init__(self, kernelbench: Path | None = None, threshold: float | None = None,
                 text_threshold: float = DEFAULT_THRESHOLD, by: str = "computation"):
        from synth import signature, tracing

        if by not in ("computation", "text"):
            raise ValueError("decontaminate by computation or text")
        self.by = by
        self.text_threshold = text_threshold
        self.text_ref = reference_set(kernelbench)
        self.ref = tracing.reference(kernelbench) if by == "computation" else None
        default = signature.DEFAULT_THRESHOLD if by == "computation" else DEFAULT_THRESHOLD
        self.threshold = default if threshold is None else threshold
        untraced = set(self.ref.errors) if self.ref else set()
        self.untraced = [(n, f) for n, f in self.text_ref if n in untraced]

    def judge(self, rows: list[dict]) -> list[tuple[dict, str | None]]:
        """For each row (with its `source`): (nearest, why it is dropped or None to keep it)."""
        from synth import signature, tracing

        if self.by == "text":
            out = []
            for r in rows:
                near = {**nearest(r["source"], self.text_ref), "by": "text"}
                out.append((near, self._why(near, self.threshold)))
            return out
        sigs, errors = tracing.signatures({r["id"]: r["source"] for r in rows})
        out = []
        for r in rows:
            text = nearest(r["source"], self.text_ref)
            second = {"problem": text["problem"], "score": text["score"]}
            if r["id"] not in sigs:
                # nothing computed to compare: the textual score decides
                near = {**text, "by": "text", "trace_error": errors.get(r["id"], "")[:1500], "text": second}
                out.append((near, self._why(near, self.text_threshold)))
                continue
            near = {**signature.nearest(sigs[r["id"]], self.ref.signatures), "by": "computation", "text": second}
            why = self._why(near, self.threshold)
            if why is None and self.untraced:
                # problems that did not trace here can only be compared by text
                other = nearest(r["source"], self.untraced)
                if other["score"] >= self.text_threshold:
                    near["untraced_match"] = {"problem": other["problem"], "score": other["score"]}
                    why = f"{other['problem']} at {other['score']:.2f} by text (that problem does not trace here)"
            out.append((near, why))
        return out

    @staticmethod
    def _why(near: dict, threshold: float) -> str | None:
        if near["score"] < threshold:
            return None
        return f"{near['problem']} at {near['score']:.2f} by {near['by']}"
