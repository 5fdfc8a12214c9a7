"""The status view of a run on Ray: which actors, on which nodes and GPUs, how many judgments each, and the
queue. The rollout keeps it in OUT/cluster.json while it runs, prints it as one line in its progress
output, and puts the last one (with what each actor counted itself) in its summary."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

STATUS_FILE = "cluster.json"


def cluster_view(address: str | None, servers: list[Any], load: dict[str, int], lost: dict[str, str],
                 episodes: Counter[str], judgments: Counter[str], queue: int, retried: int,
                 actor_stats: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    actors = []
    for s in servers:
        row: dict[str, Any] = {"actor": s.alias, "node": getattr(s, "node_ip", None),
                               "node_id": getattr(s, "node_id", None), "gpu": s.gpu, "where": s.where,
                               "in_flight": load.get(s.alias, 0), "episodes": episodes[s.alias],
                               "judgments": judgments[s.alias], "state": "lost" if s.alias in lost else "alive"}
        if s.alias in lost:
            row["lost"] = lost[s.alias]
        if actor_stats is not None:
            row["actor_counts"] = actor_stats.get(s.alias) or None
        actors.append(row)
    nodes = sorted({a["node_id"] for a in actors if a["node_id"]})
    return {"address": address, "actors": actors, "nodes": len(nodes),
            "gpus": sum(1 for a in actors if a["gpu"] is not None), "alive": sum(a["state"] == "alive" for a in actors),
            "in_flight": sum(a["in_flight"] for a in actors), "queue": queue, "retried": retried}


def status_line(view: dict[str, Any]) -> str:
    parts = []
    for a in view["actors"]:
        where = f"{a['node']}" + (f" gpu{a['gpu']}" if a["gpu"] is not None else "")
        state = "LOST" if a["state"] == "lost" else f"{a['in_flight']} running"
        parts.append(f"{a['actor']}@{where}: {state}, {a['judgments']} judged")
    return (f"ray: {view['alive']}/{len(view['actors'])} actors on {view['nodes']} nodes, queue {view['queue']}, "
            f"retried {view['retried']} | " + "; ".join(parts))


def write_status(out: Path, view: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees a half-written file."""
    tmp = out / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(view, indent=1))
    os.replace(tmp, out / STATUS_FILE)
