"""Fair share between users and per-user/per-account quotas, for the scheduler core.

A job's owner is ``Job.user`` within ``Job.account`` (Slurm's *association*; empty user: the one
anonymous user, empty account: no account).  Everything here is pure: usage decays with the times
of the events the core handles, never with a clock, so a replay of the same events gives the same
usage to the bit.

* :class:`Owners`: the books per owner, kept by the ledger on every job move: decayed GPU usage
  per association, GPUs in use and jobs waiting per user and per account.
* :class:`FairShare`: Slurm's classic fair-share factor ``F = 2^(-U/S)`` (``U``: the owner's share
  of the decayed usage, ``S``: its share of the shares, both among the owners with jobs in the
  system), taken per account and then per user within the account, as Slurm's Fair Tree ranks
  accounts before their users.  The order puts a job's fair-share *level* before its own key.
  The level reads the owner's usage per share against the other owners' (``U/S`` with the owner
  left out of the reference, so that with two users one can still stand out; ``U/S`` itself is
  at most 2 then): level 0 while it is at most ``tolerance`` (2) times theirs, then one level more
  each time that doubles; a level falls back only ``HYSTERESIS`` below its boundary.  Levels, not
  the raw factor, for the reason Tiresias discretises LAS into queues: within a level the
  profile's own order (LAS, Gittins, ...) decides across users, which keeps what that order wins
  on the mean; and users near their share do not swap places (and preempt each other) every time
  one of them runs a little more.
* :class:`QuotaConfig` and :class:`LentLimits`: limits on the GPUs an owner's jobs hold at once,
  the memory lent to them (``remote_memory_bytes``) and the jobs it has waiting.  A job over a
  limit waits (the core says why); one that could never fit its owner's limit is rejected.

Usage is GPU-seconds with exponential decay: ``usage(t) = sum over runs of GPUs x integral of
2^(-(t - s) / half_life) ds``, kept exactly per association as (value, time, GPUs running now).
The default half-life is Slurm's ``PriorityDecayHalfLife`` default, 7 days.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.donors import DonorPool
    from scheduler.model import Job, JobRecord

HALF_LIFE_S = 7 * 86400.0  # Slurm's PriorityDecayHalfLife default (7-00:00:00)
TOLERANCE = 2.0  # level 0 up to twice the owner's share: balanced users (U/S = 1) sit far from a boundary
MAX_LEVEL = 64
# A user whose level rose falls back only once its usage is this factor below the boundary (half a
# level on the log2 scale): without it a user with more demand than share sits on a boundary and
# swaps level, and its jobs get preempted and resumed, every round.
HYSTERESIS = math.sqrt(2.0)
MAX_SHARE = 1e9

Assoc = tuple[str, str]  # (account, user)
OwnerKey = tuple[str, str]  # ("user" | "account", name)


def describe(kind: str, name: str) -> str:
    """How an owner is named in a reason."""
    if kind == "user":
        return f"user {name!r}" if name else "the anonymous user"
    return f"account {name!r}"


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class FairShareConfig:
    """``[fairshare]`` of a profile (see the module docstring)."""

    enabled: bool = False
    half_life_s: float = HALF_LIFE_S  # 0: no decay
    tolerance: float = TOLERANCE
    default_share: float = 1.0
    shares: Mapping[str, float] = field(default_factory=dict)  # user -> shares (within its account)
    account_shares: Mapping[str, float] = field(default_factory=dict)

    def share(self, user: str) -> float:
        return self.shares.get(user, self.default_share)

    def account_share(self, account: str) -> float:
        return self.account_shares.get(account, self.default_share)


@dataclass(frozen=True)
class Limits:
    """One owner's limits; ``None``: no limit."""

    gpus: int | None = None  # GPUs its running jobs hold at once
    remote_memory_bytes: int | None = None  # memory lent by donors to its running jobs at once
    queued: int | None = None  # jobs waiting (queued or preempted) at once; beyond it a new job is rejected

    def over(self, base: "Limits") -> "Limits":
        """These limits, with ``base``'s where these give none."""
        return Limits(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
                         for f in fields(self)})

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


