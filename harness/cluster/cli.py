"""`cuda-agent cluster up | status | down`: a judge pool that outlives one command.

`up` places named, detached judge actors on the Ray cluster (one per GPU of every node, or --per-node on a
CPU-only cluster); `rollout`, `eval` and `train ppo --ray ADDRESS` then use that pool instead of placing
actors of their own, and verl's reward and tools reach it as `ray:ADDRESS` (`export --format verl --ray`).
Exit status: 0 done, 2 a ClusterError (its code and message on stderr, and as JSON with --json).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A pool of judge actors on a Ray cluster, shared by runs and by verl.")

Address = Annotated[str, typer.Option("--ray", help="the Ray cluster: auto (the running one) or HOST:PORT")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON only")]


def _guard(fn: Any, as_json: bool) -> Any:
    from harness.cluster.connect import ClusterError

    try:
        return fn()
    except ClusterError as e:
        if as_json:
            print(json.dumps(e.to_dict()))
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


def pool_status(address: str) -> dict[str, Any]:
    from harness.cluster.connect import connect
    from harness.cluster.pool import find_pool, wait_up

    ray = connect(address)
    pool = find_pool(ray)
    up, failed = wait_up(ray, [h for _, h in pool], 30)
    stats = ray.get([pool[i][1].stats.remote() for i, _ in up]) if up else []
    actors = []
    for (i, info), st in zip(up, stats, strict=True):
        actors.append({"actor": pool[i][0], "node": info["node_ip"], "node_id": info["node_id"], "gpus": info["gpus"],
                       "state": "alive", "in_flight": st["in_flight"], "judge_calls": st["judge_calls"],
                       "calls": st["calls"], "up_s": round(st["up_s"], 1)})
    actors += [{"actor": pool[i][0], "state": "not answering", "why": why} for i, why in failed.items()]
    return {"address": address, "actors": actors, "nodes": len({a.get("node_id") for a in actors if a.get("node_id")}),
            "in_flight": sum(a.get("in_flight", 0) for a in actors)}


def _print(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(status, indent=2))
        return
    print(f"{len(status['actors'])} judge actors on {status['nodes']} nodes at {status['address']}, "
          f"{status['in_flight']} calls in flight")
    for a in status["actors"]:
        if a["state"] != "alive":
            print(f"  {a['actor']}: {a['state']} ({a['why']})")
            continue
        gpus = f" gpu {','.join(a['gpus'])}" if a["gpus"] else ""
        print(f"  {a['actor']} on {a['node']}{gpus}: {a['judge_calls']} judge calls, {a['in_flight']} in flight, "
              f"up {a['up_s']:.0f} s")


@app.command()
def up(address: Address = "auto",
       backend: Annotated[str | None, typer.Option(help="default workspace backend: cuda or cpu")] = None,
       per_node: Annotated[int | None, typer.Option(help="CPU-only cluster: actors per node (default 1)")] = None,
       cpus_per_actor: Annotated[float | None, typer.Option(help="cores each actor holds for builds "
                                                                 "(default: its share of its node)")] = None,
       episodes_per_actor: Annotated[int, typer.Option(help="workspaces open at once per actor")] = 16,
       max_restarts: Annotated[int, typer.Option(help="Ray restarts of an actor that died")] = 3,
       server_arg: Annotated[list[str] | None, typer.Option(help="extra `serve` flag (repeatable)")] = None,
       as_json: AsJson = False) -> None:
    """Place the named judge actors and wait until each one's server is up."""
    from harness.cluster.connect import ClusterError, connect
    from harness.cluster.pool import find_pool, spawn_actors, wait_up
    from harness.config import ToolServerConfig

    def run() -> dict[str, Any]:
        ray = connect(address)
        if find_pool(ray):
            raise ClusterError("pool_exists", f"a judge pool is already up at {address!r}: `cuda-agent cluster "
                                              f"down --ray {address}` first", address)
        cfg = ToolServerConfig(ray=address, ray_per_node=per_node, ray_cpus_per_actor=cpus_per_actor,
                               ray_max_restarts=max_restarts, extra_args=server_arg or [])
        handles = spawn_actors(ray, cfg, backend, episodes_per_actor, named=True)
        _, failed = wait_up(ray, handles, cfg.startup_timeout_s)
        if len(failed) == len(handles):
            for h in handles:
                ray.kill(h, no_restart=True)
            raise ClusterError("no_actors", "no judge actor came up: " + "; ".join(failed.values()), address)
        return pool_status(address)

    _print(_guard(run, as_json), as_json)


@app.command()
def status(address: Address = "auto", as_json: AsJson = False) -> None:
    """The pool's actors: nodes, GPUs, judge calls each, calls in flight."""
    from harness.cluster.connect import ClusterError

    def run() -> dict[str, Any]:
        st = pool_status(address)
        if not st["actors"]:
            raise ClusterError("no_pool", f"no judge pool at {address!r} (`cuda-agent cluster up`)", address)
        return st

    _print(_guard(run, as_json), as_json)


@app.command()
def down(address: Address = "auto", as_json: AsJson = False) -> None:
    """Kill the pool's actors (and their servers and workspaces)."""
    from harness.cluster.connect import connect
    from harness.cluster.pool import find_pool

    def run() -> list[str]:
        ray = connect(address)
        pool = find_pool(ray)
        for _, h in pool:
            ray.kill(h, no_restart=True)
        return [n for n, _ in pool]

    names = _guard(run, as_json)
    print(json.dumps({"stopped": names}) if as_json else f"stopped {len(names)} judge actors")
