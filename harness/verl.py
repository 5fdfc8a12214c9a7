"""Multi-node training on verl: the task parquet, the tool config and the reward function.

`cuda-agent export --format verl --tasks SPEC --mcp-url URL --out DIR` writes
    train.parquet, val.parquet   verl's RL dataset rows (data_source, agent_name, prompt, ability,
                                 reward_model, extra_info with tools_kwargs)
    tool_config.yaml             one verl tool per cuda-agent tool, class harness.verl_tool.CudaAgentTool,
                                 pointed at `cuda-agent serve --transport http` (one or more hosts), or
                                 at `ray:ADDRESS`: the judge pool of `cuda-agent cluster up` on that Ray
                                 cluster (`--ray ADDRESS`), one endpoint per actor, found when first used
    reward.py                    compute_score(data_source, solution_str, ground_truth, extra_info)

Why native tools and not verl's `type: mcp`: verl validates every MCP tool property against its
OpenAIFunctionPropertySchema, which requires a plain `type`; our optional arguments are JSON-schema
`anyOf` unions (the workspace id, verify's trials), so verl's MCP loader rejects the listing. And
verl has no per-episode tool state: each call creates and releases a tool instance. So the exported
schemas are flattened to verl's format with the workspace id hidden (as the harness hides it), and
`WorkspaceSessions` opens one workspace per verl request and binds its id to every call, through
the harness's own EpisodeTools (same validation, clipping and errors as a harness episode).

The reward judges the episode's own workspace when verl hands it over: the tool records it in
verl's per-episode `extra_fields`, which verl's agent loop passes to the reward as part of
`extra_info`; the reward judges it with the harness's judge (compile, verify, profile, milestone
reward), as a harness episode is judged, then closes it (verl has no end-of-episode hook, so this is
where the workspace is given back). Without it (an episode that never called a tool, or a verl
path that does not forward the tool fields) the reward rebuilds the final workspace: a fresh
workspace of the task, the model's write_file and edit_file calls from the response applied in
order (the tool results in the response are skipped). Every score comes from the judge.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

HIDDEN = {"list_tasks", "open_task", "close_workspace"}
DATA_SOURCE = "cuda_agent"
FILE_TOOLS = ("write_file", "edit_file")
WORKSPACE_FIELD = "cuda_agent_workspace"  # verl's AgentData.extra_fields key: {"url", "workspace_id"}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|$)", re.S)
_BARE_CALL = re.compile(r'\{\s*"name"\s*:')


# ---- tool schemas in verl's format -------------------------------------------------------------
def _flat_property(prop: dict[str, Any]) -> dict[str, Any]:
    """verl's property schema: type, description, enum. A union with null becomes its other type."""
    if "type" not in prop:
        kinds = [p for p in prop.get("anyOf", []) if p.get("type") != "null"]
        prop = {**(kinds[0] if kinds else {"type": "string"}), "description": prop.get("description")}
    out = {"type": prop["type"] if isinstance(prop["type"], str) else prop["type"][0]}
    if prop.get("description"):
        out["description"] = prop["description"]
    if prop.get("enum"):
        out["enum"] = [str(e) for e in prop["enum"]]
    return out


def verl_schema(spec: Any) -> dict[str, Any]:
    """A harness ToolSpec (workspace id already hidden) as verl's OpenAIFunctionToolSchema dict."""
    params = spec.parameters
    return {"type": "function", "function": {
        "name": spec.name, "description": spec.description,
        "parameters": {"type": "object",
                       "properties": {k: _flat_property(v) for k, v in (params.get("properties") or {}).items()},
                       "required": list(params.get("required") or [])}}}


def connect_endpoint(url: str, token: str | None) -> Any:
    """A tool server by address: an HTTP MCP endpoint, or `ray:ADDRESS#judge-N` (an actor of the judge pool
    that `cuda-agent cluster up` runs on a Ray cluster, harness.cluster)."""
    if url.startswith("ray:"):
        from harness.cluster.pool import connect_endpoint as ray_endpoint

        return ray_endpoint(url)
    from harness.mcp_tools import connect_http_server

    return connect_http_server("verl", url, token)


def expand_urls(urls: list[str]) -> list[str]:
    """`ray:ADDRESS` stands for every actor of the pool there; HTTP URLs stay as they are."""
    if not any(u.startswith("ray:") for u in urls):
        return list(urls)
    from harness.cluster.pool import expand_endpoints

    return expand_endpoints(urls)


