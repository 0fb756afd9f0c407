"""A job's remote memory, from the environment its node daemon gave it.

A node daemon that starts a job with ``remote_memory_bytes`` in its ``run``
command puts the budget in the job's environment, next to the broker and the
node's id that every job gets::

    DLSHARE_BROKER=mqtt://...           the control plane (donors are found there)
    DLSHARE_NODE_ID=n7                  what donors count the borrowed memory against
    DLSHARE_REMOTE_MEMORY_BYTES=...     donor memory the job may use, every copy counted
    DLSHARE_MEMORY_BYTES=...            the job's local memory limit, when it has one

so a job maps its region, or a sample cache that spills to donors, with no address in its code::

    import rdma
    region = rdma.region_from_env()          # budget / replicas bytes, on donors
    table = region.array(np.float32, (rows, dim))
    cache = rdma.spill_cache_from_env()      # key -> bytes, the resident share local, the rest on donors
    samples = rdma.sample_cache_from_env(len(dataset))  # a dataset's samples, shared by its workers
"""

from __future__ import annotations

import os
from typing import Any

from rdma.region import DEFAULT_UNIT, RemoteRegion
from rdma.remote import RemoteMemory
from rdma.sample_cache import SampleCache
from rdma.spill import SpillCache

ENV_BROKER = "DLSHARE_BROKER"
ENV_BUDGET = "DLSHARE_REMOTE_MEMORY_BYTES"
ENV_LOCAL_LIMIT = "DLSHARE_MEMORY_BYTES"
ENV_REGION_LOCAL = "DLSHARE_REGION_LOCAL_BYTES"
ENV_REPLICAS = "DLSHARE_REMOTE_REPLICAS"
ENV_REBUILD_RATE = "DLSHARE_REBUILD_BYTES_PER_S"
ENV_CACHE_SECRET = "DLSHARE_CACHE_SECRET"
DEFAULT_LOCAL = 256 << 20  # resident share when nothing says otherwise


def _env_int(name: str, env: dict[str, str]) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name} must be a whole number of bytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name} must not be negative, got {value}")
    return value


def budget_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """What the environment grants (pure: for callers that size things before mapping).

    ``region_bytes``: the largest region the budget allows (``budget // replicas``, down to a
    whole unit); ``local_bytes``: the resident share (``$DLSHARE_REGION_LOCAL_BYTES``, else a
    quarter of ``$DLSHARE_MEMORY_BYTES``, else 256 MiB, never more than the region);
    ``rebuild_bytes_per_s``: the cap on a rebuild's copying (``$DLSHARE_REBUILD_BYTES_PER_S``, else
    0: none; see :class:`~rdma.remote.RemoteMemory`)."""
    env = dict(os.environ) if env is None else env
    broker = env.get(ENV_BROKER)
    budget = _env_int(ENV_BUDGET, env)
    if not broker or budget is None:
        missing = [n for n, v in ((ENV_BROKER, broker), (ENV_BUDGET, budget)) if not v and v != 0]
        raise LookupError(f"no remote memory in this environment ({', '.join(missing)} unset): start the job "
                          "through a dlshare node daemon's `run` command with remote_memory_bytes")
    replicas = _env_int(ENV_REPLICAS, env) or 2
    region = budget // replicas // DEFAULT_UNIT * DEFAULT_UNIT
    if region <= 0:
        raise ValueError(f"${ENV_BUDGET}={budget} is too small for one {DEFAULT_UNIT}-byte unit "
                         f"with {replicas} copies")
    local = _env_int(ENV_REGION_LOCAL, env)
    if local is None:
        limit = _env_int(ENV_LOCAL_LIMIT, env)
        local = limit // 4 if limit else DEFAULT_LOCAL
    return {"broker": broker, "budget_bytes": budget, "replicas": replicas, "region_bytes": region,
            "local_bytes": min(local, region), "rebuild_bytes_per_s": _env_int(ENV_REBUILD_RATE, env) or 0}


