"""The HTTP API's request and response models (pydantic).

A submission is validated completely here, before anything is stored: a spec
that fails any rule gets a 422 naming the field and the rule, and nothing of it
reaches the queue.  Unknown fields are refused too, so that a misspelt
``memory_byte`` is an error rather than a silent default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

JobState = Literal["queued", "running", "preempted", "done", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"done", "failed", "cancelled"})
JobKind = Literal["training", "data_prep", "inference", "other"]

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ARGV = 256
MAX_ARG_CHARS = 4096
MAX_GPUS = 64
MAX_CPUS = 1024.0
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: anything larger is a unit mistake
GRAPH_FEATURE_KEYS = frozenset(
    {"flops", "params", "activation_bytes", "conv_frac", "linear_frac", "attn_frac", "norm_frac", "layers"}
)

JobId = Annotated[str, Field(pattern=_ID_PATTERN, description="1-128 characters of A-Z a-z 0-9 _ . -")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class JobSpec(_Strict):
    """What a launcher submits.  ``model`` and/or ``graph_features`` describe the
    network (needed when the job asks for GPUs, so that utilisation can be
    predicted); ``command`` is the argv the node daemon starts under the job's
    allocation."""

    id: JobId | None = Field(None, description="optional client-chosen id; resubmitting the same spec is idempotent")
    name: str | None = Field(None, max_length=200, description="free-form label shown on the status page")
    kind: JobKind = Field("training", description="training, data_prep (CPU/memory only), inference or other")
    model: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f]+$",
                              description="model name, e.g. resnet50")
    graph_features: dict[str, float] | None = Field(
        None, description=f"computation-graph features from torch.fx; keys among {sorted(GRAPH_FEATURE_KEYS)}")
    batch_size: int = Field(1, ge=1, le=1 << 20)
    gpus: int = Field(0, ge=0, le=MAX_GPUS)
    cpus: float = Field(1.0, gt=0, le=MAX_CPUS, allow_inf_nan=False, description="CPU cores requested")
    memory_bytes: int = Field(1 << 30, ge=1 << 20, le=MAX_MEMORY_BYTES, description="host memory requested")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first among equals")
    command: list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_CHARS)]] = Field(
        ..., min_length=1, max_length=MAX_ARGV, description="argv to run on the node, e.g. [\"python\", \"train.py\"]")
    env: dict[str, Annotated[str, Field(max_length=MAX_ARG_CHARS)]] = Field(default_factory=dict, max_length=128)
    cwd: str | None = Field(None, min_length=1, max_length=MAX_ARG_CHARS)

    @field_validator("command")
    @classmethod
    def _no_nul_in_argv(cls, argv: list[str]) -> list[str]:
        for i, a in enumerate(argv):
            if "\x00" in a:
                raise ValueError(f"command[{i}] contains a NUL byte, which no argv can carry")
        return argv

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for k, v in env.items():
            if not _ENV_NAME.match(k):
                raise ValueError(f"environment name {k!r} must match [A-Za-z_][A-Za-z0-9_]*")
            if "\x00" in v:
                raise ValueError(f"environment value of {k} contains a NUL byte")
        return env

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, cwd: str | None) -> str | None:
        if cwd is not None and ("\x00" in cwd or not cwd.startswith("/")):
            raise ValueError("cwd must be an absolute path without NUL bytes")
        return cwd

    @field_validator("graph_features")
    @classmethod
    def _features(cls, feats: dict[str, float] | None) -> dict[str, float] | None:
        if feats is None:
            return None
        unknown = set(feats) - GRAPH_FEATURE_KEYS
        if unknown:
            raise ValueError(f"unknown graph features {sorted(unknown)}; known: {sorted(GRAPH_FEATURE_KEYS)}")
        for k, v in feats.items():
            if v != v or v in (float("inf"), float("-inf")) or v < 0:
                raise ValueError(f"graph feature {k} must be a finite non-negative number, not {v}")
        return feats

    @model_validator(mode="after")
    def _model_for_gpu_jobs(self) -> "JobSpec":
        if self.gpus > 0 and not self.model and not self.graph_features:
            raise ValueError("a job that asks for GPUs needs 'model' and/or 'graph_features' "
                             "so that its GPU utilisation can be predicted")
        return self


class Allocation(BaseModel):
    node: str
    gpus: list[int] = Field(default_factory=list)
    cpus: float
    cpuset: str | None = None
    memory_bytes: int


class Job(BaseModel):
    id: str
    spec: JobSpec
    state: JobState
    reason: str | None = Field(None, description="why the job is in its state (placement failure, exit code, ...)")
    allocation: Allocation | None = None
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    attained_service: float = Field(0.0, description="GPU-seconds (CPU-seconds for CPU-only jobs) received, for LAS")
    attempts: int = Field(0, description="how many times the job was placed")


class JobList(BaseModel):
    jobs: list[Job]
    total: int


class JobEvent(BaseModel):
    seq: int
    id: str
    ts: float
    kind: str
    job: str | None = None
    node: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class JobEvents(BaseModel):
    job: str
    events: list[JobEvent]


class GpuView(BaseModel):
    index: int
    name: str = ""
    util_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    jobs: list[str] = Field(default_factory=list)


class NodeView(BaseModel):
    id: str
    status: Literal["online", "offline", "unknown"]
    last_seen: float | None = None
    cpu_count: int = 0
    cpu_percent: float | None = None
    cpus_allocated: float = 0.0
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    memory_allocated_bytes: int = 0
    reserved_unused_bytes: int = 0
    lendable_bytes: int = 0
    lent_bytes: int = 0
    gpus: list[GpuView] = Field(default_factory=list)
    gpu_reason: str | None = None
    jobs: list[str] = Field(default_factory=list)


class AggregationView(BaseModel):
    """The shared aggregation servers' load, from their telemetry (``dlshare/v1/agg/+/telemetry``)."""

    servers: int = 0
    addresses: list[str] = Field(default_factory=list)
    jobs: int = 0
    pool_cores: float = Field(0.0, description="CPU cores the elastic pools hold now")
    busy_cores: float = Field(0.0, description="cores' worth of reduction work being demanded")
    bytes_in_per_s: float = 0.0


class ClusterView(BaseModel):
    ts: float
    nodes: list[NodeView]
    jobs_by_state: dict[str, int]
    gpus_total: int
    gpus_allocated: int
    cpus_total: float
    cpus_allocated: float
    memory_lent_bytes: int
    memory_lendable_bytes: int
    aggregation: AggregationView
    profile: str


class ErrorBody(BaseModel):
    detail: str
