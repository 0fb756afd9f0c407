"""What a simulated cluster is and how fast jobs really run on it: the simulator's ground truth.

:class:`Cluster` is the cluster ``dlshare sim --cluster`` describes (groups of identical servers,
each of a GPU generation or untyped); :class:`GroundTruth` is how fast a job runs there: alone at
1 isolated-second per second on the reference generation (the trace's durations are V100 times) and
at its measured throughput ratio on another (Gavel's per-type throughputs), two jobs on one GPU at
Gavel's measured pair throughputs, and with the CPU cores and memory it was given at its Synergy
profile's speed (lent memory at its measured efficiency).  :mod:`scheduler.sim` drives the core
against it.  Pure: no I/O (the tables are handed in).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from scheduler.model import Job, Node
from scheduler.trace import gavel_type

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` identical servers of ``gpus`` GPUs of generation ``gpu_type`` ("" untyped),
    ``cores`` cores and ``memory_gb`` GB; ``more``: further groups of servers (a cluster of
    several GPU generations)."""

    nodes: int
    gpus: int
    cores: int
    memory_gb: float
    gpu_type: str = ""
    more: tuple["Cluster", ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Cluster":
        """``NxG`` or ``NxG:CORES:MEMGB``, each optionally ``@TYPE`` (a GPU generation: ``v100``,
        ``p100``, ``k80``, ...), several groups separated by commas:
        ``6x4@v100,6x4@p100,6x4@k80``.  Without cores/memory, each GPU gets
        3 cores and 62.5 GB, the per-GPU share of Synergy's 8-GPU, 24-core,
        500 GB servers."""
        groups = [g.strip() for g in str(text).split(",")]
        if len(groups) > 64 or not all(groups):
            raise ValueError(f"cluster {text!r}: at most 64 comma-separated groups NODESxGPUS[:CORES:MEMGB][@TYPE]")
        first, *rest = (cls._group(g, text) for g in groups)
        if sum(g.nodes for g in (first, *rest)) > 100_000:
            raise ValueError(f"cluster {text!r}: at most 100000 nodes of 64 GPUs, 4096 cores and 65536 GB each")
        return dataclasses.replace(first, more=tuple(rest)) if rest else first

    @classmethod
    def _group(cls, part: str, text: str) -> "Cluster":
        body, _, gtype = part.partition("@")
        gtype = gtype.strip().lower()
        if len(gtype) > 64 or (gtype and not re.fullmatch(r"[a-z0-9_-]+", gtype)):
            raise ValueError(f"cluster {text!r}: GPU type {gtype!r} must be letters and digits")
        try:
            shape, *rest = body.lower().split(":")
            n, g = (int(x) for x in shape.split("x"))
            cores = int(rest[0]) if rest else 3 * g
            mem = float(rest[1]) if len(rest) > 1 else 62.5 * g
        except (ValueError, IndexError):
            raise ValueError(f"cluster {text!r}: expected NODESxGPUS or NODESxGPUS:CORES:MEMGB (then @TYPE), "
                             "comma-separated") from None
        if n < 1 or g < 1 or cores < 1 or mem <= 0 or len(rest) > 2:
            raise ValueError(f"cluster {text!r}: sizes must be positive")
        # Finite bounds: 1e400 GB or 10**8 nodes is a typo, not a cluster to build in memory.
        if n > 100_000 or g > 64 or cores > 4096 or not mem <= 65536:
            raise ValueError(f"cluster {text!r}: at most 100000 nodes of 64 GPUs, 4096 cores and 65536 GB each")
        return cls(n, g, cores, mem, gtype)

    @property
    def groups(self) -> tuple["Cluster", ...]:
        return (dataclasses.replace(self, more=()), *self.more)

    @property
    def total_gpus(self) -> int:
        return sum(c.nodes * c.gpus for c in self.groups)

    @property
    def total_cores(self) -> int:
        return sum(c.nodes * c.cores for c in self.groups)

    @property
    def total_memory_gb(self) -> float:
        return sum(c.nodes * c.memory_gb for c in self.groups)

    def make_nodes(self) -> list[Node]:
        out: list[Node] = []
        for c in self.groups:
            out += [Node(f"n{len(out) + i:05d}", c.gpus, c.cores, int(c.memory_gb * GB), gpu_type=c.gpu_type)
                    for i in range(c.nodes)]
        return out

    def __str__(self) -> str:
        return ",".join(f"{c.nodes}x{c.gpus}" + (f"@{c.gpu_type}" if c.gpu_type else "") for c in self.groups)


class GroundTruth:
    """How fast jobs really run (see the module docstring).  ``by_type``: Gavel's table for every
    GPU generation (``{"v100": ..., "k80": ...}``); a job on a typed node runs at its throughput
    there over its throughput on ``reference`` (the generation the trace's durations are for), and
    a pair sharing a GPU at that generation's pair throughputs.  Without it (or on an untyped node)
    every GPU is ``reference``'s."""

    def __init__(self, throughputs: dict[str, Any] | None, sensitivity: Any | None, solo: Any | None = None,
                 by_type: dict[str, Any] | None = None, reference: str = "v100") -> None:
        self.thr = throughputs or {}
        self.sens = sensitivity
        self.solo = solo  # GavelSoloProfiles: what a node reports for a job alone
        self.by_type = {k.lower(): v for k, v in (by_type or {}).items() if "unconsolidated" not in k}
        self.reference = reference
        self._pair: dict[tuple[str, str, str], tuple[float, float] | None] = {}
        self._factor: dict[tuple[str, str], float] = {}

    def solo_telemetry(self, job: Job) -> Any:
        return self.solo.profile(job.model, job.batch_size) if self.solo is not None else None

    def key(self, job: Job) -> str:
        return str((gavel_type(job.model, job.batch_size), job.gpus))

    def type_factor(self, job: Job, gpu_type: str) -> float:
        """``job``'s speed alone on ``gpu_type`` over its speed on the reference (1 when either is
        not measured, or the node is untyped)."""
        if not gpu_type or gpu_type == self.reference or not self.by_type:
            return 1.0
        k = (self.key(job), gpu_type)
        f = self._factor.get(k)
        if f is None:
            ref = self.by_type.get(self.reference, {}).get(k[0], {}).get("null")
            here = self.by_type.get(gpu_type, {}).get(k[0], {}).get("null")
            f = self._factor[k] = here / ref if ref and here else 1.0
        return f

    def pair(self, a: Job, b: Job, gpu_type: str = "") -> tuple[float, float] | None:
        """Normalised speeds of ``a`` and ``b`` on one GPU (of ``gpu_type``: each against its own
        speed alone there); ``None`` when they do not fit together."""
        ka, kb = self.key(a), self.key(b)
        thr = self.by_type.get(gpu_type, self.thr) if gpu_type else self.thr
        k = (ka, kb, gpu_type if gpu_type in self.by_type else "")
        if k not in self._pair:
            ta, tb = thr.get(ka), thr.get(kb)
            if ta is None or tb is None or kb not in ta:
                self._pair[k] = (0.5, 0.5)  # never measured: plain time-slicing
            else:
                x, y = ta[kb]
                self._pair[k] = None if x <= 0 or y <= 0 else (x / ta["null"], y / tb["null"])
        return self._pair[k]

    def resource_factor(self, job: Job, cpus: float, memory_bytes: float, remote_bytes: float = 0.0,
                        supply: float | None = None) -> float:
        """The job's profiled speed for its cores and memory; lent bytes count at the efficiency
        their read rate ``supply`` gives (scheduler/remote_memory.py)."""
        if self.sens is None or job.cpu_only or not self.sens.knows(job.model, job.gpus) or cpus <= 0:
            return 1.0
        if remote_bytes > 0 and supply is not None:
            from scheduler import remote_memory as rm

            target = self.sens.speed(job.model, job.gpus, cpus, memory_bytes + remote_bytes)
            demand = rm.remote_demand(rm.input_rate(self.sens, job.model, job.gpus, target), memory_bytes,
                                      remote_bytes)
            memory_bytes = rm.effective_memory(memory_bytes, remote_bytes, rm.efficiency(demand, supply))
        return self.sens.speed(job.model, job.gpus, cpus, memory_bytes)


__all__ = ["Cluster", "GroundTruth"]
