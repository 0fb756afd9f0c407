"""``lent``: Synergy-style tuning extended to local + lent (remote) memory.

Each node is first split exactly as ``synergy`` splits it (:class:`~scheduler.plugins.allocation.
SynergyTune`).  When donors lend memory (the core's :class:`~scheduler.donors.DonorPool` has
capacity), a second greedy hands out memory to the jobs on the node: at each step it picks, over
every tunable job and every higher memory level of its sensitivity profile, the move with the most
throughput gained per byte spent, where reaching a level takes the node's unallocated local memory
first and then lent bytes, each lent byte counted at its **efficiency** (remote bytes are worth local
bytes x ``e``, :mod:`scheduler.remote_memory`).  So a job borrows only where the measured remote
bandwidth and latency, set against its input data rate and its share of the donor, make the bytes
pay; below ``min_efficiency`` it borrows nothing.  Spare cores compete in the same greedy (a job
raised to a higher memory level often needs more cores to use it), costs counted in shares of the
node as ``synergy`` counts them.  Levels, not fixed steps: Synergy's tables are
step functions, so 10 GB more is often worth nothing while the next level is worth 10x.

Without donors it returns ``synergy``'s split unchanged (same decisions, same simulator results).
A job keeps what it borrowed while it runs on the node (the core takes bytes back only when a donor
reclaims them); bytes it no longer needs to hold its level are given back.
"""

from __future__ import annotations

import math

from scheduler import remote_memory as rm
from scheduler.framework import Context, NodeState, register
from scheduler.model import Allocation
from scheduler.plugins.allocation import SynergyTune


