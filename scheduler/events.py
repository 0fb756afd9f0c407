"""Events the scheduler core consumes and decisions it returns.

The project's one event convention (every core follows it): each event is a
frozen dataclass whose first fields are ``stimulus_id`` (unique, chosen by the
sender: a replay of the same events reproduces the same decisions) and ``now``
(seconds on the sender's clock; the core never reads a clock).  Every decision
carries the ``stimulus_id`` of the event that produced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.model import Job, JobState, Node, Shard

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Event:
    stimulus_id: str
    now: float


@dataclass(frozen=True)
class JobArrived(Event):
    """A job was submitted.  The core copies ``job`` and owns the copy."""

    job: Job


@dataclass(frozen=True)
class JobFinished(Event):
    """A job's processes exited: ``failed`` when the exit was abnormal.  ``node``: where it
    exited (refused when the job no longer runs there; empty: wherever it runs)."""

    job: str
    failed: bool = False
    reason: str = ""
    node: str = ""


@dataclass(frozen=True)
class JobCancelled(Event):
    """The user withdrew a job (queued or running).  It ends as failed."""

    job: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class PlacementFailed(Event):
    """A placement could not be carried out (device out of memory at start,
    node refused).  The job is requeued; when it was co-located, that pairing
    of job types is remembered as incompatible.  ``place_id`` (on this event and on
    :class:`JobStarted`): the ``stimulus_id`` of the :class:`Place` it answers; the core
    refuses an answer to an older placement of the job (empty: the current one)."""

    job: str
    reason: str = ""
    place_id: str = ""


@dataclass(frozen=True)
class JobStarted(Event):
    """``node`` confirmed it started its part of a placed job (it answered the ``run``).
    From then on, a job that ``node``'s reports stop listing is watched for vanishing."""

    job: str
    node: str
    place_id: str = ""


@dataclass(frozen=True)
class JobBound(Event):
    """Another engine runs ``job`` on ``node`` (Kubernetes: kube-scheduler bound the pod there
    after asking the extender).  The core accounts for its GPUs (``gpus``, or free ones it
    picks), cores and memory, but never starts or stops it.  With ``hold_s`` the hold ends
    that long after (by then the node's own figures show the pod's use)."""

    job: Job
    node: str
    gpus: tuple[int, ...] = ()
    hold_s: float | None = None


@dataclass(frozen=True)
class Tick(Event):
    """Time passed: preemptive policies re-evaluate (also the answer to a :class:`Wakeup`)."""


@dataclass(frozen=True)
class JobSample:
    """One job's measured figures on a node: SM and memory-bandwidth utilisation
    (percent, of the devices it uses) and its normalised speed (throughput now /
    throughput alone; ``None`` when unknown)."""

    sm_percent: float | None = None
    mem_percent: float | None = None
    speed: float | None = None


Payload = JobSample  # a value events carry, not an event (tests/core_conventions.py)


@dataclass(frozen=True)
class NodeReport(Event):
    """A node's resources and telemetry.  The first report registers the node;
    later ones update its resources (e.g. lendable memory) and feed the online
    predictors.  ``gpu_util`` is per-device utilisation in percent,
    ``jobs`` maps job id -> :class:`JobSample`.  ``running`` lists the jobs the node
    says it runs (``None``: the report does not say); a started job missing from it is
    watched for vanishing (see :class:`scheduler.watch.WatchRules`)."""

    node: Node
    gpu_util: tuple[float, ...] = ()
    cpu_percent: float | None = None
    memory_available_bytes: int | None = None
    jobs: Mapping[str, JobSample] = field(default_factory=dict)
    running: tuple[str, ...] | None = None


@dataclass(frozen=True)
class NodeLost(Event):
    """A node went away (Last Will, missed telemetry).  Its jobs are requeued; when it was a
    donor, the memory it lent is taken back from the jobs that borrowed it (they keep running)."""

    node: str


@dataclass(frozen=True)
class DonorReclaimed(Event):
    """Donor ``node`` took ``bytes`` of its lendable memory back (its own jobs need it): what it
    lends drops by that much, and promises beyond what is left are taken back from the jobs that
    borrowed them, newest first.  They keep running on what they have left (see
    :mod:`scheduler.remote_memory`); none is stopped for it."""

    node: str
    bytes: int


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decision:
    stimulus_id: str  # of the event that caused it


@dataclass(frozen=True)
class Place(Decision):
    """Start (or resume, after a preemption) ``job`` on ``shards``.
    ``colocated_with`` lists jobs already on any of those GPUs."""

    job: str
    shards: tuple[Shard, ...]
    colocated_with: tuple[str, ...] = ()
    resumed: bool = False

    @property
    def node(self) -> str:
        """The (first) node: most jobs fit on one."""
        return self.shards[0].node

    @property
    def gpus(self) -> tuple[int, ...]:
        """GPU indices on :attr:`node`."""
        return self.shards[0].gpus


@dataclass(frozen=True)
class Preempt(Decision):
    """Stop ``job`` (checkpoint and exit) on ``nodes``; it goes back to the queue as preempted."""

    job: str
    reason: str = ""
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Allocate(Decision):
    """Give ``job`` ``cpus`` cores and ``memory_bytes`` host memory on ``node``, plus
    ``remote_memory_bytes`` lent by donors (sent after a placement and whenever the node's split
    or the job's lent memory changes)."""

    job: str
    node: str
    cpus: float
    memory_bytes: int
    remote_memory_bytes: int = 0


@dataclass(frozen=True)
class Reject(Decision):
    """``job`` can never run here (e.g. more GPUs than the cluster has); it is failed."""

    job: str
    reason: str


@dataclass(frozen=True)
class Release(Decision):
    """``job`` left ``nodes``: stop what is left of it there (``stop``; not after it exited)
    and free what they hold for it.  It is now ``state``: preempted (waiting again, after its
    node was lost or its start failed), done or failed (it ended, was cancelled, vanished),
    or unchanged (queued or running elsewhere) when a node ran it where it was not placed.
    A preemption is a :class:`Preempt` instead."""

    job: str
    nodes: tuple[str, ...]
    state: JobState
    reason: str = ""
    stop: bool = True


@dataclass(frozen=True)
class Wakeup(Decision):
    """The core wants a :class:`Tick` at ``at`` (a queue boundary, a quantum end)."""

    at: float