@dataclass(frozen=True)
class QuotaConfig:
    """``[quota]`` of a profile: ``default_user`` applies to every user (the anonymous one too)
    and ``users`` override it key by key; likewise ``default_account`` and ``accounts`` for jobs
    with an account (a job without one has no account limit)."""

    default_user: Limits = Limits()
    default_account: Limits = Limits()
    users: Mapping[str, Limits] = field(default_factory=dict)
    accounts: Mapping[str, Limits] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return (self.default_user.any or self.default_account.any or any(v.any for v in self.users.values())
                or any(v.any for v in self.accounts.values()))

    def for_user(self, user: str) -> Limits:
        own = self.users.get(user)
        return own.over(self.default_user) if own is not None else self.default_user

    def for_account(self, account: str) -> Limits:
        if not account:
            return Limits()
        own = self.accounts.get(account)
        return own.over(self.default_account) if own is not None else self.default_account

    def limits(self, job: "Job") -> tuple[tuple[str, str, Limits], ...]:
        """(kind, name, limits) of every owner of ``job`` that has limits."""
        out = [("user", job.user, self.for_user(job.user))]
        if job.account:
            out.append(("account", job.account, self.for_account(job.account)))
        return tuple(o for o in out if o[2].any)


def _number(v: Any, where: str, lo: float, hi: float, integer: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ValueError(f"{where} must be {'a whole number' if integer else 'a number'}, got {v!r}")
    try:
        ok = math.isfinite(v) and lo <= v <= hi
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"{where} must be between {lo:g} and {hi:g}, got {v!r}")
    return v


def _table(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{where} must be a table")
    return v


def _name(k: Any, where: str) -> str:
    from scheduler.model import MAX_OWNER

    if not isinstance(k, str) or len(k) > MAX_OWNER:
        raise ValueError(f"{where}: {k!r} is not a user or account name (at most {MAX_OWNER} characters)")
    return k


def parse_fairshare(d: Any) -> FairShareConfig:
    """``[fairshare]`` from TOML; ValueError names the key at fault."""
    d = _table(d, "[fairshare]")
    known = {"enabled", "half_life_s", "tolerance", "default_share", "shares", "account_shares"}
    extra = set(d) - known
    if extra:
        raise ValueError(f"unknown [fairshare] keys {sorted(extra)}")
    enabled = d.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"fairshare.enabled must be true or false, got {enabled!r}")
    half = float(_number(d.get("half_life_s", HALF_LIFE_S), "fairshare.half_life_s", 0.0, 1e10))
    tol = float(_number(d.get("tolerance", TOLERANCE), "fairshare.tolerance", 1.0, 1e6))
    default = float(_number(d.get("default_share", 1.0), "fairshare.default_share", 1e-9, MAX_SHARE))
    tables = {}
    for key in ("shares", "account_shares"):
        t = _table(d.get(key, {}), f"fairshare.{key}")
        tables[key] = {_name(k, f"fairshare.{key}"): float(_number(v, f"fairshare.{key}.{k}", 1e-9, MAX_SHARE))
                       for k, v in t.items()}
    return FairShareConfig(enabled, half, tol, default, tables["shares"], tables["account_shares"])


def _limits(d: Any, where: str) -> Limits:
    d = _table(d, where)
    known = {f.name for f in fields(Limits)}
    extra = set(d) - known
    if extra:
        raise ValueError(f"unknown {where} keys {sorted(extra)} (known: {sorted(known)})")
    return Limits(**{k: int(_number(v, f"{where}.{k}", 0, 1 << 62, integer=True)) for k, v in d.items()})


def parse_quota(d: Any) -> QuotaConfig:
    """``[quota]`` from TOML; ValueError names the key at fault."""
    d = _table(d, "[quota]")
    known = {"default_user", "default_account", "users", "accounts"}
    extra = set(d) - known
    if extra:
        raise ValueError(f"unknown [quota] keys {sorted(extra)}")
    users = {_name(k, "quota.users"): _limits(v, f"quota.users.{k}")
             for k, v in _table(d.get("users", {}), "quota.users").items()}
    accounts = {_name(k, "quota.accounts"): _limits(v, f"quota.accounts.{k}")
                for k, v in _table(d.get("accounts", {}), "quota.accounts").items()}
    return QuotaConfig(_limits(d.get("default_user", {}), "quota.default_user"),
                       _limits(d.get("default_account", {}), "quota.default_account"), users, accounts)


