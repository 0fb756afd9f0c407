"""The cluster over time: one point every ``step_s`` (10 s) for ``keep_s`` (24 h), bounded.

Each point is a flat dict of numbers (:data:`FIELDS`): GPUs and CPUs in total, allocated and used,
host memory allocated and used, memory lendable, lent and promised to jobs, the queue (jobs waiting,
running, the longest and mean wait) and the aggregation servers' load.  Points live in memory (a
bounded deque) and in the service's database (table ``history``, pruned as it goes), so a restart
keeps the day.  ``GET /v1/history`` serves them as columns; the status page draws them.

The SQL of the ``history`` table lives here, on the store's connections (as the journal's does).
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from typing import Any

from scheduler.service.store import JobStore

log = logging.getLogger("dlshare.sched.history")

FIELDS = (
    "nodes_online", "nodes_total",
    "gpus_total", "gpus_allocated", "gpu_util_percent",
    "cpus_total", "cpus_allocated", "cpus_used",
    "memory_total_bytes", "memory_allocated_bytes", "memory_used_bytes",
    "memory_lendable_bytes", "memory_lent_bytes", "memory_promised_bytes",
    "jobs_running", "jobs_waiting", "wait_longest_s", "wait_mean_s",
    "agg_servers", "agg_pool_cores", "agg_busy_cores", "agg_bytes_in_per_s",
)

_DDL = "CREATE TABLE IF NOT EXISTS history (ts REAL PRIMARY KEY, data TEXT NOT NULL)"


def point(view: dict[str, Any], waits: list[float]) -> dict[str, float | None]:
    """One point from the cluster view (:func:`scheduler.service.views.cluster_view`) and the
    waiting jobs' waits so far (seconds)."""
    online = [n for n in view["nodes"] if n["status"] == "online"]
    utils = [g["util_percent"] for n in online for g in n["gpus"] if isinstance(g.get("util_percent"), (int, float))]
    agg = view.get("aggregation") or {}
    counts = view.get("jobs_by_state") or {}
    return {
        "nodes_online": len(online), "nodes_total": len(view["nodes"]),
        "gpus_total": view["gpus_total"], "gpus_allocated": view["gpus_allocated"],
        "gpu_util_percent": sum(utils) / len(utils) if utils else None,
        "cpus_total": view["cpus_total"], "cpus_allocated": view["cpus_allocated"],
        "cpus_used": sum((n["cpu_percent"] or 0.0) / 100.0 * n["cpu_count"] for n in online),
        "memory_total_bytes": sum(n["memory_total_bytes"] for n in online),
        "memory_allocated_bytes": sum(n["memory_allocated_bytes"] for n in online),
        "memory_used_bytes": sum(max(0, n["memory_total_bytes"] - n["memory_available_bytes"]) for n in online),
        "memory_lendable_bytes": view["memory_lendable_bytes"], "memory_lent_bytes": view["memory_lent_bytes"],
        "memory_promised_bytes": view.get("memory_promised_bytes", 0),
        "jobs_running": counts.get("running", 0), "jobs_waiting": len(waits),
        "wait_longest_s": max(waits) if waits else 0.0, "wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
        "agg_servers": agg.get("servers", 0), "agg_pool_cores": agg.get("pool_cores", 0.0),
        "agg_busy_cores": agg.get("busy_cores", 0.0), "agg_bytes_in_per_s": agg.get("bytes_in_per_s", 0.0),
    }


class ClusterHistory:
    """Points every ``step_s`` for ``keep_s`` (see the module docstring)."""

    def __init__(self, store: JobStore | None, step_s: float = 10.0, keep_s: float = 86400.0) -> None:
        if not (0 < step_s <= keep_s):
            raise ValueError(f"history: step_s ({step_s}) must be > 0 and at most keep_s ({keep_s})")
        if keep_s / step_s > 1_000_000:
            raise ValueError("history: at most 1,000,000 points (keep_s / step_s)")
        self.store = store
        self.step_s = float(step_s)
        self.keep_s = float(keep_s)
        self.points: deque[dict[str, Any]] = deque(maxlen=int(math.ceil(keep_s / step_s)) + 1)
        self.last = -math.inf
        if store is not None:
            with store.tx() as db:
                db.execute(_DDL)
            with store.read() as db:
                rows = db.execute("SELECT ts, data FROM history ORDER BY ts").fetchall()
            for ts, data in rows:
                try:
                    self.points.append({"ts": float(ts), **json.loads(data)})
                except (ValueError, TypeError):
                    continue
            if self.points:
                self.last = self.points[-1]["ts"]

    def due(self, now: float) -> bool:
        return now - self.last >= self.step_s - 1e-6

    def add(self, now: float, values: dict[str, Any]) -> dict[str, Any]:
        """Keep one point at ``now`` (the caller checks :meth:`due`)."""
        p = {"ts": now, **{k: values.get(k) for k in FIELDS}}
        self.points.append(p)
        self.last = now
        while self.points and self.points[0]["ts"] < now - self.keep_s:
            self.points.popleft()
        if self.store is not None:
            try:
                with self.store.tx() as db:
                    db.execute("INSERT OR REPLACE INTO history VALUES (?, ?)",
                               (now, json.dumps({k: p[k] for k in FIELDS})))
                    db.execute("DELETE FROM history WHERE ts < ?", (now - self.keep_s,))
            except Exception:  # noqa: BLE001 - the in-memory history goes on
                log.exception("storing a history point failed")
        return p

    def since(self, since: float = -math.inf, max_points: int = 2000) -> list[dict[str, Any]]:
        """The points from ``since`` on, at most ``max_points`` (longer spans are averaged over
        buckets of consecutive points, the last one kept whole)."""
        pts = [p for p in list(self.points) if p["ts"] >= since]
        return downsample(pts, max_points)

    def columns(self, since: float = -math.inf, max_points: int = 2000) -> dict[str, Any]:
        """``GET /v1/history``: ``{"step_s", "keep_s", "ts": [...], "<field>": [...], ...}``."""
        pts = self.since(since, max_points)
        out: dict[str, Any] = {"step_s": self.step_s, "keep_s": self.keep_s, "fields": list(FIELDS),
                               "ts": [p["ts"] for p in pts]}
        for k in FIELDS:
            out[k] = [p.get(k) for p in pts]
        return out


def downsample(pts: list[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most ``max_points`` points: consecutive points averaged in buckets (``None`` where a
    bucket has no number), the newest point kept as it is so the present is exact."""
    if max_points < 1:
        raise ValueError("max_points must be >= 1")
    if len(pts) <= max_points:
        return pts
    head, last = pts[:-1], pts[-1]
    buckets = max(1, max_points - 1)
    size = math.ceil(len(head) / buckets)
    out = []
    for i in range(0, len(head), size):
        chunk = head[i:i + size]
        p: dict[str, Any] = {"ts": chunk[-1]["ts"]}
        for k in FIELDS:
            xs = [c[k] for c in chunk if isinstance(c.get(k), (int, float))]
            p[k] = sum(xs) / len(xs) if xs else None
        out.append(p)
    out.append(last)
    return out


__all__ = ["FIELDS", "ClusterHistory", "downsample", "point"]