@register("allocate", "lent")
class LentMemory(SynergyTune):
    demand_by_shape = True  # the minimum is synergy's: a function of the node's resources only
    lends = True  # hands out lent memory (a job's remote_memory_bytes request needs this)

    def __init__(self, cpu_step: float = 1.0, mem_step_gb: float = 10.0, min_efficiency: float = 0.5,
                 levels_without_donors: bool = False) -> None:
        super().__init__(cpu_step, mem_step_gb)
        if not 0.0 < float(min_efficiency) <= 1.0:
            raise ValueError(f"min_efficiency must be in (0, 1], got {min_efficiency!r}")
        self.min_efficiency = float(min_efficiency)
        # True: run the level greedy on local memory and cores even with no donor (a baseline that
        # separates what lent memory adds from what the level-crossing greedy adds).
        self.levels_without_donors = bool(levels_without_donors)

    def split(self, ns: NodeState, ctx: Context) -> dict[str, Allocation]:
        base = super().split(ns, ctx)
        pool = ctx.pool
        sens = ctx.predictors.sensitivity
        if (pool is None and not self.levels_without_donors) or not ns.node.gpus or not base:
            return base
        nid = ns.node.id
        # A job another engine runs (a bound pod) never gets a run command: it borrows nothing.
        asked = {j: float(ctx.records[j].job.remote_memory_bytes) for j in base
                 if ctx.records[j].job.remote_memory_bytes and pool is not None and not ctx.records[j].external}
        jobs = [j for j in base if sens is not None and not ctx.records[j].job.cpu_only and not ctx.records[j].external
                and sens.knows(ctx.records[j].job.model, ctx.records[j].job.gpus)]
        if not jobs and not asked:
            return base
        local = {j: float(a.memory_bytes) for j, a in base.items()}
        cpus = {j: a.cpus for j, a in base.items()}
        remote = {j: float(pool.held((j, nid))) if pool is not None else 0.0 for j in base}
        for j, n in asked.items():  # what a job asked for, first (the placement waited until it was free)
            remote[j] = max(remote[j], n)
        free_local = max(0.0, ns.node.memory_bytes - sum(local.values()))
        free_remote = (float(pool.total_free()) - sum(max(0.0, remote[j] - pool.held((j, nid))) for j in asked)
                       if pool is not None else 0.0)
        free_cpus = max(0.0, ns.node.cores - sum(cpus.values()))
        # Owners' lent-memory quotas (ctx.quota): what each may still borrow here, shared by its jobs.
        room: dict = {}
        owners: dict[str, list] = {}
        if ctx.quota is not None and pool is not None:
            for j in base:
                mine = ctx.quota.room(ctx.records[j].job, exclude_node=nid)
                owners[j] = list(mine)
                for k, v in mine.items():
                    room.setdefault(k, float(v))
            for j in base:
                for k in owners[j]:
                    room[k] -= remote[j]
        # Costs in shares of the node, as synergy weighs a memory step against a CPU step.
        per_byte = 1.0 / max(1.0, float(ns.node.memory_bytes))
        per_core = 1.0 / max(1, ns.node.cores)

        memo: dict[tuple[str, float, float], float] = {}  # the pool does not change during a split

        def eff(j: str, loc: float, rem: float) -> float:
            if rem <= 0:
                return 1.0
            key = (j, loc, rem)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = _eff(j, loc, rem)
            return hit

        def _eff(j: str, loc: float, rem: float) -> float:
            job = ctx.records[j].job
            target = sens.speed(job.model, job.gpus, cpus[j], loc + rem)
            demand = rm.remote_demand(rm.input_rate(sens, job.model, job.gpus, target), loc, rem)
            holder = (j, nid)
            supply = pool.supply(holder) if pool.held(holder) else pool.share_if_added(demand)
            sample = rm.SAMPLE_BYTES.get(job.model, rm.DEFAULT_SAMPLE_BYTES)
            supply = min(supply, pool.link.stream_bytes_per_s(sample, cpus[j]))
            return rm.efficiency(demand, supply)

        for _ in range(64 * len(jobs)):
            best: tuple[float, str, float, float, float] | None = None
            for j in jobs:
                job = ctx.records[j].job
                loc, rem = local[j], remote[j]
                e_now = eff(j, loc, rem)
                have = loc + e_now * rem
                cur = sens.speed(job.model, job.gpus, cpus[j], have)
                if free_cpus >= self.cpu_step:  # more memory makes more cores pay: they compete here too
                    gain = sens.speed(job.model, job.gpus, cpus[j] + self.cpu_step, have) - cur
                    if gain > 1e-9:
                        ratio = gain / (self.cpu_step * per_core)
                        if best is None or ratio > best[0] + 1e-12:
                            best = (ratio, j, 0.0, 0.0, self.cpu_step)
                for level in sens.levels_bytes(job.gpus):
                    if level <= have + 1.0:
                        continue
                    gain = sens.speed(job.model, job.gpus, cpus[j], level) - cur
                    if gain <= 1e-9:
                        continue
                    need = level - have
                    dl = min(need, free_local)
                    dr = 0.0
                    if need - dl > 0:
                        if pool is None:
                            continue
                        # the lent bytes that reach the level at their efficiency (which falls as they grow)
                        e = e_now if rem > 0 else 1.0
                        for _it in range(4):
                            dr = max(0.0, (level - (loc + dl)) / max(e, 1e-9) - rem)
                            e = eff(j, loc + dl, rem + dr)
                        if e < self.min_efficiency:
                            continue
                        dr = math.ceil(max(0.0, (level - (loc + dl)) / e - rem)) + 1.0
                        if dr > free_remote or any(room[k] < dr for k in owners.get(j, ())):
                            continue
                    ratio = gain / ((dl + dr) * per_byte)
                    if best is None or ratio > best[0] + 1e-12:
                        best = (ratio, j, dl, dr, 0.0)
            if best is None:
                break
            _, j, dl, dr, dc = best
            cpus[j] += dc
            free_cpus -= dc
            local[j] += dl
            free_local -= dl
            remote[j] += dr
            free_remote -= dr
            for k in owners.get(j, ()):
                room[k] -= dr
        # Give back lent bytes a job does not need to hold the level it reached.
        for j in jobs:
            rem = remote[j]
            if rem <= 0:
                continue
            job = ctx.records[j].job
            e = eff(j, local[j], rem)
            have = local[j] + e * rem
            reached = [lv for lv in sens.levels_bytes(job.gpus) if lv <= have + 1.0]
            floor = reached[-1] if reached else 0.0
            keep = 0.0 if floor <= local[j] else math.ceil((floor - local[j]) / max(e, 1e-9)) + 1.0
            remote[j] = min(rem, max(keep, asked.get(j, 0.0)))
        return {j: Allocation(round(cpus[j], 3), int(local[j]), int(remote.get(j, 0.0))) for j, a in base.items()}