# ---------------------------------------------------------------- the books


class Owners:
    """Per-owner books (see the module docstring).  The ledger calls :meth:`waiting` and
    :meth:`running` on every move; everything else reads."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        if half_life_s < 0:
            raise ValueError("half_life_s must be >= 0")
        self.half_life_s = float(half_life_s)
        self.usage: dict[Assoc, list[float]] = {}  # association -> [decayed GPU-s at t0, t0, GPUs running]
        self.active: dict[Assoc, int] = {}  # association -> its jobs waiting or running
        self.waiting_by: dict[OwnerKey, int] = {}  # jobs waiting, per user and per account
        self.gpus_by: dict[OwnerKey, int] = {}  # GPUs held by running jobs, per user and per account
        self.epoch = 0  # changes whenever the set of active associations does

    @staticmethod
    def keys(job: "Job") -> tuple[OwnerKey, ...]:
        return (("user", job.user), ("account", job.account)) if job.account else (("user", job.user),)

    def value(self, assoc: Assoc, now: float) -> float:
        """The association's decayed GPU-seconds at ``now``."""
        u = self.usage.get(assoc)
        if u is None:
            return 0.0
        v, t0, g = u
        dt = max(0.0, now - t0)
        if self.half_life_s <= 0:
            return v + g * dt
        d = 2.0 ** (-dt / self.half_life_s)
        return v * d + g * (self.half_life_s / math.log(2.0)) * (1.0 - d)

    def _active(self, assoc: Assoc, delta: int) -> None:
        n = self.active.get(assoc, 0) + delta
        if (n > 0) != (self.active.get(assoc, 0) > 0):
            self.epoch += 1
        if n > 0:
            self.active[assoc] = n
        else:
            self.active.pop(assoc, None)

    def waiting(self, job: "Job", delta: int) -> None:
        """``job`` joined (+1) or left (-1) the waiting jobs."""
        self._active((job.account, job.user), delta)
        for k in self.keys(job):
            n = self.waiting_by.get(k, 0) + delta
            if n:
                self.waiting_by[k] = n
            else:
                self.waiting_by.pop(k, None)

    def running(self, job: "Job", delta: int, now: float) -> None:
        """``job`` started (+1) or stopped (-1) running at ``now``: its GPUs count from then on."""
        assoc = (job.account, job.user)
        self._active(assoc, delta)
        if job.gpus:
            u = self.usage.get(assoc)
            v = self.value(assoc, now)
            g = (u[2] if u is not None else 0.0) + delta * job.gpus
            self.usage[assoc] = [v, now, max(0.0, g)]
            for k in self.keys(job):
                n = self.gpus_by.get(k, 0) + delta * job.gpus
                if n:
                    self.gpus_by[k] = n
                else:
                    self.gpus_by.pop(k, None)


def _level(x: float, tolerance: float) -> int:
    if not x > tolerance:
        return 0
    if x == math.inf:
        return MAX_LEVEL
    return min(MAX_LEVEL, math.ceil(math.log2(x / tolerance)))


def _settle(x: float, tolerance: float, held: int) -> int:
    """The level for ``x`` (usage per share against the others') when the last pass set ``held``:
    up at once, down only as far as ``x`` times ``HYSTERESIS`` allows."""
    up = _level(x, tolerance)
    if up >= held:
        return up
    return max(up, min(held, _level(x * HYSTERESIS, tolerance)))


