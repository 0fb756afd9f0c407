"""Admission of CPU-only jobs (``gpus = 0``: data preparation, preprocessing).

The scheduler core places GPU jobs only (its ``Job`` needs at least one GPU),
so the service admits CPU-only jobs itself, in the simplest way that is safe:
in priority order, then submission order, each on the online node with the
most unallocated cores where its requested cores and memory fit beside every
allocation already made there.  Their cores and memory are then withheld from
what the core may split between GPU jobs on that node (:func:`withheld`).

GPU jobs count here at what they requested, not at the GPU-proportional share
the core's allocator grants them (which is the whole node when nothing else
runs there): cores a GPU job was given but did not ask for are exactly the
idle capacity a data-preparation job may use.
"""

from __future__ import annotations

from typing import Any

from scheduler.service.nodes import LiveNode


def withheld(node: LiveNode) -> tuple[float, int]:
    """Cores and memory held by CPU-only jobs on ``node``."""
    cpus = mem = 0
    for a in node.allocations.values():
        if not a.get("gpus") and a.get("kind") == "cpu":
            cpus += a.get("cpus") or 0.0
            mem += a.get("memory_bytes") or 0
    return float(cpus), int(mem)


def committed(node: LiveNode) -> tuple[float, int]:
    """Cores and memory promised on ``node``: GPU jobs at their request, the rest at their allocation."""
    cpus = mem = 0
    for a in node.allocations.values():
        cpus += a.get("requested_cpus", a.get("cpus") or 0.0)
        mem += a.get("requested_memory_bytes", a.get("memory_bytes") or 0)
    return float(cpus), int(mem)


def admit(waiting: list[dict[str, Any]], nodes: list[LiveNode], core: Any = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(job, node, allocation) for each waiting CPU-only job that fits now."""
    free_c = {n.id: n.cpu_count - committed(n)[0] for n in nodes}
    free_m = {n.id: n.memory_total_bytes - committed(n)[1] for n in nodes}
    out = []
    for j in sorted(waiting, key=lambda j: (-int(j["spec"].get("priority", 0)), j["submitted_at"])):
        s = j["spec"]
        need_c, need_m = float(s["cpus"]), int(s["memory_bytes"])
        fits = [n for n in nodes if free_c[n.id] + 1e-9 >= need_c and free_m[n.id] >= need_m]
        if not fits:
            continue
        best = max(fits, key=lambda n: (free_c[n.id], free_m[n.id], n.id))
        free_c[best.id] -= need_c
        free_m[best.id] -= need_m
        out.append((j["id"], best.id, {"node": best.id, "gpus": [], "cpus": need_c, "memory_bytes": need_m,
                                       "cpuset": None, "kind": "cpu"}))
    return out
