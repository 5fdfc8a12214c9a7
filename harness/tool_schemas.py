"""MCP tool listings turned into what chat APIs accept, and the model's arguments checked against them.

Both OpenAI-style and Anthropic tool names must match ^[a-zA-Z0-9_-]{1,64}$, so names are sanitized
once and a reverse map leads back to the MCP tool. Arguments the harness supplies itself (the
workspace id) are removed from the schema the model sees and filled in on every call.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

_NAME_OK = re.compile(r"[^a-zA-Z0-9_-]")
MAX_NAME = 64


@dataclass
class ToolSpec:
    """One tool as the model sees it, with the way back to the MCP server."""

    name: str  # as shown to the model
    mcp_name: str
    server: str  # alias of the server that serves it
    description: str
    parameters: dict[str, Any]  # the JSON schema the model sees
    full_schema: dict[str, Any]  # the MCP input schema, for validation after bound args are filled in
    bound_args: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def anthropic(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.parameters}


def sanitize_name(name: str, taken: set[str]) -> str:
    base = _NAME_OK.sub("_", name)[:MAX_NAME] or "tool"
    candidate, n = base, 2
    while candidate in taken:
        suffix = f"_{n}"
        candidate = base[: MAX_NAME - len(suffix)] + suffix
        n += 1
    taken.add(candidate)
    return candidate


def _inline_refs(node: Any, defs: dict[str, Any], depth: int = 0) -> Any:
    # several OpenAI-compatible servers (and some chat templates) do not resolve $ref
    if depth > 20:
        return node
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[8:] in defs:
            merged = {**copy.deepcopy(defs[ref[8:]]), **{k: v for k, v in node.items() if k != "$ref"}}
            return _inline_refs(merged, defs, depth + 1)
        return {k: _inline_refs(v, defs, depth + 1) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs, depth + 1) for v in node]
    return node


def model_schema(schema: dict[str, Any] | None, hide: set[str]) -> dict[str, Any]:
    """The input schema as shown to the model: refs inlined, bound arguments removed, always an object."""
    schema = copy.deepcopy(schema or {})
    out = _inline_refs(schema, schema.get("$defs", {}))
    out.pop("title", None)
    out["type"] = "object"
    props = {k: v for k, v in (out.get("properties") or {}).items() if k not in hide}
    out["properties"] = props
    required = [r for r in out.get("required", []) if r not in hide]
    if required:
        out["required"] = required
    else:
        out.pop("required", None)
    return out


def make_spec(name: str, mcp_name: str, server: str, description: str | None, input_schema: dict[str, Any] | None,
              bound_args: dict[str, Any]) -> ToolSpec:
    schema = input_schema or {"type": "object", "properties": {}}
    present = set((schema.get("properties") or {}).keys())
    bound = {k: v for k, v in bound_args.items() if k in present}
    return ToolSpec(name=name, mcp_name=mcp_name, server=server, description=(description or "").strip(),
                    parameters=model_schema(schema, set(bound)), full_schema=schema, bound_args=bound)


class ArgumentError(ValueError):
    """Arguments the model sent that cannot be used; the message goes back to the model."""


def parse_arguments(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        snippet = raw if len(raw) <= 200 else raw[:100] + " ... " + raw[-80:]
        raise ArgumentError(f"the arguments are not valid JSON ({e.msg} at character {e.pos}): {snippet}. "
                            "Send one JSON object with the tool's parameters.") from None
    if not isinstance(value, dict):
        raise ArgumentError(f"the arguments must be a JSON object, not {type(value).__name__}")
    return value


def validate_arguments(spec: ToolSpec, args: dict[str, Any]) -> dict[str, Any]:
    """The arguments to send to the server: the model's, checked, plus the bound ones."""
    clash = sorted(set(args) & set(spec.bound_args))
    if clash:
        # the harness decides which workspace a call touches, never the model
        args = {k: v for k, v in args.items() if k not in clash}
    full = {**args, **spec.bound_args}
    validator = jsonschema.Draft202012Validator(spec.full_schema)
    errors = sorted(validator.iter_errors(full), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for err in errors[:5]:
            where = "/".join(str(p) for p in err.absolute_path)
            lines.append(f"{where}: {err.message}" if where else err.message)
        raise ArgumentError(f"invalid arguments for {spec.name}: " + "; ".join(lines))
    return full
