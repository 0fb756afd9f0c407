"""The plugin framework (after the Kubernetes scheduling framework).

Four extension points, one small interface each:

* :class:`QueueSort` ("order", a base class: its hooks have defaults):
  ``key(record, ctx)``; lower keys run first.  ``preemptive`` sorts decide
  every pass which jobs *should* run and preempt the rest; non-preemptive ones
  only start queued jobs.  ``next_change`` lets the core ask for a
  :class:`~scheduler.events.Wakeup` when a job's key will move (a queue
  boundary, a quantum); ``observe_finished`` hears of every job that finished.
* :class:`Filter`: ``filter(record, candidate, ctx) -> None | reason``.
* :class:`Score`: ``score(record, candidate, ctx) -> float`` (raw, higher is
  better).  The core min-max normalises each plugin's scores over the feasible
  candidates to 0-100 and adds them with the profile's weights.
* :class:`Allocator` ("allocate"): splits a node's CPU cores and host memory
  between the jobs on it.

A :class:`Candidate` is one way to place a job: a set of GPUs on one node (or
whole nodes for a job larger than a node), with the jobs already resident on
them when the placement shares GPUs.

Plugins are registered by name with :func:`register`; a profile
(:mod:`scheduler.profile`) names the ones it uses, with arguments, and
:mod:`scheduler.plugins` (the built-ins and the catalogue, ``build``/``available``)
builds them.  This module imports no plugin: plugins import it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from scheduler.model import Allocation, JobRecord, Node

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.predictors import Predictors


@dataclass
class NodeState:
    """The core's live view of one node."""

    node: Node
    residents: list[list[str]]  # per GPU: ids of the jobs on it
    free_gpus: int
    alive: bool = True
    gpu_util: tuple[float, ...] = ()
    cpu_percent: float | None = None
    memory_available_bytes: int | None = None
    jobs: dict[str, int] = field(default_factory=dict)  # job -> GPUs it holds here
    demand_cpus: float = 0.0  # the allocator's minimum demands of the jobs here (kept by the core)
    demand_memory: float = 0.0
    reserved_cpus: float = 0.0  # held by CPU-only jobs here, at their requests (kept by the core)
    reserved_memory: int = 0

    def free_indices(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.residents) if not r)

    @classmethod
    def fresh(cls, node: Node) -> "NodeState":
        return cls(node=node, residents=[[] for _ in range(node.gpus)], free_gpus=node.gpus)


@dataclass(frozen=True)
class Candidate:
    """One way to place a job: ``gpus`` on ``node`` (plus ``more`` shards for
    jobs that span nodes); ``residents`` are the jobs already on those GPUs.
    For an exclusive single-node candidate ``gpus`` is empty while plugins
    filter and score it (any free GPUs of the node will do); the core picks the
    indices once the node has won."""

    node: NodeState
    gpus: tuple[int, ...]
    residents: tuple[str, ...] = ()
    more: tuple[tuple[NodeState, tuple[int, ...]], ...] = ()

    @property
    def shared(self) -> bool:
        return bool(self.residents)


def _no_share_clock(gpus: int) -> float:
    return 0.0


@dataclass
class Context:
    """What plugins may read while the core decides.  Read-only by convention."""

    now: float
    records: dict[str, JobRecord]
    nodes: dict[str, NodeState]
    predictors: "Predictors"
    rng: random.Random
    total_gpus: int = 0
    free_gpus: int = 0
    pool: Any = None  # the donors' lent memory (scheduler.donors.DonorPool); None outside the core
    # What each owner may still borrow (scheduler.fairshare.LentLimits); None: no lent-memory quota.
    quota: Any = None
    # The equal-share clocks now (scheduler.ledger.ShareClock): share_clock(g) is the seconds of run
    # time a max-min fair split of the cluster's GPUs has given a job asking for g GPUs since the core
    # started.  Outside the core: no clock (always 0).
    share_clock: Callable[[int], float] = _no_share_clock
    running: dict[str, JobRecord] | None = None  # the running jobs (None outside the core)
    waiting: dict[str, JobRecord] | None = None  # queued or preempted jobs
    # While a pass places a waiting job: the GPUs the waiting jobs ranked ahead of it ask for (the
    # work it queues behind); None: not known (every waiting job counts).
    ahead_gpus: int | None = None


class QueueSort:
    """Base class of the order plugins: every hook the core calls is declared here, with its default.

    ``preemptive``: decide every pass which jobs should hold the GPUs (and preempt the rest).
    ``uniform_wakeup``: every running job's key changes at the same moment (one quantum), so
    the core asks one running job for :meth:`next_change` instead of all of them.
    """

    name: ClassVar[str]
    preemptive: ClassVar[bool] = False
    uniform_wakeup: ClassVar[bool] = False

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        """The job's sort key now: lower keys run first."""
        raise NotImplementedError

    def next_change(self, rec: JobRecord, ctx: Context) -> float | None:
        """When the running job's key may next change (None: never)."""
        return None

    def observe_finished(self, rec: JobRecord, ctx: Context) -> None:
        """A job finished (done, not failed): policies that learn from run times update here."""


class Filter(Protocol):
    name: ClassVar[str]

    def filter(self, rec: JobRecord, cand: Candidate, ctx: Context) -> str | None: ...


class Score(Protocol):
    name: ClassVar[str]

    def score(self, rec: JobRecord, cand: Candidate, ctx: Context) -> float: ...


class Allocator(Protocol):
    """``demand_by_shape``: ``demand`` of a job not yet on the node depends only on the node's
    resources and what its CPU-only jobs hold (not on which node it is), so the core may compute
    it once per node shape while it weighs many nodes."""

    name: ClassVar[str]
    demand_by_shape: ClassVar[bool]

    def demand(self, rec: JobRecord, node: NodeState, gpus_here: int, ctx: Context) -> Allocation:
        """The least this job needs on ``node`` to run (used to filter)."""
        ...

    def split(self, node: NodeState, ctx: Context) -> dict[str, Allocation]:
        """CPU cores and host memory for every job on ``node``."""
        ...


KINDS = ("order", "filter", "score", "allocate")
_REGISTRY: dict[str, dict[str, type]] = {k: {} for k in KINDS}


def register(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: make plugin ``name`` of ``kind`` available to profiles.
    Order plugins subclass :class:`QueueSort` (it declares the hooks the core calls)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown plugin kind {kind!r}")

    def deco(cls: type) -> type:
        if kind == "order" and not issubclass(cls, QueueSort):
            raise TypeError(f"order plugin {name!r}: {cls.__name__} must subclass scheduler.framework.QueueSort")
        cls.name = name
        _REGISTRY[kind][name] = cls
        return cls

    return deco


def registered(kind: str) -> dict[str, type]:
    """The plugin classes registered so far for ``kind`` (name -> class; a copy)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown plugin kind {kind!r}")
    return dict(_REGISTRY[kind])
