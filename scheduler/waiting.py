"""Why a waiting job waits, and where it stands in the queue (pure; reads the core, changes nothing).

``squeue`` gives every pending job a reason (``Resources``, ``Priority``, ``QOSMaxGRESPerUser``...)
and ``kubectl describe`` says "0/3 nodes are available: 3 Insufficient nvidia.com/gpu".  This module
gives the core's waiting jobs the same: a :class:`WaitReason` with a short ``code`` in Slurm's style
and a ``message`` in the words of the part that holds the job back, read from the very books and
plugins the scheduling pass uses (:meth:`SchedulingPasses.candidates`, ``fits_resources``, the
profile's filters through :meth:`SchedulerState.explain`, the owners' quota, the watch's backoff).
Nothing here decides anything: a job is explained by asking the core what it would do with it.

Codes, in the order they are looked for:

* ``QuotaLimit``: its owner (user or account) is at a limit of the profile's ``[quota]``;
* ``Backoff``: its last start failed and it waits out the backoff (:mod:`scheduler.watch`);
* ``NoNodes``: no node is online;
* ``Priority``: it would fit now, but jobs ahead of it in the order go first
  (``behind 3 jobs of higher priority``);
* ``Resources``: not enough free GPUs, or cores and memory (``needs 8 GPUs on 2 nodes; 1 free``);
* ``Gang``: a job spread over nodes has enough free GPUs, but not enough nodes with room for their
  part (``gang: 2 of 4 nodes``);
* ``LentMemory``: it must borrow more lent memory than the donors have free
  (``waits for lent memory (2.0 GiB; 0 B free)``);
* ``Placement``: GPUs, cores and memory are there, but the profile's filters refuse every node
  (the filter's own words, the most common first).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.framework import Candidate
from scheduler.model import JobRecord

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.state import SchedulerState

CODES = ("QuotaLimit", "Backoff", "NoNodes", "Priority", "Resources", "Gang", "LentMemory", "Placement")


@dataclass(frozen=True)
class WaitReason:
    """Why a job waits: ``code`` (one of :data:`CODES`), ``message`` (one line) and, when nodes
    refuse it, ``nodes`` (kube-scheduler's summary: ``0/3 nodes are available: 2 ..., 1 ...``)."""

    code: str
    message: str
    nodes: str = ""


def size(n: float) -> str:
    """Bytes for people: ``512 B``, ``1.5 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover - the loop returns at TiB


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _jobs(n: int) -> str:
    return f"{n} job" if n == 1 else f"{n} jobs"


def queue_order(state: "SchedulerState") -> list[str]:
    """Waiting job ids in the order the profile would start them now (position 1 first)."""
    return [r.job.id for r in state.queue()]


def nodes_summary(reasons: dict[str, str], alive: int) -> str:
    """kube-scheduler's ``0/N nodes are available: ...`` from per-node reasons (most common first)."""
    if not reasons:
        return ""
    counts = Counter(reasons.values()).most_common()
    ok = max(0, alive - len(reasons))
    parts = ", ".join(f"{n} {why}" for why, n in counts[:3])
    more = f", and {len(counts) - 3} more reasons" if len(counts) > 3 else ""
    return f"{ok}/{alive} nodes are available: {parts}{more}"


def why_waiting(state: "SchedulerState", job_id: str, ahead: int | None = None,
                cache: dict[object, WaitReason | None] | None = None) -> WaitReason:
    """Why waiting job ``job_id`` is not running now.  ``ahead``: how many waiting jobs the order
    puts before it (computed when not given; pass it when explaining a whole queue).  ``cache``:
    what placement said of jobs alike (the pass's equivalence class and the lent memory asked for),
    kept across the calls of one explanation of the queue.  Raises ``KeyError`` for a job that is
    not waiting."""
    rec = state.waiting[job_id]
    job = rec.job
    led = state.ledger
    over = state.quota_reason(job)
    if over:
        return WaitReason("QuotaLimit", over)
    until = led.watch.not_before.get(job_id)
    if until is not None and until > state.now + 1e-9:
        fails = led.watch.failures.get(job_id, 0)
        return WaitReason("Backoff", f"its start failed ({fails}x); tried again in {until - state.now:.0f} s")
    alive = [ns for ns in state.nodes.values() if ns.alive]
    if not alive:
        return WaitReason("NoNodes", "no node is online")
    key = (led.job_class.get(job_id), job.remote_memory_bytes)
    if cache is not None and key in cache:
        lacks = cache[key]
    else:
        ctx = led.context()
        lacks = None if state.passes.candidates(rec, ctx, limit=False) else _resources(state, rec, alive, ctx)
        if cache is not None:
            cache[key] = lacks
    if lacks is None:
        if ahead is None:
            order = queue_order(state)
            ahead = order.index(job_id) if job_id in order else 0
        if ahead:
            return WaitReason("Priority", f"behind {_jobs(ahead)} of higher priority")
        return WaitReason("Priority", "fits now: starts at the next scheduling pass")
    return lacks


def _resources(state: "SchedulerState", rec: JobRecord, alive: list, ctx) -> WaitReason:
    """A job no node can take now: what it lacks, in cluster terms first."""
    job = rec.job
    led = state.ledger
    passes = state.passes
    per_node = state.explain(job)
    summary = nodes_summary(per_node, len(alive))
    free = led.free_gpus
    if job.remote_memory_bytes and job.remote_memory_bytes > led.pool.total_free():
        return WaitReason("LentMemory", f"waits for lent memory ({size(job.remote_memory_bytes)}; "
                                        f"{size(led.pool.total_free())} free)", summary)
    if job.cpu_only:
        cores = max((ns.node.cores - ns.demand_cpus for ns in alive), default=0.0)
        mem = max((ns.node.memory_bytes - ns.demand_memory for ns in alive), default=0)
        return WaitReason("Resources", f"needs {job.cpus:g} cores and {size(job.memory_bytes)} on one node; "
                                       f"at most {max(0.0, cores):g} cores and {size(max(0, mem))} free on one",
                          summary)
    g = job.gpus
    biggest = led.max_node_gpus or 1
    if g > biggest:  # spread over nodes: a gang
        need_nodes = math.ceil(g / biggest)
        if free < g:
            return WaitReason("Resources", f"needs {_gpus(g)} on {need_nodes} nodes; {free} free", summary)
        ready = 0
        for ns in alive:
            part = Candidate(ns, ns.free_indices()[:min(g, ns.free_gpus)])
            if ns.free_gpus and passes.fits_resources(rec, part, ctx) and all(
                    f.filter(rec, part, ctx) is None for f in passes.filters):
                ready += 1
        return WaitReason("Gang", f"gang: {min(ready, need_nodes)} of {need_nodes} nodes have room for their part "
                                  f"({free} GPUs free)", summary)
    most = max((ns.free_gpus for ns in alive), default=0)
    if most < g and not passes.share_ok(rec):
        if free < g:
            return WaitReason("Resources", f"needs {_gpus(g)}; {free} free", summary)
        return WaitReason("Resources", f"needs {_gpus(g)} on one node; {free} free, at most {most} on one node",
                          summary)
    roomy = [ns for ns in alive if ns.free_gpus >= g]
    if roomy and not any(passes.fits_resources(rec, Candidate(ns, ns.free_indices()[:g]), ctx) for ns in roomy):
        best = max(roomy, key=lambda ns: (ns.node.cores - ns.demand_cpus, ns.node.memory_bytes - ns.demand_memory))
        need = passes.allocator.demand(rec, best, g, ctx)
        return WaitReason("Resources", f"needs {need.cpus:g} cores and {size(need.memory_bytes)} beside its "
                                       f"{_gpus(g)}; nodes with {g} free GPUs have at most "
                                       f"{max(0.0, best.node.cores - best.demand_cpus):g} cores and "
                                       f"{size(max(0, best.node.memory_bytes - best.demand_memory))} unpromised",
                          summary)
    if per_node:
        common, n = Counter(per_node.values()).most_common(1)[0]
        return WaitReason("Placement", f"{common} ({n} of {len(alive)} nodes)", summary)
    return WaitReason("Resources", f"needs {_gpus(g)}; {free} free", summary)  # pragma: no cover - defensive


def explain_queue(state: "SchedulerState", limit: int = 200) -> tuple[list[str], dict[str, WaitReason]]:
    """The queue in order and the reason of each of its first ``limit`` jobs (jobs further back
    are ``Priority``: behind that many others).  Jobs alike (the same equivalence class the pass
    uses) are explained once."""
    order = queue_order(state)
    out: dict[str, WaitReason] = {}
    cache: dict[object, WaitReason | None] = {}
    for i, jid in enumerate(order):
        if i >= limit:
            out[jid] = WaitReason("Priority", f"behind {_jobs(i)} of higher priority")
        else:
            out[jid] = why_waiting(state, jid, ahead=i, cache=cache)
    return order, out


__all__ = ["CODES", "WaitReason", "explain_queue", "nodes_summary", "queue_order", "size", "why_waiting"]
