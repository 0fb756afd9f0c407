"""The HTTP API's request and response models (pydantic).

Every model here is named ``Api...``: it is the wire form of a concept that has another
form elsewhere (``scheduler.model.Job``/``JobState``/``Allocation`` in the core,
``scheduler.service.nodes.LiveNode`` in the live loop).  The JSON field names are the API's.

A submission is validated completely here, before anything is stored: a spec
that fails any rule gets a 422 naming the field and the rule, and nothing of it
reaches the queue.  Unknown fields are refused too, so that a misspelt
``memory_byte`` is an error rather than a silent default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from scheduler.service.tokens import ACCOUNT_PATTERN, USER_PATTERN

ApiJobState = Literal["queued", "running", "preempted", "done", "failed", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"done", "failed", "cancelled"})
ApiJobKind = Literal["training", "data_prep", "inference", "other"]

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ARGV = 256
MAX_ARG_CHARS = 4096
MAX_GPUS = 64
MAX_CPUS = 1024.0
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: anything larger is a unit mistake

def _integral(v: Any) -> Any:
    # JSON Schema calls 2.0 an integer; strict pydantic would not.  Booleans stay refused.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]

JobId = Annotated[str, Field(pattern=_ID_PATTERN, description="1-128 characters of A-Z a-z 0-9 _ . -")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0


def _feature(most: float) -> Any:
    """A graph feature: finite, from 0 to ``most`` (1e308 FLOPs would reach the predictors)."""
    return Annotated[float, Field(ge=0, le=most, allow_inf_nan=False)]


_Fraction = _feature(1.0)


class ApiGraphFeatures(_Strict):
    """Computation-graph features (``torch.fx`` on CPU), as the utilisation predictor takes them.
    Bounds: far above any model trained today (GPT-3 scale is ~1e11 parameters, ~1e18 FLOPs a batch)."""

    flops: _feature(1e21) | None = None
    params: _feature(1e13) | None = None
    activation_bytes: _feature(float(1 << 50)) | None = None
    conv_frac: _Fraction | None = None
    linear_frac: _Fraction | None = None
    attn_frac: _Fraction | None = None
    norm_frac: _Fraction | None = None
    layers: _feature(1e6) | None = None


class ApiJobSpec(_Strict):
    """What a launcher submits.  ``model`` and/or ``graph_features`` describe the
    network, for the utilisation and interference predictors (a GPU job with
    neither is scheduled on the predictors' uninformed prior until its measured
    utilisation teaches them); ``command`` is the argv the node daemon starts
    under the job's allocation."""

    id: JobId | None = Field(None, description="optional client-chosen id; resubmitting the same spec is idempotent")
    name: str | None = Field(None, max_length=200, description="free-form label shown on the status page")
    kind: ApiJobKind = Field("training", description="training, data_prep (CPU/memory only), inference or other")
    model: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f]+$",
                              description="model name, e.g. resnet50")
    graph_features: ApiGraphFeatures | None = Field(None, description="computation-graph features from torch.fx")
    batch_size: Int = Field(1, ge=1, le=1 << 20)
    gpus: Int = Field(0, ge=0, le=MAX_GPUS)
    cpus: float = Field(1.0, gt=0, le=MAX_CPUS, allow_inf_nan=False, description="CPU cores requested")
    memory_bytes: Int = Field(1 << 30, ge=1 << 20, le=MAX_MEMORY_BYTES, description="host memory requested")
    remote_memory_bytes: Int = Field(0, ge=0, le=MAX_MEMORY_BYTES,
                                     description="the least memory lent by donors the job must have (0: what "
                                                 "the scheduler gives it); more than the donors lend is rejected")
    priority: Int = Field(0, ge=-1000, le=1000, description="higher runs first among equals")
    command: list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")]] = Field(
        ..., min_length=1, max_length=MAX_ARGV, description="argv to run on the node, e.g. [\"python\", \"train.py\"]")
    env: dict[Annotated[str, Field(pattern=_ENV_NAME.pattern)],
              Annotated[str, Field(max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")]] = Field(
        default_factory=dict, max_length=128, json_schema_extra={"additionalProperties": False})
    cwd: str | None = Field(None, min_length=1, max_length=MAX_ARG_CHARS, pattern=r"^/[^\x00]*$",
                            description="absolute working directory on the node (default: the job's own private "
                                        "directory there, owned by its user)")
    user: str | None = Field(None, pattern=USER_PATTERN,
                             description="the owner (an admin submitting for a user; anyone else may give only their "
                                         "own name): the job runs as this user on its nodes. Not stored in the spec")
    account: str | None = Field(None, pattern=ACCOUNT_PATTERN,
                                description="the account the job's usage counts to (default: the token's)")

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


class ApiAllocation(BaseModel):
    node: str
    gpus: list[int] = Field(default_factory=list)
    cpus: float
    cpuset: str | None = None
    memory_bytes: int
    remote_memory_bytes: int = Field(0, description="memory lent by donors (the scheduler's promise)")


class ApiWaiting(BaseModel):
    """Why a queued or preempted job waits, where it stands and when it should start."""

    code: str = Field(..., description="Resources, Priority, Gang, LentMemory, QuotaLimit, Backoff, NoNodes or "
                                       "Placement (scheduler.waiting)")
    reason: str = Field(..., description="in the words of the part of the scheduler that holds it back")
    nodes: str = Field("", description="per node, as kube-scheduler says it: '0/3 nodes are available: ...'")
    position: int = Field(..., ge=1, description="its place in the queue, in the order the profile starts jobs")
    queue_length: int = Field(..., ge=1, description="jobs waiting in all")
    since: float = Field(..., description="since when it waits for this reason (code)")
    estimated_start: float | None = Field(None, description="when it should start (seconds since the epoch): the "
                                                            "queue replayed through the scheduler with expected run "
                                                            "times; none when not within the replay's horizon")
    estimated_at: float | None = Field(None, description="when that estimate was made")


class ApiJob(BaseModel):
    id: str
    spec: ApiJobSpec
    state: ApiJobState
    reason: str | None = Field(None, description="why the job is in its state (why it waits, placement failure, exit "
                                                 "code, ...)")
    waiting: ApiWaiting | None = Field(None, description="for a queued or preempted job: why, where, until when")
    allocation: ApiAllocation | None = None
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    attained_service: float = Field(0.0, description="GPU-seconds (CPU-seconds for CPU-only jobs) received, for LAS")
    attempts: int = Field(0, description="how many times the job was placed")
    user: str = Field("", description="the job's owner: it runs as this user on its nodes")
    account: str = Field("", description="the account its usage counts to")


class ApiJobList(BaseModel):
    jobs: list[ApiJob]
    total: int


class ApiJobEvent(BaseModel):
    seq: int
    id: str
    ts: float
    kind: str
    job: str | None = None
    node: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class ApiJobEvents(BaseModel):
    job: str
    events: list[ApiJobEvent]


class ApiGpu(BaseModel):
    index: int
    name: str = ""
    util_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    jobs: list[str] = Field(default_factory=list)


class ApiNode(BaseModel):
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
    promised_as_donor_bytes: int = Field(0, description="of this donor's memory, what the scheduler promised to jobs")
    borrowed_bytes: int = Field(0, description="lent memory the scheduler gave the jobs on this node")
    borrowed_from: dict[str, int] = Field(default_factory=dict,
                                          description="the scheduler's books: donor -> bytes promised to jobs here")
    gpus: list[ApiGpu] = Field(default_factory=list)
    gpu_reason: str | None = None
    jobs: list[str] = Field(default_factory=list)


class ApiAggregation(BaseModel):
    """The shared aggregation servers' load, from their telemetry (``dlshare/v1/agg/+/telemetry``)."""

    servers: int = 0
    addresses: list[str] = Field(default_factory=list)
    jobs: int = 0
    pool_cores: float = Field(0.0, description="CPU cores the elastic pools hold now")
    busy_cores: float = Field(0.0, description="cores' worth of reduction work being demanded")
    bytes_in_per_s: float = 0.0


class ApiCluster(BaseModel):
    ts: float
    nodes: list[ApiNode]
    jobs_by_state: dict[str, int]
    gpus_total: int
    gpus_allocated: int
    cpus_total: float
    cpus_allocated: float
    memory_lent_bytes: int
    memory_lendable_bytes: int
    memory_promised_bytes: int = Field(0, description="lent memory the scheduler promised to jobs, all donors")
    aggregation: ApiAggregation
    profile: str


class ApiHistory(BaseModel):
    """The cluster over time, as columns: ``ts`` and one list per field, point for point."""

    model_config = ConfigDict(extra="allow")
    step_s: float = Field(..., description="seconds between points")
    keep_s: float = Field(..., description="how far back points are kept")
    fields: list[str] = Field(..., description="the columns besides ts (each a list of numbers or null)")
    ts: list[float]


class ApiError(BaseModel):
    detail: str


class ApiWhoami(BaseModel):
    user: str
    account: str = ""
    admin: bool = False
    token: str = Field(..., description="the token's id ('bootstrap' for the service's own token)")


class ApiTokenRequest(_Strict):
    """A new token (admins only)."""

    user: str = Field(..., pattern=USER_PATTERN, description="the user the token acts as (its jobs run as this user)")
    account: str = Field("", pattern=r"^$|" + ACCOUNT_PATTERN, description="the account its jobs count to")
    admin: bool = Field(False, description="sees and changes every job and manages tokens")
    ttl_s: float = Field(90 * 86400.0, ge=60, le=10 * 365 * 86400.0, allow_inf_nan=False,
                         description="seconds until it expires (60 s to 10 years; default 90 days)")
    note: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$", description="free-form, shown in listings")


class ApiToken(BaseModel):
    id: str
    user: str
    account: str = ""
    admin: bool = False
    created_at: float
    expires_at: float
    revoked_at: float | None = None
    note: str = ""
    created_by: str = ""
    state: Literal["active", "expired", "revoked"]


class ApiNewToken(ApiToken):
    token: str = Field(..., description="the bearer token itself: shown only in this answer, stored only as a digest")


class ApiTokenList(BaseModel):
    tokens: list[ApiToken]
