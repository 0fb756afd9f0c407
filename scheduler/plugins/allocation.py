"""Allocation plugins: how a node's CPU cores and host memory are split.

* ``proportional``: each GPU's share of the node (cores/GPUs, memory/GPUs),
  split evenly between the jobs on that GPU; an explicit request wins when it
  is larger and fits.

Both give a CPU-only job (``gpus = 0``, data preparation) exactly the cores and
memory it asked for, and split among GPU jobs only what the CPU-only jobs leave.
* ``synergy``: Synergy-style tuning (OSDI'22).  Each job first gets the
  smallest (cores, memory) that keeps its profiled throughput at least what the
  proportional share gives; the leftover goes greedily, one step at a time, to
  the job whose throughput gains most per unit.  Jobs with no profile get the
  proportional share.
"""

from __future__ import annotations

from scheduler.framework import Context, NodeState, register
from scheduler.model import GiB, Allocation, JobRecord


def _prop(ns: NodeState, rec: JobRecord, gpus_here: int) -> tuple[float, float]:
    """Proportional cores and memory bytes of ``rec`` on ``ns``: each GPU's share of what the
    node's CPU-only jobs leave (they get what they asked for, no more)."""
    n = ns.node
    if rec.job.cpu_only:
        return rec.job.cpus, float(rec.job.memory_bytes)
    if n.gpus == 0:
        return float(n.cores), float(n.memory_bytes)
    cores = max(0.0, n.cores - ns.reserved_cpus)
    mem = max(0.0, n.memory_bytes - ns.reserved_memory)
    per_c, per_m = cores / n.gpus, mem / n.gpus
    c = m = 0.0
    jid = rec.job.id
    for res in ns.residents:
        if jid in res:
            c += per_c / len(res)
            m += per_m / len(res)
    if c == 0.0:  # not placed yet: assume exclusive GPUs
        c, m = per_c * gpus_here, per_m * gpus_here
    return c, m


@register("allocate", "proportional")
class Proportional:
    demand_by_shape = True  # a function of the node's resources and reservations only
    def demand(self, rec: JobRecord, ns: NodeState, gpus_here: int, ctx: Context) -> Allocation:
        # The proportional split always fits; only an explicit request can fail to.
        return Allocation(rec.job.cpus, rec.job.memory_bytes)

    def split(self, ns: NodeState, ctx: Context) -> dict[str, Allocation]:
        out = {}
        for jid, n in ns.jobs.items():
            job = ctx.records[jid].job
            c, m = _prop(ns, ctx.records[jid], n)
            out[jid] = Allocation(round(max(c, job.cpus), 3), int(max(m, job.memory_bytes)))
        return out


@register("allocate", "synergy")
class SynergyTune:
    demand_by_shape = True  # a function of the node's resources and reservations only
    def __init__(self, cpu_step: float = 1.0, mem_step_gb: float = 10.0) -> None:
        self.cpu_step = float(cpu_step)
        self.mem_step = float(mem_step_gb) * GiB

    def demand(self, rec: JobRecord, ns: NodeState, gpus_here: int, ctx: Context) -> Allocation:
        sens = ctx.predictors.sensitivity
        c, m = _prop(ns, rec, gpus_here)
        if sens is None or rec.job.cpu_only or not sens.knows(rec.job.model, rec.job.gpus):
            return Allocation(rec.job.cpus, rec.job.memory_bytes)  # as proportional: only requests must fit
        c0, m0 = sens.fair_minimum(rec.job.model, rec.job.gpus, c, m)
        return Allocation(c0, int(m0))

    def split(self, ns: NodeState, ctx: Context) -> dict[str, Allocation]:
        sens = ctx.predictors.sensitivity
        alloc: dict[str, list[float]] = {}
        for jid, n in ns.jobs.items():
            rec = ctx.records[jid]
            if sens is not None and not rec.job.cpu_only and sens.knows(rec.job.model, rec.job.gpus):
                d = self.demand(rec, ns, n, ctx)
                alloc[jid] = [d.cpus, float(d.memory_bytes)]
            else:  # no profile: the proportional share (or the request, when larger)
                c, m = _prop(ns, rec, n)
                alloc[jid] = [max(c, rec.job.cpus), max(m, float(rec.job.memory_bytes))]
        free_c = ns.node.cores - sum(a[0] for a in alloc.values())
        free_m = ns.node.memory_bytes - sum(a[1] for a in alloc.values())
        tunable = [j for j in alloc if sens is not None and not ctx.records[j].job.cpu_only
                   and sens.knows(ctx.records[j].job.model, ctx.records[j].job.gpus)]
        # Greedy: hand out one step of CPU or memory at a time to the best marginal gain.
        for _ in range(4096):
            best = None
            for j in tunable:
                job = ctx.records[j].job
                c, m = alloc[j]
                base = sens.speed(job.model, job.gpus, c, m)
                if free_c >= self.cpu_step:
                    gain = sens.speed(job.model, job.gpus, c + self.cpu_step, m) - base
                    if gain > 1e-9 and (best is None or gain / 1.0 > best[0]):
                        best = (gain, j, 0)
                if free_m >= self.mem_step:
                    gain = sens.speed(job.model, job.gpus, c, m + self.mem_step) - base
                    # weigh a memory step like a CPU step relative to the node's totals
                    w = (self.mem_step / ns.node.memory_bytes) / (self.cpu_step / max(1, ns.node.cores))
                    if gain > 1e-9 and (best is None or gain / w > best[0]):
                        best = (gain / w, j, 1)
            if best is None:
                break
            _, j, kind = best
            if kind == 0:
                alloc[j][0] += self.cpu_step
                free_c -= self.cpu_step
            else:
                alloc[j][1] += self.mem_step
                free_m -= self.mem_step
        # Leftover goes back proportionally so nothing is stranded.
        return {j: Allocation(round(a[0], 3), int(a[1])) for j, a in alloc.items()}
