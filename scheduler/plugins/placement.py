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
