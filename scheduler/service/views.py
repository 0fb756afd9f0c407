"""The cluster as the API shows it: nodes, GPUs and who is on them, CPU and memory allocations,
lent memory and the aggregation servers' load (pure: built from the service's state)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scheduler.service.nodes import LiveNode
from scheduler.state import SchedulerState


def cluster_view(core: SchedulerState, nodes_seen: Iterable[LiveNode], aggregation: Iterable[Mapping[str, Any]],
                 jobs_by_state: dict[str, int], profile: str, now: float) -> dict[str, Any]:
    """``GET /v1/cluster``; the status page and the tour read it too.  The node table gives the
    measured figures; who runs where, and with what, is the core's (on the loop's thread)."""
    nodes = []
    for n in sorted(nodes_seen, key=lambda n: n.id):
        ns = core.nodes.get(n.id)
        jobs = sorted(ns.jobs) if ns is not None and ns.alive else []
        residents = ns.residents if ns is not None and ns.alive else []
        allocs = [core.records[j].allocation.get(n.id) for j in jobs]
        pool = core.ledger.pool
        borrowed_from: dict[str, int] = {}  # the core's books: donor -> bytes promised to jobs here
        for j in jobs:
            for donor, b in pool.donors_of((j, n.id)).items():
                borrowed_from[donor] = borrowed_from.get(donor, 0) + b
        nodes.append({
            "id": n.id, "status": n.status if n.status in ("online", "offline") else "unknown",
            "last_seen": n.last_seen, "cpu_count": n.cpu_count, "cpu_percent": n.cpu_percent,
            "cpus_allocated": float(sum(a.cpus for a in allocs if a is not None)),
            "memory_total_bytes": n.memory_total_bytes, "memory_available_bytes": n.memory_available_bytes,
            "memory_allocated_bytes": int(sum(a.memory_bytes for a in allocs if a is not None)),
            "reserved_unused_bytes": n.reserved_unused_bytes, "lendable_bytes": n.lendable_bytes,
            "lent_bytes": n.lent_bytes, "promised_as_donor_bytes": pool.promised_on(n.id),
            "borrowed_bytes": int(sum(a.remote_bytes for a in allocs if a is not None)),
            "borrowed_from": borrowed_from,
            "gpus": [{"index": g.index, "name": g.name, "util_percent": g.util_percent,
                      "memory_used_bytes": g.memory_used_bytes, "memory_total_bytes": g.memory_total_bytes,
                      "jobs": list(residents[g.index]) if g.index < len(residents) else []} for g in n.gpus],
            "gpu_reason": n.gpu_reason, "jobs": jobs})
    agg = [a for a in aggregation if now - a.get("_seen", 0) < 60 and isinstance(a.get("pool", {}), dict)]
    online = [n for n in nodes if n["status"] == "online"]
    return {
        "ts": now, "nodes": nodes, "jobs_by_state": jobs_by_state,
        "gpus_total": sum(len(n["gpus"]) for n in online),
        "gpus_allocated": sum(1 for n in online for g in n["gpus"] if g["jobs"]),
        "cpus_total": float(sum(n["cpu_count"] for n in online)),
        "cpus_allocated": float(sum(n["cpus_allocated"] for n in online)),
        "memory_lent_bytes": sum(n["lent_bytes"] for n in online),
        "memory_lendable_bytes": sum(n["lendable_bytes"] for n in online),
        "memory_promised_bytes": core.ledger.pool.stats()["promised_bytes"],
        "aggregation": {
            "servers": len(agg),
            "addresses": sorted(str(a.get("address", "")) for a in agg),
            "jobs": int(sum(_num(a.get("jobs")) for a in agg)),
            "pool_cores": float(sum(_num((a.get("pool") or {}).get("size")) for a in agg)),
            "busy_cores": float(sum(_num((a.get("pool") or {}).get("demand_cores")) for a in agg)),
            "bytes_in_per_s": float(sum(_num(a.get("bytes_in_per_s")) for a in agg)),
        },
        "profile": profile,
    }


def _num(v: Any) -> float:
    if isinstance(v, bool):
        return 0.0
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, dict)):
        return float(len(v))
    return 0.0