async def list_tool_specs(urls: list[str], token: str | None) -> list[Any]:
    from harness.mcp_tools import EpisodeTools

    async with connect_endpoint(expand_urls(urls)[0], token) as server:
        return EpisodeTools([server], {"workspace_id": "-"}, HIDDEN, 60, 40_000).specs


# ---- the export ----------------------------------------------------------------------------------
def task_rows(tasks: list[Any], backend: str, tool_names: list[str], split: str) -> list[dict[str, Any]]:
    from harness.prompts import system_prompt, task_prompt

    rows = []
    for i, task in enumerate(tasks):
        create = {"task_id": task.id, "task_source": task.source, "task_sha256": task.sha256, "backend": backend}
        rows.append({
            "data_source": DATA_SOURCE, "agent_name": "tool_agent",
            "prompt": [{"role": "system", "content": system_prompt()},
                       {"role": "user", "content": task_prompt(task, backend)}],
            "ability": "cuda_kernel",
            "reward_model": {"style": "rule", "ground_truth": task.sha256},
            "extra_info": {"split": split, "index": i, "task_id": task.id, "task_source": task.source,
                           "backend": backend, "need_tools_kwargs": True,
                           "tools_kwargs": {name: {"create_kwargs": create} for name in tool_names}}})
    return rows


def tool_config(specs: list[Any], urls: list[str], token_env: str, timeout_s: float) -> dict[str, Any]:
    return {"tools": [{"class_name": "harness.verl_tool.CudaAgentTool",
                       "config": {"type": "native", "mcp_urls": urls, "token_env": token_env,
                                  "timeout_s": timeout_s, "max_result_chars": 40_000},
                       "tool_schema": verl_schema(s)} for s in specs]}


REWARD_MODULE = '''"""verl's custom reward function for cuda-agent (written by `cuda-agent export --format verl`).
custom_reward_function.path = this file, custom_reward_function.name = compute_score."""

from harness.verl import judge_response

MCP_URLS = {urls!r}
TOKEN_ENV = {token_env!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return judge_response(solution_str, ground_truth, extra_info or {{}}, MCP_URLS, TOKEN_ENV)
'''


def export_verl(task_specs: list[str], urls: list[str], out: Path, backend: str = "cuda",
                token_env: str = "CUDA_AGENT_MCP_TOKEN", val_fraction: float = 0.0,
                timeout_s: float = 2400.0) -> dict[str, Any]:
    import anyio
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from harness.specs import select_tasks

    tasks = select_tasks(task_specs)
    specs = anyio.run(list_tool_specs, urls, os.environ.get(token_env))
    names = [s.name for s in specs]
    n_val = max(1, int(len(tasks) * val_fraction)) if val_fraction > 0 else 0
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": tasks[n_val:] or tasks, "val": tasks[:n_val] or tasks}
    for split, items in splits.items():
        pq.write_table(pa.Table.from_pylist(task_rows(items, backend, names, split)), out / f"{split}.parquet")
    (out / "tool_config.yaml").write_text(yaml.safe_dump(tool_config(specs, urls, token_env, timeout_s),
                                                         sort_keys=False, width=120))
    (out / "reward.py").write_text(REWARD_MODULE.format(urls=urls, token_env=token_env))
    return {"train": len(splits["train"]), "val": len(splits["val"]), "tools": names, "out": str(out)}


# ---- one workspace per verl request --------------------------------------------------------------
class WorkspaceSessions:
    """verl request id -> an open workspace on one of the servers; calls go through EpisodeTools."""

    def __init__(self, urls: list[str], token: str | None, timeout_s: float = 2400.0, max_chars: int = 40_000):
        self.given, self.token, self.timeout_s, self.max_chars = urls, token, timeout_s, max_chars
        self._urls: list[str] | None = None
        self.open: dict[str, tuple[str, str]] = {}  # request id -> (url, workspace id)
        self._opening: dict[str, Any] = {}  # request id -> asyncio.Lock while its workspace is being opened
        self._next = 0

    async def _workspace(self, server: Any, request_id: str, task: dict[str, Any]) -> str:
        args = {"source": task["task_source"], "name": re.sub(r"[^\w.-]", "_", task["task_id"])[:64],
                "backend": task.get("backend") or "cuda"}
        opened = await server.call("open_task", args, self.timeout_s)
        if opened.is_error or not opened.structured:
            raise RuntimeError(f"open_task failed: {opened.text[:500]}")
        return opened.structured["workspace_id"]

    @property
    def urls(self) -> list[str]:
        if self._urls is None:  # a Ray pool is looked up on first use, in the process that uses it
            self._urls = expand_urls(self.given)
        return self._urls

    async def call(self, request_id: str, task: dict[str, Any], name: str, arguments: dict[str, Any] | str) -> str:
        from harness.mcp_tools import EpisodeTools

        if request_id not in self.open:
            import asyncio

            # parallel calls of one turn (max_parallel_calls > 1) must share one workspace
            lock = self._opening.setdefault(request_id, asyncio.Lock())
            async with lock:
                if request_id not in self.open:
                    url = self.urls[self._next % len(self.urls)]
                    self._next += 1
                    async with connect_endpoint(url, self.token) as server:
                        # a Ray actor's endpoint names its incarnation: a restarted actor is a lost server
                        where = getattr(server, "endpoint", None) or url
                        self.open[request_id] = (where, await self._workspace(server, request_id, task))
            self._opening.pop(request_id, None)
        url, ws_id = self.open[request_id]
        async with connect_endpoint(url, self.token) as server:
            tools = EpisodeTools([server], {"workspace_id": ws_id}, HIDDEN, self.timeout_s, self.max_chars)
            return (await tools.call(name, arguments)).text


