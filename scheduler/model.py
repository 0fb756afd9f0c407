"""The scheduler's domain model: jobs, nodes and where a job runs.

Everything here is plain data.  :class:`Job` and :class:`Node` are what a
launcher submits and what a node daemon reports; the scheduler core
(:mod:`scheduler.state`) owns the live copies and changes them only while it
handles an event.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30
MAX_OWNER = 256  # characters in a user or account name
MAX_GPU_TYPE = 64  # characters in a GPU type name

# Words in NVML device names and Kubernetes GPU labels that do not name the GPU's generation.
_GPU_NOISE = {"tesla", "nvidia", "geforce", "quadro", "simulated", "gpu", "sxm", "sxm2", "sxm4", "sxm5", "pcie",
              "nvl", "hbm", "hbm2", "hbm2e", "hbm3", "mig", "max", "q", "ti", "super"}


def gpu_type_of(name: str) -> str:
    """The GPU generation a device name or label names, lower case: ``"Tesla V100-SXM2-32GB"``,
    ``"NVIDIA-A100-SXM4-40GB"`` (NVIDIA GPU Feature Discovery's ``nvidia.com/gpu.product`` label)
    and ``"v100"`` all give ``"v100"``; ``"GeForce RTX 3090"`` gives ``"rtx3090"``; "" when the
    name says nothing (no word with a model number)."""
    words = [w for w in re.split(r"[^a-z0-9]+", str(name).lower()[:200]) if w]
    for i, w in enumerate(words):
        if w in _GPU_NOISE or re.fullmatch(r"\d+(gb|g|mb)", w) or not re.search(r"\d", w):
            continue
        if w.isdigit():  # "RTX 3090", "GTX 1080": the family word before the number names it
            prev = words[i - 1] if i else ""
            if prev in ("rtx", "gtx", "titan"):
                return (prev + w)[:MAX_GPU_TYPE]
            continue
        return w[:MAX_GPU_TYPE]
    return ""


class JobState(str, enum.Enum):
    """Life cycle: queued -> running <-> preempted -> done | failed."""

    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"
    DONE = "done"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self in (JobState.QUEUED, JobState.RUNNING, JobState.PREEMPTED)


@dataclass
class Job:
    """A training job as the scheduler sees it.

    ``id``, ``model``, ``batch_size``, ``gpus`` identify the work; ``cpus`` and
    ``memory_bytes`` are what the launcher asked for (0 means "decide for me":
    the allocation plugin picks).  A job with ``gpus = 0`` is CPU-only (data
    preparation): it must ask for its cores (``cpus > 0``), and it is given
    exactly what it asked for.  ``arrival`` is in seconds on the caller's
    clock.  ``attained_service`` is GPU-seconds received so far (Tiresias's
    service measure); the core keeps it.  ``duration`` is the isolated run time
    in seconds: only an oracle policy (SRTF) reads it, and it is ``None`` in
    production.  ``features`` holds computation-graph features
    (:class:`scheduler.predictors.utilisation.GraphFeatures` as a dict) when the
    launcher extracted them.  ``gpu_memory_bytes`` is the per-GPU footprint when
    known (0 = unknown).  ``remote_memory_bytes`` is the least memory lent by donors the job must
    have (0: it takes what the allocation plugin gives it); only a lent-memory allocator (``lent``)
    grants it.  ``user`` and ``account`` name the job's owner (set by the service from the
    authenticated caller): fair share and quotas (:mod:`scheduler.fairshare`) count per user and per
    account.  An empty ``user`` is the one anonymous user; an empty ``account``, no account.
    """

    id: str
    model: str
    batch_size: int = 0
    gpus: int = 1
    cpus: float = 0.0
    memory_bytes: int = 0
    priority: int = 0
    arrival: float = 0.0
    attained_service: float = 0.0
    state: JobState = JobState.QUEUED
    duration: float | None = None
    features: dict[str, float] | None = None
    gpu_memory_bytes: int = 0
    batch_sizes: tuple[int, ...] = ()
    remote_memory_bytes: int = 0
    user: str = ""
    account: str = ""

    def __post_init__(self) -> None:
        for name in ("user", "account"):
            v = getattr(self, name)
            if v is None:
                setattr(self, name, "")
            elif not isinstance(v, str) or len(v) > MAX_OWNER:
                raise ValueError(f"job {self.id}: {name} must be a string of at most {MAX_OWNER} characters, "
                                 f"got {v!r}")
        self.batch_sizes = tuple(int(b) for b in (self.batch_sizes or ()))
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"job {self.id}: batch_sizes must be >= 1")
        if not self.id:
            raise ValueError("job id must not be empty")
        if self.gpus < 0:
            raise ValueError(f"job {self.id}: gpus must be >= 0, got {self.gpus}")
        if self.cpus < 0 or self.memory_bytes < 0:
            raise ValueError(f"job {self.id}: cpus and memory_bytes must be >= 0")
        if isinstance(self.remote_memory_bytes, bool) or not isinstance(self.remote_memory_bytes, int) \
                or self.remote_memory_bytes < 0:
            raise ValueError(f"job {self.id}: remote_memory_bytes must be an integer >= 0, "
                             f"got {self.remote_memory_bytes!r}")
        if self.gpus == 0 and not self.cpus > 0:
            raise ValueError(f"job {self.id}: a CPU-only job (gpus = 0) must ask for cpus > 0")
        if self.arrival < 0:
            raise ValueError(f"job {self.id}: arrival must be >= 0, got {self.arrival}")
        if isinstance(self.state, str) and not isinstance(self.state, JobState):
            self.state = JobState(self.state)

    @property
    def cpu_only(self) -> bool:
        """No GPUs: a data-preparation job, placed and allocated on CPU cores and memory only."""
        return self.gpus == 0

    @property
    def job_type(self) -> str:
        """Model and batch size: the key interference and speed are learned under."""
        return f"{self.model}@{self.batch_size}" if self.batch_size else self.model

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "model": self.model, "batch_size": self.batch_size, "gpus": self.gpus,
            "cpus": self.cpus, "memory_bytes": self.memory_bytes, "priority": self.priority,
            "arrival": self.arrival, "attained_service": self.attained_service,
            "state": self.state.value, "duration": self.duration, "features": self.features,
            "gpu_memory_bytes": self.gpu_memory_bytes, "batch_sizes": list(self.batch_sizes),
            "remote_memory_bytes": self.remote_memory_bytes, "user": self.user, "account": self.account,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass
class Node:
    """A server: ``gpus`` devices of ``gpu_memory_bytes`` each, ``cores`` CPU
    cores, ``memory_bytes`` host memory, of which ``lendable_bytes`` are
    currently idle and lendable (remote memory; reported by the donor).  ``gpu_type``: the
    GPUs' generation, from NVML's device name or a node label (:func:`gpu_type_of`)."""

    id: str
    gpus: int
    cores: int
    memory_bytes: int
    lendable_bytes: int = 0
    gpu_memory_bytes: int = 32 * GiB  # a V100-32GB, the device Gavel's throughputs were measured on
    gpu_type: str = ""  # its GPUs' generation (gpu_type_of: "v100", "k80", ...); "" when unknown

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("node id must not be empty")
        if not isinstance(self.gpu_type, str) or len(self.gpu_type) > MAX_GPU_TYPE:
            raise ValueError(f"node {self.id}: gpu_type must be a string of at most {MAX_GPU_TYPE} characters")
        if self.gpus < 0 or self.cores < 0 or self.memory_bytes < 0 or self.lendable_bytes < 0:
            raise ValueError(f"node {self.id}: resources must be >= 0")


@dataclass(frozen=True)
class Shard:
    """The part of a job on one node: the node and the GPU indices it uses there."""

    node: str
    gpus: tuple[int, ...]


@dataclass
class Allocation:
    """CPU cores and host memory granted to a job on one node: ``memory_bytes`` of the node's own
    (local) memory and ``remote_bytes`` lent by donors (see :mod:`scheduler.donors`)."""

    cpus: float
    memory_bytes: int
    remote_bytes: int = 0


@dataclass
class JobRecord:
    """The core's bookkeeping for one job (the :class:`Job` plus where and since when it runs)."""

    job: Job
    shards: tuple[Shard, ...] = ()
    run_since: float | None = None  # when the current run began (None when not running)
    first_start: float | None = None
    finished_at: float | None = None
    queued_since: float = 0.0
    queueing_delay: float = 0.0  # total time spent waiting (queued or preempted)
    preemptions: int = 0
    allocation: dict[str, Allocation] = field(default_factory=dict)
    speed: float = 1.0  # last measured normalised speed (1 = as fast as alone)
    external: bool = False  # run by another engine (a bound Kubernetes pod): accounted for, never started
    placed_by: str = ""  # the stimulus_id of the event whose pass placed the current run
    share_start: float | None = None  # the core's equal-share clock when the job arrived (None: not counted)

    def service(self, now: float) -> float:
        """Attained GPU-seconds at ``now`` (computed lazily, so no per-event sweep)."""
        s = self.job.attained_service
        if self.run_since is not None:
            s += self.job.gpus * max(0.0, now - self.run_since)
        return s
