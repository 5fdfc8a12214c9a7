"""`cuda-agent rollout`, `cuda-agent eval` and `cuda-agent export`: a typer app to mount on the main CLI.

Flags build the pydantic configs of harness.config; `--config FILE` (JSON of a RolloutConfig) gives
a base that flags override. Exit status: 0 done (whatever the episodes scored), 2 bad usage or input.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
from pydantic import ValidationError
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run agents over tasks, evaluate them, export trajectories.")

Tasks = Annotated[list[str] | None, typer.Option(
    "--tasks", help="tasks: a file, a folder, kernelbench[:levelN[:1-10,15]], or ids (repeatable)")]
BaseUrl = Annotated[list[str] | None, typer.Option(
    "--base-url", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 (repeatable for replicas; "
    "default $OPENAI_BASE_URL)")]
ModelName = Annotated[str | None, typer.Option("--model", help="model name the endpoint serves")]
Provider = Annotated[str | None, typer.Option("--provider", help="openai (any compatible server) or anthropic")]
ApiKey = Annotated[str | None, typer.Option("--api-key", help="API key (better: --api-key-env or the default "
                                                             "$OPENAI_API_KEY / $ANTHROPIC_API_KEY)")]
ApiKeyEnv = Annotated[str | None, typer.Option("--api-key-env", help="environment variable holding the API key")]
Samples = Annotated[int | None, typer.Option("--samples", "-k", help="episodes per task")]
Concurrency = Annotated[int | None, typer.Option("--concurrency", "-n", help="episodes at once")]
Out = Annotated[Path | None, typer.Option("--out", help="output folder (episodes.jsonl, summary, report)")]
Resume = Annotated[bool, typer.Option("--resume", help="skip episodes already in --out")]
RetryErrors = Annotated[bool, typer.Option("--retry-errors", help="with --resume: rerun episodes that ended in "
                                                                  "an infrastructure error")]
Temperature = Annotated[float | None, typer.Option("--temperature")]
TopP = Annotated[float | None, typer.Option("--top-p")]
TopK = Annotated[int | None, typer.Option("--top-k")]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", help="per response (default 8192)")]
Seed = Annotated[int | None, typer.Option("--seed")]
TokenIds = Annotated[bool, typer.Option("--token-ids", help="vLLM: record prompt/completion token ids and "
                                                            "logprobs (for RL rows)")]
ExtraBody = Annotated[str | None, typer.Option("--extra-body", help="JSON object merged into every request")]
MaxTurns = Annotated[int | None, typer.Option("--max-turns", help="model calls per episode (default 200)")]
ContextBudget = Annotated[int | None, typer.Option("--context-budget", help="tokens (default 128000)")]
EpisodeTimeout = Annotated[float | None, typer.Option("--episode-timeout", help="seconds of agent time per episode")]
Backend = Annotated[str | None, typer.Option("--backend", help="cuda or cpu (default: cuda if a GPU is visible)")]
McpUrl = Annotated[list[str] | None, typer.Option(
    "--mcp-url", help="use running MCP server(s) over HTTP instead of starting one (repeatable; token from "
    "$CUDA_AGENT_MCP_TOKEN)")]
Gpus = Annotated[str | None, typer.Option("--gpus", help="comma-separated GPU ids, one tool server each")]
PerGpu = Annotated[int | None, typer.Option("--episodes-per-gpu", help="episodes at once per tool server/GPU")]
PerEndpoint = Annotated[int | None, typer.Option("--max-per-endpoint", help="model requests in flight per endpoint")]
ServerArg = Annotated[list[str] | None, typer.Option("--server-arg", help="extra `serve` flag for spawned servers "
                                                                          "(repeatable)")]
Ray = Annotated[str | None, typer.Option("--ray", help="judge on a Ray cluster: local (start one here), auto (the "
                                                     "running one) or HOST:PORT; needs the ray extra")]
VerifyTrials = Annotated[int | None, typer.Option("--verify-trials", help="judge: input sets (default: server's)")]
CompileMode = Annotated[str | None, typer.Option("--compile-mode", help="judge: torch.compile mode of the baseline")]
Config = Annotated[Path | None, typer.Option("--config", help="JSON file with a RolloutConfig; flags override it")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")]


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    if value is None:
        return
    *parents, last = path.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


def build_rollout_config(config: Path | None, *, replay: Path | None = None, **flags: Any) -> dict[str, Any]:
    """A RolloutConfig as a dict: the --config file (if any), then every flag that was given."""
    base: dict[str, Any] = {}
    if config is not None:
        try:
            base = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            _fail(f"cannot read --config {config}: {e}")
    model_given = flags.get("model") or flags.get("base_url") or base.get("model")
    if replay is not None:
        base["replay"] = str(replay)
        base.pop("model", None)
    elif model_given:
        m = base.setdefault("model", {})
        _set(m, "model", flags.get("model") or m.get("model") or os.environ.get("CUDA_AGENT_MODEL"))
        urls = flags.get("base_url") or m.get("base_url") or (
            [os.environ["OPENAI_BASE_URL"]] if os.environ.get("OPENAI_BASE_URL") else [])
        m["base_url"] = urls
        for key in ("provider", "api_key", "api_key_env"):
            _set(m, key, flags.get(key))
        _set(m, "max_requests_per_endpoint", flags.get("max_per_endpoint"))
        if flags.get("token_ids"):
            m["return_token_ids"] = True
    mapping = {"tasks": "tasks", "samples": "samples", "concurrency": "concurrency", "out": "out",
               "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
               "max_tokens": "sampling.max_tokens", "seed": "sampling.seed", "max_turns": "agent.max_turns",
               "context_budget": "agent.context_budget_tokens", "episode_timeout": "agent.episode_timeout_s",
               "backend": "agent.backend", "mcp_url": "tools.urls", "episodes_per_gpu": "tools.episodes_per_server",
               "server_arg": "tools.extra_args", "ray": "tools.ray", "verify_trials": "judge.verify_trials",
               "compile_mode": "judge.compile_mode"}
    for flag, path in mapping.items():
        value = flags.get(flag)
        _set(base, path, str(value) if isinstance(value, Path) else value)
    if flags.get("gpus") is not None:
        _set(base, "tools.gpus", [g.strip() for g in flags["gpus"].split(",") if g.strip()])
    if flags.get("token_ids"):
        _set(base, "sampling.logprobs", True)
    if flags.get("extra_body"):
        try:
            extra = json.loads(flags["extra_body"])
        except ValueError as e:
            _fail(f"--extra-body is not JSON: {e}")
        if not isinstance(extra, dict):
            _fail("--extra-body must be a JSON object")
        _set(base, "sampling.extra_body", extra)
    for flag in ("resume", "retry_errors"):
        if flags.get(flag):
            base[flag] = True
    if flags.get("quiet"):
        base["progress"] = False
    return base


def _validated(model: Any, data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: "
                         f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        _fail(msgs)


def _run(coro_fn: Any, *args: Any) -> Any:
    from harness.cluster.connect import ClusterError
    from harness.rollout import RolloutError
    from harness.servers import ToolServerStartError
    from tasks import TaskError

    try:
        return anyio.run(coro_fn, *args)
    except (RolloutError, TaskError, ToolServerStartError, ClusterError) as e:
        _fail(str(e))


@app.command()
def rollout(
    tasks: Tasks = None, base_url: BaseUrl = None, model: ModelName = None, provider: Provider = None,
    api_key: ApiKey = None, api_key_env: ApiKeyEnv = None,
    replay: Annotated[Path | None, typer.Option("--replay", help="replay solutions from this folder through the "
                                                                 "tools instead of asking a model")] = None,
    samples: Samples = None, concurrency: Concurrency = None, out: Out = None, resume: Resume = False,
    retry_errors: RetryErrors = False, temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None,
    max_tokens: MaxTokens = None, seed: Seed = None, token_ids: TokenIds = False, extra_body: ExtraBody = None,
    max_turns: MaxTurns = None, context_budget: ContextBudget = None, episode_timeout: EpisodeTimeout = None,
    backend: Backend = None, mcp_url: McpUrl = None, gpus: Gpus = None, episodes_per_gpu: PerGpu = None,
    max_per_endpoint: PerEndpoint = None, server_arg: ServerArg = None, verify_trials: VerifyTrials = None,
    compile_mode: CompileMode = None, config: Config = None, quiet: Quiet = False, ray: Ray = None,
) -> None:
    """Run tasks x samples episodes in parallel and append their trajectories to OUT/episodes.jsonl."""
    from harness.config import RolloutConfig
    from harness.rollout import print_summary, run_rollout

    flags = {k: v for k, v in locals().items() if k not in ("config", "replay", "RolloutConfig", "print_summary",
                                                            "run_rollout")}
    data = build_rollout_config(config, replay=replay, **flags)
    if out is None and "out" not in data:
        _fail("--out is required")
    cfg = _validated(RolloutConfig, data)
    console = Console(stderr=True, quiet=quiet)
    summary = _run(run_rollout, cfg, None, console)
    print_summary(summary, console)
    print(summary.model_dump_json(indent=2))


@app.command("eval")
def eval_cmd(
    tasks: Tasks = None, base_url: BaseUrl = None, model: ModelName = None, provider: Provider = None,
    api_key: ApiKey = None, api_key_env: ApiKeyEnv = None,
    solutions: Annotated[Path | None, typer.Option("--solutions", help=(
        "score existing solutions instead of running a model: workspace folders (model_new.py + kernels/) or "
        "KernelBench-style single files using load_inline"))] = None,
    samples: Samples = None, concurrency: Concurrency = None, out: Out = None, resume: Resume = False,
    retry_errors: RetryErrors = False, temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None,
    max_tokens: MaxTokens = None, seed: Seed = None, token_ids: TokenIds = False, extra_body: ExtraBody = None,
    max_turns: MaxTurns = None, context_budget: ContextBudget = None, episode_timeout: EpisodeTimeout = None,
    backend: Backend = None, mcp_url: McpUrl = None, gpus: Gpus = None, episodes_per_gpu: PerGpu = None,
    max_per_endpoint: PerEndpoint = None, server_arg: ServerArg = None, verify_trials: VerifyTrials = None,
    compile_mode: CompileMode = None, config: Config = None, quiet: Quiet = False, ray: Ray = None,
    thresholds: Annotated[str | None, typer.Option("--thresholds", help="fast_p thresholds in the tables, e.g. "
                                                                       "0,0.5,1,1.5,2")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write PNG plots")] = True,
) -> None:
    """Evaluate a model (or existing solutions) on a suite: KernelBench levels 1-3 unless --tasks says otherwise.
    Writes OUT/report.json, OUT/report.md and OUT/plots/."""
    from harness.config import EvalConfig, RolloutConfig
    from harness.evaluate import run_eval, tasks_with_solutions
    from harness.rollout import print_summary
    from tasks import TaskError

    flags = {k: v for k, v in locals().items()
             if k not in ("config", "solutions", "thresholds", "plots", "EvalConfig", "RolloutConfig", "run_eval",
                          "tasks_with_solutions", "print_summary", "TaskError")}
    if solutions is not None and not solutions.is_dir():
        _fail(f"--solutions {solutions} is not a folder")
    data = build_rollout_config(config, replay=solutions, **flags)
    if out is None and "out" not in data:
        _fail("--out is required")
    if "tasks" not in data:
        try:
            data["tasks"] = (tasks_with_solutions(solutions, backend) if solutions is not None else ["kernelbench"])
        except TaskError as e:
            _fail(str(e))
    rc = _validated(RolloutConfig, data)
    ps = None
    if thresholds:
        try:
            ps = sorted({float(x) for x in thresholds.split(",") if x.strip()})
        except ValueError:
            _fail(f"--thresholds {thresholds!r}: give numbers separated by commas")
    cfg = EvalConfig(rollout=rc, plots=plots, **({"fast_p_thresholds": ps} if ps else {}))
    console = Console(stderr=True, quiet=quiet)
    summary, report, written = _run(run_eval, cfg, console)
    print_summary(summary, console)
    m = report.overall
    console.print(f"pass rate {m.pass_rate:.1%}, fast_1 vs eager {m.fast_p_eager.get('1', 0):.1%}, "
                  f"fast_1 vs torch.compile {m.fast_p_compile.get('1', 0):.1%} over {m.problems} problems; "
                  f"report: {', '.join(str(p) for p in written)}", highlight=False)
    print(report.overall.model_dump_json(indent=2))


@app.command()
def export(
    runs: Annotated[list[Path] | None, typer.Argument(help="run folders (or episodes.jsonl files); not for verl")]
    = None,
    out: Annotated[Path, typer.Option("--out", help=".jsonl, .parquet, or a folder (datasets' save_to_disk; "
                                                    "verl: the folder to write)")] = Path("export"),
    kind: Annotated[str, typer.Option("--format", help="sft (chat messages + tools), rl (token ids, masks), or "
                                                       "verl (task parquet, tool config, reward function)")] = "sft",
    min_reward: Annotated[float | None, typer.Option("--min-reward", help="keep episodes scoring at least this")]
    = None,
    tasks: Annotated[list[str] | None, typer.Option("--tasks", help="verl: task specs")] = None,
    mcp_url: Annotated[list[str] | None, typer.Option("--mcp-url", help="verl: `cuda-agent serve --transport "
                                                                        "http` endpoint(s)")] = None,
    backend: Annotated[str, typer.Option(help="verl: workspace backend, cuda or cpu")] = "cuda",
    val_fraction: Annotated[float, typer.Option(help="verl: tasks held out for val.parquet (0: val = train)")]
    = 0.0,
    ray: Annotated[str | None, typer.Option("--ray", help="verl: the judge pool of `cuda-agent cluster up` on this "
                                                          "Ray cluster (auto or HOST:PORT) instead of --mcp-url")]
    = None,
) -> None:
    """Turn trajectories into training rows (sft, rl), or tasks into a verl training setup (verl)."""
    from harness.export import rl_rows, save_rows, sft_rows
    from harness.trajectory import load_records

    if kind == "verl":
        if ray:
            mcp_url = [*(mcp_url or []), f"ray:{ray}"]
        if not tasks or not mcp_url:
            _fail("--format verl needs --tasks and --mcp-url (or --ray)")
        from harness.verl import export_verl

        try:
            summary = export_verl(tasks, mcp_url, out, backend=backend, val_fraction=val_fraction)
        except Exception as e:  # an unreachable server or a bad task spec: say which
            _fail(f"verl export failed: {type(e).__name__}: {e}")
        print(json.dumps(summary))
        return
    if kind not in ("sft", "rl"):
        _fail("--format must be sft, rl or verl")
    if not runs:
        _fail("give the run folders to export")
    records = load_records(runs)
    if min_reward is not None:
        records = [r for r in records if (r.reward if r.reward is not None else -1.0) >= min_reward]
    rows = sft_rows(records) if kind == "sft" else rl_rows(records)
    if not rows:
        _fail(f"no {kind} rows from {len(records)} episodes" + (
            " (RL rows need token ids: run with --token-ids against vLLM)" if kind == "rl" else ""))
    path = save_rows(rows, out, kind)
    print(f"{len(rows)} {kind} rows from {len(records)} episodes -> {path}", file=sys.stderr)


def main() -> None:
    app()