def _ratios(usage: dict[Any, float], shares: dict[Any, float]) -> dict[Any, tuple[float, float]]:
    """For each sibling: Slurm's ``U/S`` (its share of the usage over its share of the shares;
    1: exactly its share) and its usage per share over the *other* siblings' (1: as much as they;
    infinite when it alone used anything).  The level reads the second: with two siblings the
    first is at most 2, so one that took everything would never stand out."""
    tu = sum(usage.values())
    ts = sum(shares.values())
    out = {}
    for k, u in usage.items():
        s = shares[k]
        x = (u / tu) / (s / ts) if tu > 0 else 0.0
        ou, os = tu - u, ts - s
        if os <= 0 or u <= 0:
            rel = 0.0  # alone, or nothing used
        elif ou <= 1e-12 * tu:
            rel = math.inf
        else:
            rel = (u / s) / (ou / os)
        out[k] = (x, rel)
    return out


class FairShare:
    """Fair-share levels of the active associations (see the module docstring).

    A level rises as soon as usage crosses a boundary and falls back only ``HYSTERESIS`` below
    it, so the levels depend on the ones the last pass set: :meth:`update` (once per scheduling
    pass) is the only call that moves them; :meth:`levels` reads them (and what they would be
    now), so an explanation asked between events changes nothing a replay would not."""

    def __init__(self, config: FairShareConfig, owners: Owners) -> None:
        self.config = config
        self.owners = owners
        self.held: dict[Assoc, tuple[int, int]] = {}  # the levels the last pass set
        self._cache: tuple[float, int, dict[Assoc, tuple[int, int]]] | None = None

    def ratios(self, now: float) -> tuple[dict[str, tuple[float, float]], dict[Assoc, tuple[float, float]]]:
        """For every active account, and every active association among its account's active
        users: (``U/S``, usage per share against the others'); see :func:`_ratios`."""
        own = self.owners
        cfg = self.config
        vals = {a: own.value(a, now) for a in own.usage}
        acct_usage: dict[str, float] = {}
        for (acct, _), v in vals.items():
            acct_usage[acct] = acct_usage.get(acct, 0.0) + v
        active_accts = dict.fromkeys(a for a, _ in own.active)
        acct_x = _ratios({a: acct_usage.get(a, 0.0) for a in active_accts},
                         {a: cfg.account_share(a) for a in active_accts})
        users: dict[str, list[Assoc]] = {}
        for assoc in own.active:
            users.setdefault(assoc[0], []).append(assoc)
        user_x: dict[Assoc, tuple[float, float]] = {}
        for acct, assocs in users.items():
            user_x.update(_ratios({a: vals.get(a, 0.0) for a in assocs}, {a: cfg.share(a[1]) for a in assocs}))
        return acct_x, user_x

    def _compute(self, now: float) -> dict[Assoc, tuple[int, int]]:
        acct_x, user_x = self.ratios(now)
        tol = self.config.tolerance
        out = {}
        for a, (_, rel) in user_x.items():
            held = self.held.get(a, (0, 0))
            out[a] = (_settle(acct_x[a[0]][1], tol, held[0]), _settle(rel, tol, held[1]))
        return out

    def levels(self, now: float) -> dict[Assoc, tuple[int, int]]:
        """(account level, user level) of every active association at ``now`` (cached until the
        time or the set of active associations changes).  Reads only."""
        c = self._cache
        if c is not None and c[0] == now and c[1] == self.owners.epoch:
            return c[2]
        out = self._compute(now)
        self._cache = (now, self.owners.epoch, out)
        return out

    def update(self, now: float) -> None:
        """Settle the levels at ``now`` (the core calls this at the start of every pass)."""
        out = self._compute(now)
        self.held = out
        self._cache = (now, self.owners.epoch, out)

    def level(self, job: "Job", now: float) -> tuple[int, int]:
        return self.levels(now).get((job.account, job.user), (0, 0))

    def report(self, now: float) -> list[dict[str, Any]]:
        """Per active association: decayed usage, shares, ``U/S`` and Slurm's factor ``F = 2^(-U/S)``,
        the usage per share against the other users', the same for its account, and the levels
        the order uses."""
        acct_x, user_x = self.ratios(now)
        lv = self.levels(now)
        return [{"account": a[0], "user": a[1], "usage_gpu_s": self.owners.value(a, now),
                 "share": self.config.share(a[1]), "account_share": self.config.account_share(a[0]),
                 "usage_over_share": x, "factor": 2.0 ** -x, "against_others": rel,
                 "account_usage_over_share": acct_x[a[0]][0], "account_factor": 2.0 ** -acct_x[a[0]][0],
                 "account_against_others": acct_x[a[0]][1], "level": lv[a]}
                for a, (x, rel) in sorted(user_x.items())]