# ---- the reward ----------------------------------------------------------------------------------
def _bare_calls(text: str) -> list[str]:
    """The JSON objects that start like a call, where the tags are gone: verl's reward manager
    decodes with skip_special_tokens, which drops <tool_call> where a tokenizer marks it special."""
    return [text[m.start():] for m in _BARE_CALL.finditer(text)]


def file_calls(solution_str: str) -> list[tuple[str, dict[str, Any]]]:
    """The model's write_file/edit_file calls in order (Hermes <tool_call> blocks outside tool results)."""
    calls = []
    text = _RESPONSE.sub("", solution_str)
    blocks = _CALL.findall(text) if "<tool_call>" in text else _bare_calls(text)
    for block in blocks:
        try:
            obj, _ = json.JSONDecoder().raw_decode(block)
        except json.JSONDecodeError:
            continue
        args = obj.get("arguments") if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if isinstance(args, dict) and obj.get("name") in FILE_TOOLS:
            calls.append((obj["name"], args))
    return calls


async def _judge(solution_str: str, ground_truth: str, extra_info: dict[str, Any], url: str,
                 token: str | None) -> dict[str, Any]:
    from harness.config import JudgeConfig
    from harness.judge import judge_workspace
    from harness.mcp_tools import EpisodeTools
    from tasks import Task

    task = Task(id=extra_info.get("task_id") or "verl-task", source=extra_info["task_source"])
    if task.sha256 != ground_truth:
        raise ValueError("the row's task source does not match its ground truth (task sha256)")
    backend = extra_info.get("backend") or "cuda"
    episode = extra_info.get(WORKSPACE_FIELD) or None
    url = episode["url"] if episode else url
    applied = 0
    async with connect_endpoint(url, token) as server:
        if episode:  # the workspace the episode's tool calls built, as a harness episode is judged
            ws_id = episode["workspace_id"]
        else:
            ws_id = await WorkspaceSessions([url], token)._workspace(
                server, "reward", {"task_source": task.source, "task_id": task.id, "backend": backend})
        try:
            if not episode:
                tools = EpisodeTools([server], {"workspace_id": ws_id}, HIDDEN, 600, 40_000)
                for name, args in file_calls(solution_str):
                    applied += not (await tools.call(name, args)).is_error
            judgment = await judge_workspace(server, ws_id, backend, JudgeConfig())
        finally:
            await server.call("close_workspace", {"workspace_id": ws_id}, 120)
    r = judgment.reward
    return {"score": float(r.reward), "milestone": str(r.milestone), "reason": str(r.reason or ""),
            "workspace": "episode" if episode else "rebuilt", "file_calls_applied": applied,
            "judge_s": float(judgment.duration_s or 0.0)}


def judge_response(solution_str: str, ground_truth: str, extra_info: dict[str, Any], urls: list[str],
                   token_env: str = "CUDA_AGENT_MCP_TOKEN") -> dict[str, Any]:
    """verl's compute_score: the judged reward of the workspace the response's file calls build."""
    import zlib

    import anyio

    urls = expand_urls(urls)  # a Ray pool's actors, or the HTTP hosts
    url = urls[zlib.crc32(solution_str.encode()) % len(urls)]  # spread judgments over them
    return anyio.run(_judge, solution_str, ground_truth, extra_info, url, os.environ.get(token_env))
