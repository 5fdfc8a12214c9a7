"""The judge actors of a run, seen from the driver as ordinary tool servers.

`open_ray_servers` joins the cluster, uses the named pool that `cuda-agent cluster up` left there (or
places actors of its own for this run, killed when it ends), waits for each actor's server and yields one
`RayToolServer` per actor. The rollout's ServerPool spreads episodes over them and, when an actor dies,
runs its episodes again on another (harness.rollout), exactly as for HTTP servers on several hosts.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from mcp_types import Tool

from harness.cluster.actor import ToolServerActor
from harness.cluster.connect import NAMESPACE, POOL_PREFIX, ClusterError, Slot, connect, plan_slots
from harness.config import ToolServerConfig
from harness.mcp_tools import ToolOutcome, ToolServer, ToolServerError

BACKSTOP_S = 120.0  # past a call's own limit (the server cancels it there), the actor is taken for wedged


class RayToolServer(ToolServer):
    """One judge actor as a ToolServer: calls go to the actor, which forwards them to its server."""

    def __init__(self, alias: str, actor: Any, info: dict[str, Any]):
        tools = [Tool.model_validate(t) for t in info["tools"]]
        super().__init__(alias, None, tools, f"ray:{info['node_ip']}/{info['node_id'][:12]}",  # type: ignore[arg-type]
                         info["gpus"][0] if info["gpus"] else None)
        self.actor, self.info = actor, info
        self.incarnation: str = info["incarnation"]
        self.node_id: str = info["node_id"]
        self.node_ip: str = info["node_ip"]
        self.endpoint: str | None = None  # ray:ADDRESS#NAME@INCARNATION for an actor of a named pool

    async def call(self, name: str, args: dict[str, Any], timeout_s: float) -> ToolOutcome:
        import ray

        ref = self.actor.call.remote(self.incarnation, name, args, timeout_s)
        try:
            with anyio.fail_after(timeout_s + BACKSTOP_S):
                reply = await ref
        except TimeoutError:
            ray.cancel(ref)
            raise ToolServerError(f"the judge actor {self.alias} ({self.where}) did not answer {name} within "
                                  f"{timeout_s + BACKSTOP_S:.0f} s") from None
        except anyio.get_cancelled_exc_class():
            ray.cancel(ref)  # the episode's time ran out: the actor's call is cancelled, and the server's with it
            raise
        except ray.exceptions.RayActorError as e:
            raise ToolServerError(f"the judge actor {self.alias} ({self.where}) died or its node went away: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from None
        except ray.exceptions.RayError as e:
            raise ToolServerError(f"the judge actor {self.alias} ({self.where}) failed: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from None
        if "stale" in reply:
            raise ToolServerError(f"the judge actor {self.alias} ({self.where}) was restarted: the workspaces "
                                  "it held are gone")
        if "server_error" in reply:
            raise ToolServerError(f"the judge actor {self.alias} ({self.where}): {reply['server_error']}")
        return ToolOutcome.model_validate(reply["outcome"])


def actor_options(ray: Any, slot: Slot, max_restarts: int, name: str | None = None) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {
        "num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "max_restarts": max_restarts,
        # a tool call is not repeated by Ray: on a restarted actor its workspace is gone, and the episode is
        # what runs again (on another actor), whole
        "max_task_retries": 0,
        # soft: a restart may land on another node when this one is gone
        "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=True)}
    if name is not None:
        opts.update(name=name, namespace=NAMESPACE, lifetime="detached")
    return opts


def spawn_actors(ray: Any, cfg: ToolServerConfig, backend: str | None, concurrency: int,
                 named: bool = False) -> list[Any]:
    slots = plan_slots(ray, cfg.ray_per_node, cfg.ray_cpus_per_actor)
    per_server = min(cfg.episodes_per_server or concurrency, concurrency)
    cls = ray.remote(ToolServerActor)
    return [cls.options(**actor_options(ray, slot, cfg.ray_max_restarts, f"{POOL_PREFIX}{i}" if named else None))
            .remote(backend, per_server + 2, max(1, int(slot.num_cpus)), cfg.extra_args, cfg.startup_timeout_s)
            for i, slot in enumerate(slots)]


def find_pool(ray: Any) -> list[tuple[str, Any]]:
    """The named actors of `cuda-agent cluster up`, by name."""
    names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == NAMESPACE and a["name"].startswith(POOL_PREFIX)),
                   key=lambda n: int(n[len(POOL_PREFIX):]) if n[len(POOL_PREFIX):].isdigit() else 0)
    return [(n, ray.get_actor(n, namespace=NAMESPACE)) for n in names]


def wait_up(ray: Any, handles: list[Any], timeout_s: float) -> tuple[list[tuple[int, dict[str, Any]]], dict[int, str]]:
    """Each actor's info once its server is up (blocking); and why the others are not."""
    refs = [h.info.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    up: list[tuple[int, dict[str, Any]]] = []
    failed: dict[int, str] = {}
    for i, ref in enumerate(refs):
        if ref not in ready:
            failed[i] = f"not placed or not started within {timeout_s:.0f} s (does its node have the CPUs/GPU?)"
            continue
        try:
            up.append((i, ray.get(ref)))
        except ray.exceptions.RayError as e:
            failed[i] = f"{type(e).__name__}: {str(e)[-500:]}"
    return up, failed


@asynccontextmanager
async def open_ray_servers(cfg: ToolServerConfig, backend: str | None,
                           concurrency: int) -> AsyncIterator[list[ToolServer]]:
    assert cfg.ray is not None
    ray = await anyio.to_thread.run_sync(connect, cfg.ray)
    named = find_pool(ray)
    owned = not named
    handles = [h for _, h in named] if named else spawn_actors(ray, cfg, backend, concurrency)
    try:
        up, failed = await anyio.to_thread.run_sync(wait_up, ray, handles, cfg.startup_timeout_s)
        if not up:
            raise ClusterError("actors_pending" if all("not placed" in w for w in failed.values()) else "no_actors",
                               "no judge actor came up on the Ray cluster: " + "; ".join(
                                   f"actor {i}: {why}" for i, why in failed.items()), cfg.ray)
        servers: list[ToolServer] = [RayToolServer(f"ray{i}", handles[i], info) for i, info in up]
        for i, why in failed.items():
            print(f"warning: judge actor {i} of the Ray cluster is left out: {why}", file=sys.stderr)
        yield servers
    finally:
        if owned:
            for h in handles:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001, S110  (an actor already gone)
                    pass


def actor_stats(ray: Any, servers: list[Any], timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """What each actor says of itself (calls per tool, judgments, in flight); {} for one that does not answer."""
    refs = {s.alias: s.actor.stats.remote() for s in servers if isinstance(s, RayToolServer)}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, dict[str, Any]] = {}
    for alias, ref in refs.items():
        try:
            out[alias] = ray.get(ref) if ref in ready else {}
        except ray.exceptions.RayError:
            out[alias] = {}
    return out


# ---- a named pool reached by address (verl's reward and tools, `cuda-agent cluster status`) ----------
ENDPOINT_PREFIX = "ray:"  # ray:ADDRESS (the whole pool), ray:ADDRESS#judge-N (one actor), ...#judge-N@INCARNATION


def pool_endpoints(address: str) -> list[str]:
    """One endpoint per actor of the named pool at `address` (started by `cuda-agent cluster up`)."""
    ray = connect(address)
    pool = find_pool(ray)
    if not pool:
        raise ClusterError("no_pool", f"no judge pool on the Ray cluster at {address!r}: start one with "
                                      f"`cuda-agent cluster up --ray {address}`", address)
    return [f"{ENDPOINT_PREFIX}{address}#{name}" for name, _ in pool]


def expand_endpoints(urls: list[str]) -> list[str]:
    """HTTP URLs as they are; a `ray:ADDRESS` becomes one endpoint per actor of its pool."""
    out: list[str] = []
    for url in urls:
        if url.startswith(ENDPOINT_PREFIX) and "#" not in url:
            out += pool_endpoints(url[len(ENDPOINT_PREFIX):])
        else:
            out.append(url)
    return out


@asynccontextmanager
async def connect_endpoint(endpoint: str, timeout_s: float = 120.0) -> AsyncIterator[RayToolServer]:
    """`ray:ADDRESS#judge-N` as a ToolServer (the actor stays: it belongs to the pool, not to this call). With
    `@INCARNATION` (what `endpoint` of a server gives back), calls fail as a lost server once the actor has
    restarted, as the workspaces opened there are gone."""
    address, _, name = endpoint[len(ENDPOINT_PREFIX):].rpartition("#")
    name, _, pinned = name.partition("@")
    ray = await anyio.to_thread.run_sync(connect, address)
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise ClusterError("no_pool", f"the judge actor {name} is not in the pool at {address!r} (was it brought "
                                      "down?)", address) from None
    up, failed = await anyio.to_thread.run_sync(wait_up, ray, [handle], timeout_s)
    if not up:
        raise ClusterError("no_actors", f"the judge actor {name} at {address!r} does not answer: {failed[0]}",
                           address)
    server = RayToolServer(name, handle, up[0][1])
    server.endpoint = f"{ENDPOINT_PREFIX}{address}#{name}@{pinned or server.incarnation}"
    if pinned:
        server.incarnation = pinned
    yield server
