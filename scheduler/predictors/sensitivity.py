"""CPU/memory sensitivity: a job's speed as a function of the cores and host
memory it gets (Synergy, OSDI'22; tables from synergy/sensitivity.json).

Speeds are normalised so that the GPU-proportional share of Synergy's servers
(3 cores and 62.5 GB per GPU on 8-GPU, 24-core, 500 GB machines) is 1.0.
Allocations between the profiled levels take the level below (a step function,
as the tables are).  ``add_profile`` takes a measured table in the same shape.
"""

from __future__ import annotations

import bisect
from typing import Any

from scheduler.model import GiB

GB = 1e9


class SensitivityModel:
    def __init__(self, cpu_levels: list[float], mem_levels_gb: list[float], profiles: dict[str, Any]) -> None:
        self.cpu_levels = [float(c) for c in cpu_levels]
        self.mem_levels = [float(m) for m in mem_levels_gb]
        self.tables: dict[tuple[str, int], list[list[float]]] = {}
        self._fair: dict[tuple[str, int, float, float], tuple[float, float]] = {}
        self._meta: dict[tuple[str, int], dict[str, float]] = {}
        for key, p in profiles.items():
            self.add_profile(p["model"], int(p["num_gpus"]), p["throughput"])
            if p.get("batch_size") and p.get("iter_time_s"):
                self._meta[(p["model"], int(p["num_gpus"]))] = {"batch_size": float(p["batch_size"]),
                                                               "iter_time_s": float(p["iter_time_s"])}

    @classmethod
    def from_data(cls) -> "SensitivityModel":
        from scheduler import data

        d = data.synergy_sensitivity()
        return cls(d["cpu_levels"], d["mem_levels_gb"], d["models"])

    def add_profile(self, model: str, gpus: int, throughput: list[list[float]]) -> None:
        """Add or replace a measured table: ``throughput[cpu level][mem level]``."""
        if not throughput or not all(isinstance(r, list) and r for r in throughput):
            raise ValueError(f"sensitivity table for {model}/{gpus} must be a non-empty 2-D list")
        self.tables[(model, gpus)] = [[float(v) for v in r] for r in throughput]
        self._fair = {}

    def meta(self, model: str, gpus: int) -> dict[str, float] | None:
        """The profile's batch size and iteration time (the job's input data rate), when known."""
        return self._meta.get((model, gpus)) or self._meta.get((model, 1))

    def levels_bytes(self, gpus: int) -> list[float]:
        """The profiled memory levels for a job of ``gpus`` GPUs, in bytes."""
        return [m * GB * max(1, gpus) for m in self.mem_levels]

    def knows(self, model: str, gpus: int) -> bool:
        return (model, gpus) in self.tables or (model, 1) in self.tables

    def _table(self, model: str, gpus: int) -> list[list[float]]:
        return self.tables.get((model, gpus)) or self.tables[(model, 1)]

    def speed(self, model: str, gpus: int, cpus: float, memory_bytes: float) -> float:
        """Throughput at ``cpus`` cores and ``memory_bytes`` for the whole job, relative to proportional."""
        t = self._table(model, gpus)
        per_c = cpus / gpus
        per_m = memory_bytes / gpus / GB
        i = bisect.bisect_right(self.cpu_levels, per_c + 1e-9) - 1
        j = bisect.bisect_right(self.mem_levels, per_m + 1e-6) - 1
        if i < 0 or j < 0:
            return 0.05  # below the smallest profiled allocation: barely runs
        best = 0.0
        for ii in range(min(i, len(t) - 1), -1, -1):
            row = t[ii]
            v = row[min(j, len(row) - 1)]
            if v > 0:
                best = v
                break
        return best if best > 0 else 0.05

    def fair_minimum(self, model: str, gpus: int, prop_cpus: float, prop_mem: float) -> tuple[float, float]:
        """The smallest (cores, memory bytes) whose speed is at least the proportional share's."""
        key = (model, gpus, round(prop_cpus, 6), round(prop_mem))
        hit = self._fair.get(key)
        if hit is None:
            hit = self._fair[key] = self._fair_minimum(model, gpus, prop_cpus, prop_mem)
        return hit

    def _fair_minimum(self, model: str, gpus: int, prop_cpus: float, prop_mem: float) -> tuple[float, float]:
        target = self.speed(model, gpus, prop_cpus, prop_mem)
        best = (prop_cpus, prop_mem)
        best_cost = 2.0
        for c in self.cpu_levels:
            for m in self.mem_levels:
                cc, mm = c * gpus, m * GB * gpus
                if cc > prop_cpus * 4 or mm > prop_mem * 4:
                    continue
                if self.speed(model, gpus, cc, mm) + 1e-9 >= target:
                    cost = cc / max(prop_cpus, 1e-9) + mm / max(prop_mem, 1.0)
                    if cost < best_cost - 1e-9:
                        best, best_cost = (cc, mm), cost
        return best


__all__ = ["SensitivityModel", "GiB"]
