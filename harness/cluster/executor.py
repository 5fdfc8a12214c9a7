"""Judgments that are not MCP calls (train warmup's judge_files, synth's probes) on the judge actors.

`RayExecutor` is a concurrent.futures.Executor: where a stage ran `ThreadPoolExecutor(jobs).submit(fn, ...)`
it runs the same `fn` on the least busy actor of the pool (the named one of `cuda-agent cluster up`, or
actors of its own), on that actor's node, GPU and cores. A call whose actor died (or whose node went away)
runs again on another actor and is counted in `retried`; its result is delivered once. `fn` and its
arguments travel by pickle, so `fn` must be a module-level function of the installed package.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from harness.cluster.connect import ClusterError, connect
from harness.cluster.pool import find_pool, spawn_actors, wait_up
from harness.config import ToolServerConfig


class RayExecutor(Executor):
    def __init__(self, address: str, backend: str | None = None, per_actor: int = 1,
                 cfg: ToolServerConfig | None = None):
        cfg = cfg or ToolServerConfig(ray=address)
        self.ray = connect(address)
        named = find_pool(self.ray)
        self.owned = not named
        handles = [h for _, h in named] if named else spawn_actors(self.ray, cfg, backend, per_actor)
        up, failed = wait_up(self.ray, handles, cfg.startup_timeout_s)
        if not up:
            raise ClusterError("no_actors", "no judge actor came up: " + "; ".join(failed.values()), address)
        self.address, self.handles = address, handles
        self.actors = {f"ray{i}": (handles[i], info) for i, info in up}
        self.per_actor = per_actor
        self.load: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.lost: dict[str, str] = {}
        self.retried = 0
        self._cond = threading.Condition()
        self._threads = ThreadPoolExecutor(max(1, per_actor * len(self.actors)), thread_name_prefix="ray-judge")

    def _lease(self) -> str:
        with self._cond:
            while True:
                alive = [a for a in self.actors if a not in self.lost]
                if not alive:
                    raise ClusterError("no_actors", "every judge actor went away: " + "; ".join(
                        f"{a} ({w})" for a, w in self.lost.items()), self.address)
                free = [a for a in alive if self.load[a] < self.per_actor]
                if free:
                    alias = min(free, key=lambda a: self.load[a])
                    self.load[alias] += 1
                    return alias
                self._cond.wait()

    def _release(self, alias: str, lost: str | None = None) -> None:
        with self._cond:
            self.load[alias] -= 1
            if lost is not None:
                self.lost.setdefault(alias, lost[:500])
                self.retried += 1
            else:
                self.done[alias] += 1
            self._cond.notify_all()

    def _run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs:
            raise TypeError("RayExecutor.submit takes positional arguments only")
        while True:
            alias = self._lease()
            handle = self.actors[alias][0]
            try:
                result = self.ray.get(handle.run.remote(fn, *args))
            except self.ray.exceptions.RayActorError as e:  # the actor or its node died: run it elsewhere
                self._release(alias, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            except self.ray.exceptions.RayTaskError as e:  # fn itself raised: that is fn's answer
                self._release(alias)
                raise e.as_instanceof_cause() from None
            self._release(alias)
            return result

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:  # type: ignore[override]
        return self._threads.submit(self._run, fn, args, kwargs)

    def status(self) -> dict[str, Any]:
        with self._cond:
            actors = [{"actor": a, "node": info["node_ip"], "node_id": info["node_id"],
                       "gpu": info["gpus"][0] if info["gpus"] else None, "in_flight": self.load[a],
                       "judgments": self.done[a], "state": "lost" if a in self.lost else "alive"}
                      for a, (_, info) in self.actors.items()]
            return {"address": self.address, "actors": actors, "nodes": len({a["node_id"] for a in actors}),
                    "alive": sum(a["state"] == "alive" for a in actors), "retried": self.retried,
                    "in_flight": sum(self.load.values())}

    def metrics(self) -> dict[str, float]:
        st = self.status()
        return {"ray/actors_alive": float(st["alive"]), "ray/nodes": float(st["nodes"]),
                "ray/retried": float(st["retried"])}

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._threads.shutdown(wait=wait, cancel_futures=cancel_futures)
        if self.owned:
            for h in self.handles:
                try:
                    self.ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001, S110  (an actor already gone)
                    pass
            self.owned = False
