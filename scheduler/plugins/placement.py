"""Placement plugins (filters and scores).

Scores are raw (higher is better); the core normalises each plugin's scores to
0-100 over the feasible candidates and weights them.

* ``consolidate``: fill the fullest node first (fewer fragments, more whole
  nodes left for large jobs).
* ``spread``: the emptiest node first.
* ``random``: Gandiva-style random packing (the core's seeded ``rng``).
* ``utilisation_cap`` filter + ``low_utilisation`` score: Horus: share a GPU only
  while the predicted utilisation of everything on it stays under a cap.
* ``interference`` score: IADeep: minimise the predicted slowdown of every job
  on the device.  ``gpu_memory`` filter: the footprints must fit the device.
* ``colocation_gain`` filter + ``throughput`` score (dlshare): share a GPU only
  when the predicted combined normalised throughput beats running alone by a
  margin and the resident job keeps most of its speed.
* ``gpu_type`` score (dlshare): on a cluster of several GPU generations, put a job where it gains
  most against the other jobs (comparative advantage).
"""

from __future__ import annotations

from scheduler.framework import Candidate, Context, register
from scheduler.model import JobRecord


def _types(cand: Candidate, ctx: Context) -> list[str]:
    return [ctx.records[o].job.job_type for o in cand.residents]


@register("score", "consolidate")
class Consolidate:
    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        left = cand.node.free_gpus - (0 if cand.shared else rec.job.gpus)
        return -float(left) - (0.5 if cand.shared else 0.0)


@register("score", "spread")
class Spread:
    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        return float(cand.node.free_gpus) - (0.5 if cand.shared else 0.0)


@register("score", "random")
class RandomPack:
    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        return ctx.rng.random()


@register("filter", "gpu_memory")
class GpuMemory:
    """The footprints on a device must fit its memory (unknown footprints pass)."""

    def filter(self, rec: JobRecord, cand: Candidate, ctx: Context) -> str | None:
        if not cand.shared or not rec.job.gpu_memory_bytes:
            return None
        used = rec.job.gpu_memory_bytes + sum(ctx.records[o].job.gpu_memory_bytes for o in cand.residents)
        if used > cand.node.node.gpu_memory_bytes:
            return "GPU memory"
        return None


@register("filter", "utilisation_cap")
class UtilisationCap:
    """Horus: co-locate only while the predicted SM utilisation sum stays <= ``cap`` percent."""

    def __init__(self, cap: float = 100.0) -> None:
        self.cap = float(cap)

    def filter(self, rec: JobRecord, cand: Candidate, ctx: Context) -> str | None:
        if not cand.shared:
            return None
        total = ctx.predictors.utilisation_of(rec.job)[0]
        total += sum(ctx.predictors.utilisation_of(ctx.records[o].job)[0] for o in cand.residents)
        return None if total <= self.cap else f"predicted utilisation {total:.0f}% > {self.cap:.0f}%"


@register("score", "low_utilisation")
class LowUtilisation:
    """Horus: prefer the device with the lowest predicted utilisation sum."""

    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        if not cand.shared:
            return 0.0
        return -sum(ctx.predictors.utilisation_of(ctx.records[o].job)[0] for o in cand.residents)


@register("score", "interference")
class Interference:
    """IADeep: minimise the predicted total slowdown of all jobs on the device
    (an exclusive placement has none)."""

    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        if not cand.shared:
            return 0.0
        speeds = ctx.predictors.colocated_speeds(rec.job.job_type, _types(cand, ctx), rec.job,
                                                 [ctx.records[o].job for o in cand.residents])
        return -sum(1.0 - s for s in speeds)


@register("filter", "colocation_gain")
class ColocationGain:
    """Share only when predicted combined throughput >= 1 + ``min_gain`` and every
    resident keeps >= ``min_resident_speed`` of its speed alone."""

    def __init__(self, min_gain: float = 0.1, min_resident_speed: float = 0.5) -> None:
        self.min_gain = float(min_gain)
        self.min_resident_speed = float(min_resident_speed)

    def filter(self, rec: JobRecord, cand: Candidate, ctx: Context) -> str | None:
        if not cand.shared:
            return None
        speeds = ctx.predictors.colocated_speeds(rec.job.job_type, _types(cand, ctx), rec.job,
                                                 [ctx.records[o].job for o in cand.residents])
        if sum(speeds) < 1.0 + self.min_gain * (len(speeds) - 1):
            return "predicted co-location gain too small"
        if min(speeds[1:], default=1.0) < self.min_resident_speed:
            return "resident would slow too much"
        return None


@register("score", "throughput")
class Throughput:
    """Prefer the placement with the highest predicted combined throughput on the device."""

    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        if not cand.shared:
            return 1.0
        speeds = ctx.predictors.colocated_speeds(rec.job.job_type, _types(cand, ctx), rec.job,
                                                 [ctx.records[o].job for o in cand.residents])
        return sum(speeds) - len(speeds) + 1.0


