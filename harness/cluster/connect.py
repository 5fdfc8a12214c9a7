"""Joining (or starting) the Ray cluster, and where the judge actors go.

`--ray local` starts a cluster in this process's session, `--ray auto` joins the one `ray start` runs on
this host, `--ray HOST:PORT` joins that one (probed first: Ray itself would wait minutes on a dead
address). Every failure is a ClusterError with a code a caller can act on.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any

NAMESPACE = "cuda-agent"  # named pools (`cuda-agent cluster up`) live here
POOL_PREFIX = "judge-"  # their actors' names: judge-<index>


class ClusterError(RuntimeError):
    """The cluster cannot serve this run. `code` says why: ray_not_installed, unreachable, no_cluster,
    connect_failed, no_actors, actors_pending, no_pool."""

    def __init__(self, code: str, message: str, address: str | None = None):
        super().__init__(message)
        self.code, self.message, self.address = code, message, address

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "address": self.address}

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError("ray_not_installed", "--ray needs Ray: pip install 'cuda-agent[ray]'") from None
    return ray


def _probe(address: str, timeout_s: float = 5.0) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError("connect_failed", f"--ray {address!r}: give local, auto or HOST:PORT of the head's GCS",
                           address)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterError("unreachable", f"no Ray cluster answers at {address} ({e}); is `ray start --head` "
                                          "running there, and is the port the GCS port (default 6379)?",
                           address) from None


def connect(address: str) -> Any:
    """ray.init for this process, once; returns the ray module. A process already connected stays on its
    cluster (a driver inside a verl job, a test's cluster)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": False,
                              "ignore_reinit_error": True}
    try:
        if address == "local":
            ray.init(address="local", **kwargs)
        elif address == "auto":
            ray.init(address="auto", **kwargs)
        else:
            if not address.startswith("ray://"):
                _probe(address)
            ray.init(address=address, **kwargs)
    except ClusterError:
        raise
    except ConnectionError as e:
        code = "no_cluster" if address == "auto" else "unreachable"
        raise ClusterError(code, f"cannot join the Ray cluster at {address!r}: {e}", address) from None
    except Exception as e:  # noqa: BLE001  (ray raises many kinds; the caller needs one)
        raise ClusterError("connect_failed", f"cannot start or join Ray ({address!r}): {type(e).__name__}: {e}",
                           address) from None
    return ray


@dataclass(frozen=True)
class Slot:
    """One judge actor's place: its node, and the GPU (0 or 1) and cores it holds there."""

    node_id: str
    node_ip: str
    num_gpus: int
    num_cpus: float


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def plan_slots(ray: Any, per_node: int | None = None, cpus_per_actor: float | None = None) -> list[Slot]:
    """One actor per GPU of every node; on a cluster without GPUs, `per_node` actors (default 1) on every node
    with cores. Each actor's cores are its node's share unless `cpus_per_actor` says otherwise."""
    nodes = alive_nodes(ray)
    gpu_cluster = any(n["Resources"].get("GPU", 0) >= 1 for n in nodes)
    slots: list[Slot] = []
    for n in sorted(nodes, key=lambda n: n["NodeID"]):
        res = n["Resources"]
        cpus = float(res.get("CPU", 0))
        if gpu_cluster:
            count, gpus = int(res.get("GPU", 0)), 1
        else:
            count, gpus = (per_node or 1) if cpus > 0 else 0, 0
        if count <= 0:
            continue
        share = cpus_per_actor if cpus_per_actor is not None else (
            float(math.floor(cpus / count)) if cpus >= count else cpus / count)
        slots += [Slot(n["NodeID"], n.get("NodeManagerAddress", "?"), gpus, share)] * count
    if not slots:
        kind = "a GPU" if gpu_cluster else "CPUs"
        raise ClusterError("no_actors", f"the Ray cluster has no node with {kind} to place a judge actor on "
                                        f"({len(nodes)} nodes alive)")
    return slots
