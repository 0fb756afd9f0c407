"""The seam between the service shell and the scheduler core.

The shell (live loop, HTTP API, Kubernetes extender) speaks only to a
:class:`PlacementEngine`: it hands in the queue and the nodes as it sees them
and gets back placements, preemptions, filter verdicts and scores.  The engine
that ships wraps the pure scheduler core (``scheduler.SchedulerState`` with its
policy plugins and profiles), so the service runs the very plugins the
simulator runs.  Nothing in this module decides policy itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class GpuState:
    index: int
    name: str = ""
    util_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


@dataclass
class NodeState:
    """What the shell knows of one node: its last telemetry plus our own allocations."""

    id: str
    status: str = "unknown"  # online | offline | unknown
    last_seen: float | None = None
    cpu_count: int = 0
    cpu_percent: float | None = None
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    reserved_unused_bytes: int = 0
    promised_bytes: int = 0
    lendable_bytes: int = 0
    lent_bytes: int = 0
    gpus: list[GpuState] = field(default_factory=list)
    gpu_reason: str | None = None
    job_usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    # job id -> {"gpus": [...], "cpus": float, "memory_bytes": int, "cpuset": str | None}
    allocations: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def cpus_allocated(self) -> float:
        return float(sum(a["cpus"] for a in self.allocations.values()))

    @property
    def memory_allocated_bytes(self) -> int:
        return int(sum(a["memory_bytes"] for a in self.allocations.values()))

    def gpu_jobs(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {g.index: [] for g in self.gpus}
        for job, a in self.allocations.items():
            for g in a.get("gpus", []):
                out.setdefault(g, []).append(job)
        return out


@dataclass(frozen=True)
class Placement:
    """Start ``job`` on ``node`` with this allocation."""

    job: str
    node: str
    gpus: tuple[int, ...]
    cpus: float
    memory_bytes: int
    cpuset: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Preemption:
    job: str
    reason: str = ""


Decision = Placement | Preemption


class PlacementEngine(Protocol):
    """What the service needs from a scheduler core."""

    profile: str

    def decide(self, queued: list[dict[str, Any]], running: list[dict[str, Any]], nodes: list[NodeState],
               now: float) -> list[Decision]:
        """One scheduling round.  ``queued``/``running`` are job dicts (``id``, ``spec``,
        ``attained_service``, ``submitted_at``, ``allocation``)."""
        ...

    def filter(self, job: dict[str, Any], nodes: list[NodeState]) -> tuple[list[str], dict[str, str]]:
        """Nodes that can host ``job``, and a reason for each that cannot."""
        ...

    def score(self, job: dict[str, Any], nodes: list[NodeState]) -> dict[str, float]:
        """A score in [0, 1] per feasible node (1 = best)."""
        ...

    def observe(self, node: NodeState, now: float) -> None:
        """Measured utilisation of a node's jobs, for the predictors' online update."""
        ...