def region_from_env(nbytes: int | None = None, local_bytes: int | None = None, *, discover_timeout_s: float = 15.0,
                    **map_options: Any) -> RemoteRegion:
    """Map this job's remote-memory budget as one region (see the module docstring).

    ``nbytes``: a smaller region than the budget allows (more is refused).  The region owns
    its RemoteMemory: closing the region closes it."""
    grant = budget_from_env()
    size = grant["region_bytes"] if nbytes is None else int(nbytes)
    if size > grant["region_bytes"]:
        raise ValueError(f"{size} bytes asked; the budget of {grant['budget_bytes']} bytes with "
                         f"{grant['replicas']} copies allows {grant['region_bytes']}")
    local = grant["local_bytes"] if local_bytes is None else int(local_bytes)
    unit = int(map_options.pop("unit", DEFAULT_UNIT))
    local = max(local, 4 * unit)
    mem = RemoteMemory(grant["broker"], replicas=grant["replicas"], discover_timeout_s=discover_timeout_s,
                       rebuild_bytes_per_s=grant["rebuild_bytes_per_s"])
    try:
        region = mem.map(size, local_bytes=local, unit=unit, **map_options)
    except BaseException:
        mem.close()
        raise
    region._own(mem)
    return region


def spill_cache_from_env(capacity_bytes: int | None = None, *, arena_bytes: int = 64 << 20,
                         discover_timeout_s: float = 15.0) -> SpillCache:
    """A :class:`SpillCache` sized by this job's budget: ``capacity_bytes`` local (default: the
    resident share, see :func:`budget_from_env`), and at most the budget's ``region_bytes`` on donors
    (every copy counted against the budget).  The cache owns its RemoteMemory: closing it closes it."""
    grant = budget_from_env()
    local = grant["local_bytes"] if capacity_bytes is None else int(capacity_bytes)
    if local < 0:
        raise ValueError(f"capacity_bytes must not be negative, got {local}")
    mem = RemoteMemory(grant["broker"], replicas=grant["replicas"], discover_timeout_s=discover_timeout_s,
                       rebuild_bytes_per_s=grant["rebuild_bytes_per_s"])
    return SpillCache(local, remote=mem, arena_bytes=min(arena_bytes, grant["region_bytes"]),
                      remote_capacity_bytes=grant["region_bytes"], owns_remote=True)


def sample_cache_from_env(slots: int, name: str | None = None, *, secret: str | None = None,
                          local_bytes: int | None = None, when_full: str = "keep",
                          discover_timeout_s: float = 15.0, attach_timeout_s: float = 1.0) -> SampleCache:
    """A :class:`~rdma.sample_cache.SampleCache` of ``slots`` entries sized by this job's budget:
    ``local_bytes`` in local memory (default: the resident share, see :func:`budget_from_env`) and
    the whole remote budget on donors (every copy counted).

    ``name``: a cache shared with other jobs; the secret comes from ``secret`` or
    ``$DLSHARE_CACHE_SECRET``.  When a cache of that name is already published (another job filled
    it) this job attaches to it read-only and borrows nothing; otherwise it creates it, and its
    budget pays for it.  Two jobs that start at the same moment may both create one (the later
    manifest wins): start the filling job first."""
    grant = budget_from_env()
    local = grant["local_bytes"] if local_bytes is None else int(local_bytes)
    if local < 0:
        raise ValueError(f"local_bytes must not be negative, got {local}")
    if name is not None:
        secret = secret if secret is not None else os.environ.get(ENV_CACHE_SECRET)
        if not secret:
            raise LookupError(f"cache {name!r} is shared: give its secret (${ENV_CACHE_SECRET} or secret=)")
        try:
            return SampleCache.attach(name, secret, grant["broker"], timeout_s=attach_timeout_s)
        except LookupError:
            pass  # nobody fills it yet: this job does
    return SampleCache(slots, local, grant["budget_bytes"], broker=grant["broker"], name=name, secret=secret,
                       replicas=grant["replicas"], when_full=when_full, discover_timeout_s=discover_timeout_s,
                       rebuild_bytes_per_s=grant["rebuild_bytes_per_s"])