class LentLimits:
    """What the donors may lend each owner (``Context.quota``): the ``lent`` allocator stays within
    :meth:`room`, and the ledger clamps any allocator's grant to it."""

    def __init__(self, config: QuotaConfig, records: Mapping[str, "JobRecord"], pool: "DonorPool") -> None:
        self.config = config
        self.records = records
        self.pool = pool

    def keys(self, job: "Job") -> tuple[tuple[OwnerKey, int], ...]:
        """(owner, limit) of every owner of ``job`` with a lent-memory limit."""
        return tuple(((kind, name), lim.remote_memory_bytes) for kind, name, lim in self.config.limits(job)
                     if lim.remote_memory_bytes is not None)

    def lent(self, key: OwnerKey, exclude_node: str | None = None) -> int:
        """Bytes lent now to ``key``'s jobs (on nodes other than ``exclude_node``)."""
        kind, name = key
        total = 0
        for (jid, nid), donors in self.pool.holds.items():
            if nid == exclude_node:
                continue
            rec = self.records.get(jid)
            if rec is not None and (rec.job.user if kind == "user" else rec.job.account) == name:
                total += sum(donors.values())
        return total

    def room(self, job: "Job", exclude_node: str | None = None) -> dict[OwnerKey, int]:
        """For each owner of ``job`` with a limit: the bytes it may still borrow beyond what its
        jobs hold on nodes other than ``exclude_node``."""
        return {k: lim - self.lent(k, exclude_node) for k, lim in self.keys(job)}


def gpu_reason(job: "Job", config: QuotaConfig, in_use: Callable[[OwnerKey], int]) -> str:
    """Why ``job`` may not start now for its owners' GPU limits ("" when it may): ``in_use`` gives
    the GPUs an owner's jobs hold."""
    if not job.gpus:
        return ""
    for kind, name, lim in config.limits(job):
        if lim.gpus is not None:
            used = in_use((kind, name))
            if used + job.gpus > lim.gpus:
                return (f"{describe(kind, name)} holds {used} of its {lim.gpus} GPUs (quota); "
                        f"the job needs {job.gpus}")
    return ""


def lent_reason(job: "Job", lent: LentLimits) -> str:
    """Why ``job``'s lent-memory minimum does not fit its owners' limits now ("" when it does)."""
    if not job.remote_memory_bytes:
        return ""
    for (kind, name), lim in lent.keys(job):
        used = lent.lent((kind, name))
        if used + job.remote_memory_bytes > lim:
            return (f"{describe(kind, name)} borrows {used} of its {lim} bytes of lent memory (quota); "
                    f"the job needs {job.remote_memory_bytes}")
    return ""


def never_reason(job: "Job", config: QuotaConfig) -> str:
    """Why ``job`` could never start within its owners' limits ("" when it could)."""
    for kind, name, lim in config.limits(job):
        if lim.gpus is not None and job.gpus > lim.gpus:
            return f"needs {job.gpus} GPUs; {describe(kind, name)} may hold at most {lim.gpus} (quota)"
        if lim.remote_memory_bytes is not None and job.remote_memory_bytes > lim.remote_memory_bytes:
            return (f"needs {job.remote_memory_bytes} bytes of lent memory; {describe(kind, name)} may borrow at "
                    f"most {lim.remote_memory_bytes} (quota)")
    return ""


def queued_reason(job: "Job", config: QuotaConfig, owners: Owners) -> str:
    """Why ``job`` is refused at arrival for its owners' waiting-job limits ("" when it is not)."""
    for kind, name, lim in config.limits(job):
        if lim.queued is not None:
            n = owners.waiting_by.get((kind, name), 0)
            if n + 1 > lim.queued:
                return f"{describe(kind, name)} has {n} jobs waiting; its quota is {lim.queued}"
    return ""