@register("score", "gpu_type")
class GpuType:
    """Several GPU generations (issue 23): prefer the generation where the job's speed, against the
    mean speed there of the jobs in the system, is highest: comparative advantage, the greedy
    form of Gavel's heterogeneity-aware allocation (Narayanan et al., OSDI'20), which gives the
    fast GPUs to the jobs that gain most from them.  A job that runs 10x faster on a V100 than on a
    K80 takes the V100; one that gains 1.2x leaves it to others and takes the K80, where the
    others crawl.  Speeds come from ``ctx.predictors.type_speed`` (Gavel's measured throughputs);
    an untyped node, or a job type never measured, scores 1 (as fast as the reference)."""

    def __init__(self) -> None:
        self._seen: tuple = ()
        self._mean: dict[str, float] = {}

    def _means(self, ctx: Context) -> dict[str, float]:
        key = (ctx.now, len(ctx.running or ()), len(ctx.waiting or ()), len(ctx.nodes))
        if key != self._seen:
            types = {ns.node.gpu_type for ns in ctx.nodes.values() if ns.node.gpu_type}
            sums = dict.fromkeys(types, 0.0)
            counts = dict.fromkeys(types, 0)
            for rec in (*(ctx.running or {}).values(), *(ctx.waiting or {}).values()):
                if rec.job.cpu_only:
                    continue
                for t in types:
                    v = ctx.predictors.type_speed(rec.job, t)
                    if v is not None:
                        sums[t] += v
                        counts[t] += 1
            self._mean = {t: sums[t] / counts[t] for t in types if counts[t]}
            self._seen = key
        return self._mean

    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float:
        t = cand.node.node.gpu_type
        v = ctx.predictors.type_speed(rec.job, t) if t else None
        if v is None:
            return 1.0
        mean = self._means(ctx).get(t)
        return v / mean if mean else v


@register("filter", "gpu_type")
class GpuTypeFloor:
    """Several GPU generations: do not start a job where it would run so much slower than on its
    best generation in the cluster that waiting for that one is quicker.  Running now at ``v`` of
    its best speed takes d / v; waiting takes W + d; so it starts where ``v >= 1 / (1 + W / d)``.
    W / d is estimated, in units of a job's run time, as the backlog (the GPUs the waiting jobs ask
    for over the cluster's GPUs: the waves of work ahead of a newcomer), plus one when its best
    generation has no free GPU for it (it waits for a running job to end).  So a job that runs 4x
    slower on a K80 waits for a busy V100 (floor 1/2) unless the backlog is deep; one that loses 20%
    takes the K80; with a V100 free the K80 is refused (floor 1).  ``min_speed`` fixes the floor
    instead (0: the estimate's).

    ``ahead``: count only the work queued ahead of this job in the order (``Context.ahead_gpus``,
    which the passes set while they place it) instead of every waiting job's.  A job waits behind
    the jobs ranked before it, not behind those after it: the head of the queue (under 2D-Gittins a
    newcomer, whose wait for its best generation is short) waits for it, and a job far back takes a
    slower generation now.  Counting the whole backlog gave the head the slow GPUs and left the jobs
    behind it waiting.  Where the passes do not say (``ahead_gpus`` None) every waiting job counts.
    Twins (one job class) are judged by the first of them a pass tries: the core does not try a
    twin again in a pass once one was refused (its equivalence classes), so they wait together."""

    def __init__(self, min_speed: float = 0.0, ahead: bool = False) -> None:
        if not 0 <= min_speed <= 1:
            raise ValueError("min_speed must be in [0, 1]")
        self.ahead = bool(ahead)
        self.min_speed = float(min_speed)
        self._seen: tuple = ()
        self._backlog = 0.0
        self._free: dict[str, int] = {}

    def _look(self, ctx: Context) -> None:
        key = (ctx.now, len(ctx.waiting or ()), len(ctx.running or ()), ctx.free_gpus, len(ctx.nodes))
        if key != self._seen:
            self._free = {}
            for ns in ctx.nodes.values():
                if ns.alive and ns.node.gpu_type:
                    self._free[ns.node.gpu_type] = max(self._free.get(ns.node.gpu_type, 0), ns.free_gpus)
            self._backlog = sum(r.job.gpus for r in (ctx.waiting or {}).values()) / max(1, ctx.total_gpus)
            self._seen = key

    def filter(self, rec: JobRecord, cand: Candidate, ctx: Context) -> str | None:
        t = cand.node.node.gpu_type
        v = ctx.predictors.type_speed(rec.job, t) if t else None
        if v is None:
            return None
        self._look(ctx)
        speeds = {u: x for u in self._free if (x := ctx.predictors.type_speed(rec.job, u)) is not None}
        best_type = max(speeds, key=lambda u: (speeds[u], u), default=t)
        best = speeds.get(best_type, v)
        if self.min_speed:
            floor = self.min_speed
        else:  # a node of its best type with room for it (or the gang spans several: assume none)
            busy = self._free.get(best_type, 0) < rec.job.gpus
            backlog = self._backlog
            if self.ahead and ctx.ahead_gpus is not None:
                backlog = ctx.ahead_gpus / max(1, ctx.total_gpus)
            floor = 1.0 / (1.0 + backlog + (1.0 if busy else 0.0))
        if v < floor * best - 1e-12:
            return f"runs at {v / best:.2f} of its speed on its best GPU type here; waiting is quicker (< {floor:.2f})"
        return None
