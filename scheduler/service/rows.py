"""The scheduler service's records as its store keeps them and its API shows them: jobs, their
allocations, owners and admission limits, and the decisions sent to nodes.  Plain data, no SQL
(:mod:`scheduler.service.store` reads and writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class JobAllocation:
    """Where a job runs and what it was given there, as the jobs table stores it (and the API
    shows it): the first shard's ``node`` and ``gpus``, its cores and memory, every shard of a
    job spread over nodes, and the jobs it shares GPUs with."""

    node: str
    gpus: tuple[int, ...] = ()
    cpus: float = 0.0
    memory_bytes: int = 0
    shards: tuple[tuple[str, tuple[int, ...]], ...] = ()
    colocated_with: tuple[str, ...] = ()
    requested_cpus: float = 0.0
    requested_memory_bytes: int = 0
    cpuset: str | None = None
    remote_memory_bytes: int = 0  # lent by donors (the core's promise)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.node, *(n for n, _ in self.shards)]))

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "gpus": list(self.gpus), "cpus": self.cpus, "memory_bytes": self.memory_bytes,
                "shards": [{"node": n, "gpus": list(g)} for n, g in self.shards],
                "colocated_with": list(self.colocated_with), "requested_cpus": self.requested_cpus,
                "requested_memory_bytes": self.requested_memory_bytes, "cpuset": self.cpuset,
                "remote_memory_bytes": self.remote_memory_bytes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobAllocation":
        shards = tuple((str(s["node"]), tuple(int(g) for g in s.get("gpus") or ())) for s in d.get("shards") or ())
        return cls(node=str(d["node"]), gpus=tuple(int(g) for g in d.get("gpus") or ()),
                   cpus=float(d.get("cpus") or 0.0), memory_bytes=int(d.get("memory_bytes") or 0), shards=shards,
                   colocated_with=tuple(d.get("colocated_with") or ()),
                   requested_cpus=float(d.get("requested_cpus") or 0.0),
                   requested_memory_bytes=int(d.get("requested_memory_bytes") or 0), cpuset=d.get("cpuset"),
                   remote_memory_bytes=int(d.get("remote_memory_bytes") or 0))


@dataclass
class JobRow:
    """One job as stored; ``spec`` is the submitted dict, ``allocation`` a :class:`JobAllocation`."""

    id: str
    spec: dict[str, Any]
    state: str
    submitted_at: float
    seq: int = 0
    reason: str | None = None
    allocation: JobAllocation | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    attained_service: float = 0.0
    attempts: int = 0
    updated_at: float = 0.0
    user: str = ""
    account: str = ""

    @property
    def gpus(self) -> int:
        return int(self.spec.get("gpus") or 0)

    def as_api(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in (
            "id", "spec", "state", "reason", "submitted_at", "started_at",
            "finished_at", "exit_code", "attained_service", "attempts", "user", "account")}
        out["allocation"] = self.allocation.to_json() if self.allocation is not None else None
        return out


@dataclass
class DecisionRow:
    id: str
    kind: str
    job: str | None
    node: str | None
    data: dict[str, Any] = field(default_factory=dict)  # the decision itself (scheduler.codec form)
    state: str = "pending"  # pending (to carry out), acked, failed, done (nothing to send)
    ts: float = 0.0
    reply: dict[str, Any] | None = None
    batch: int | None = None


class ConflictError(ValueError):
    """A job id that exists with a different spec (or another owner)."""


class QuotaError(ValueError):
    """A submission over its owner's admission limit (jobs waiting per user or account)."""


@dataclass(frozen=True)
class Owner:
    """Who a job belongs to: the user it runs as on the nodes, and the account its usage counts to."""

    user: str = ""
    account: str = ""


@dataclass(frozen=True)
class WaitingLimits:
    """Admission limits: the most jobs waiting (queued or preempted) per user and per account
    (0: no limit)."""

    per_user: int = 0
    per_account: int = 0
