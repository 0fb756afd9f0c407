"""Scheduling profiles: which plugins run, with which arguments and weights.

A profile is TOML.  The packaged ones live in ``scheduler/profiles/NAME.toml``
(``fifo``, ``srtf``, ``las``, ``tiresias``, ``gittins``, ``gandiva``,
``horus``, ``iadeep``, ``synergy``, ``dlshare``, ...)::

    name = "dlshare"
    description = "..."

    [order]                      # exactly one queue sort
    plugin = "gittins"
    args = { prior = "philly" }

    [placement]
    share = "when_full"          # never | when_full | always: may jobs share GPUs?
    max_share = 2                # jobs per GPU at most
    share_max_gpus = 1           # only jobs this small share GPUs
    backfill = true              # non-preemptive sorts: may a later job start when the head cannot?
    nodes_to_score_percent = 0   # 0 = adaptive (Kubernetes' percentageOfNodesToScore rule)
    min_run_s = 0                # preemptive sorts: never preempt a job younger than this
    max_preemptions = 1          # preemptive sorts: a job preempted this often runs to its end (absent: no limit)
    scan_limit = 1000            # a pass gives up after this many waiting jobs found no place

    [[filter]]
    plugin = "gpu_memory"

    [[score]]
    plugin = "consolidate"
    weight = 1

    [allocate]
    plugin = "proportional"

    [fairshare]                  # between users, before the order (scheduler.fairshare); off by default
    enabled = true
    half_life_s = 604800         # usage decay (Slurm's PriorityDecayHalfLife default, 7 days; 0: none)
    tolerance = 2.0              # held back once a user used more than this x its share
    default_share = 1.0
    shares = { alice = 2.0 }     # per user (within its account)
    account_shares = { vision = 3.0 }

    [quota.default_user]         # limits (absent: none); also [quota.default_account],
    gpus = 16                    # [quota.users.NAME] and [quota.accounts.NAME]
    remote_memory_bytes = 68719476736
    queued = 500
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from scheduler import plugins
from scheduler.fairshare import FairShareConfig, QuotaConfig, parse_fairshare, parse_quota

SHARE_MODES = ("never", "when_full", "always")
MAX_PROFILE_BYTES = 1 << 20
MAX_WEIGHT = 1e6
MAX_ARG = 1e12  # any number in a plugin's args: seconds, counts, weights (finite, within +-1e12)
# placement key -> (least, most): finite bounds, each far above any real cluster's need
_PLACEMENT_BOUNDS = {"max_share": (1, 64), "share_max_gpus": (0, 1 << 17), "nodes_to_score_percent": (0, 100),
                     "min_run_s": (0, 1e9), "scan_limit": (1, 10 ** 7), "max_preemptions": (0, 10 ** 6)}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the profile and the key."""


@dataclass(frozen=True)
class PluginSpec:
    plugin: str
    args: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(frozen=True)
class Profile:
    name: str
    order: PluginSpec
    filters: tuple[PluginSpec, ...] = ()
    scores: tuple[PluginSpec, ...] = ()
    allocate: PluginSpec = PluginSpec("proportional")
    share: str = "never"
    max_share: int = 2
    share_max_gpus: int = 1
    backfill: bool = True
    nodes_to_score_percent: float = 0.0
    min_run_s: float = 0.0
    scan_limit: int = 1000
    max_preemptions: int | None = None  # None: a job may be preempted any number of times
    description: str = ""
    fairshare: FairShareConfig = FairShareConfig()
    quota: QuotaConfig = QuotaConfig()

    def build_order(self) -> Any:
        return plugins.build("order", self.order.plugin, self.order.args)

    def build_filters(self) -> list[Any]:
        return [plugins.build("filter", s.plugin, s.args) for s in self.filters]

    def build_scores(self) -> list[tuple[Any, float]]:
        return [(plugins.build("score", s.plugin, s.args), s.weight) for s in self.scores]

    def build_allocator(self) -> Any:
        return plugins.build("allocate", self.allocate.plugin, self.allocate.args)


def packaged_profiles() -> list[str]:
    """Names of the profiles shipped in ``scheduler/profiles``."""
    root = resources.files("scheduler") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a packaged profile by name (``"dlshare"``) or a TOML file by path.

    Raises :class:`ProfileError` with the profile and key at fault; every
    plugin named is built once to check that it exists and accepts its args.
    """
    text, label = _read(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {label}: not valid TOML: {exc}") from None
    return parse_profile(data, label)


def parse_profile(data: dict[str, Any], label: str = "<inline>") -> Profile:
    """Validate a profile already parsed from TOML (see the module docstring)."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile {label}: must be a table")
    known = {"name", "description", "order", "placement", "filter", "score", "allocate", "fairshare", "quota"}
    extra = set(data) - known
    if extra:
        raise ProfileError(f"profile {label}: unknown keys {sorted(extra)}")
    if "order" not in data:
        raise ProfileError(f"profile {label}: missing [order]")
    order = _spec(data["order"], label, "order", weighted=False)
    filters = tuple(_spec(x, label, f"filter[{i}]", weighted=False) for i, x in enumerate(_list(data.get("filter", []), label, "filter")))
    scores = tuple(_spec(x, label, f"score[{i}]", weighted=True) for i, x in enumerate(_list(data.get("score", []), label, "score")))
    allocate = _spec(data.get("allocate", {"plugin": "proportional"}), label, "allocate", weighted=False)
    pl = data.get("placement", {})
    if not isinstance(pl, dict):
        raise ProfileError(f"profile {label}: [placement] must be a table")
    placement_keys = {"share", "max_share", "share_max_gpus", "backfill", "nodes_to_score_percent", "min_run_s",
                      "scan_limit", "max_preemptions"}
    extra = set(pl) - placement_keys
    if extra:
        raise ProfileError(f"profile {label}: unknown [placement] keys {sorted(extra)}")
    share = pl.get("share", "never")
    if share not in SHARE_MODES:
        raise ProfileError(f"profile {label}: placement.share must be one of {SHARE_MODES}, got {share!r}")
    max_share = _typed(pl, "max_share", int, 2, label)
    share_max_gpus = _typed(pl, "share_max_gpus", int, 1, label)
    backfill = _typed(pl, "backfill", bool, True, label)
    pct = float(_typed(pl, "nodes_to_score_percent", (int, float), 0.0, label))
    min_run = float(_typed(pl, "min_run_s", (int, float), 0.0, label))
    scan_limit = _typed(pl, "scan_limit", int, 1000, label)
    max_preemptions = _typed(pl, "max_preemptions", int, None, label) if "max_preemptions" in pl else None
    for key, v in (("max_share", max_share), ("share_max_gpus", share_max_gpus), ("nodes_to_score_percent", pct),
                   ("min_run_s", min_run), ("scan_limit", scan_limit),
                   *((("max_preemptions", max_preemptions),) if max_preemptions is not None else ())):
        lo, hi = _PLACEMENT_BOUNDS[key]
        if not (_finite(v) and lo <= v <= hi):
            raise ProfileError(f"profile {label}: placement.{key} must be between {lo:g} and {hi:g}, got {v!r}")
    try:
        fairshare = parse_fairshare(data.get("fairshare", {}))
        quota = parse_quota(data.get("quota", {}))
    except ValueError as exc:
        raise ProfileError(f"profile {label}: {exc}") from None
    name = data.get("name", label)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"profile {label}: name must be a non-empty string")
    prof = Profile(name=name, order=order, filters=filters, scores=scores, allocate=allocate, share=share,
                   max_share=max_share, share_max_gpus=share_max_gpus, backfill=backfill,
                   nodes_to_score_percent=pct, min_run_s=min_run, scan_limit=scan_limit, max_preemptions=max_preemptions,
                   description=str(data.get("description", "")), fairshare=fairshare, quota=quota)
    try:
        prof.build_order(), prof.build_filters(), prof.build_scores(), prof.build_allocator()
    except ValueError as exc:
        raise ProfileError(f"profile {label}: {exc}") from None
    return prof


def _read(name_or_path: str | Path) -> tuple[str, str]:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        from scheduler.data import read_capped

        raw = read_capped(p, MAX_PROFILE_BYTES, ProfileError, f"profile {p}")
        try:
            return raw.decode("utf-8-sig"), str(p)
        except UnicodeDecodeError:
            raise ProfileError(f"profile {p}: not UTF-8 text (a profile is TOML)") from None
    name = str(name_or_path)
    res = resources.files("scheduler") / "profiles" / f"{name}.toml"
    if not name.replace("_", "").replace("-", "").isalnum() or not res.is_file():
        raise ProfileError(f"no profile {name!r} (packaged: {', '.join(packaged_profiles())}; or give a .toml path)")
    return res.read_text(), name


def _list(v: Any, label: str, key: str) -> list[Any]:
    if not isinstance(v, list):
        raise ProfileError(f"profile {label}: [[{key}]] must be an array of tables")
    return v


def _typed(d: dict[str, Any], key: str, typ: Any, default: Any, label: str) -> Any:
    v = d.get(key, default)
    if isinstance(v, bool) and typ is not bool and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise ProfileError(f"profile {label}: placement.{key} must be a number, got {v!r}")
    if not isinstance(v, typ):
        raise ProfileError(f"profile {label}: placement.{key} has the wrong type: {v!r}")
    return v


def _spec(v: Any, label: str, where: str, weighted: bool) -> PluginSpec:
    if isinstance(v, str):
        v = {"plugin": v}
    if not isinstance(v, dict) or not isinstance(v.get("plugin"), str):
        raise ProfileError(f"profile {label}: {where} needs plugin = \"NAME\"")
    allowed = {"plugin", "args"} | ({"weight"} if weighted else set())
    extra = set(v) - allowed
    if extra:
        raise ProfileError(f"profile {label}: {where}: unknown keys {sorted(extra)}")
    args = v.get("args", {})
    if not isinstance(args, dict):
        raise ProfileError(f"profile {label}: {where}.args must be a table")
    _check_numbers(args, label, f"{where}.args")
    weight = v.get("weight", 1.0)
    if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not _finite(weight)
            or not 0 <= weight <= MAX_WEIGHT):
        raise ProfileError(f"profile {label}: {where}.weight must be a number from 0 to {MAX_WEIGHT:g}, got {weight!r}")
    return PluginSpec(v["plugin"], dict(args), float(weight))


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def _check_numbers(v: Any, label: str, where: str) -> None:
    """Every number in a plugin's args is finite and within +-MAX_ARG (TOML has inf and nan)."""
    if isinstance(v, dict):
        for k, x in v.items():
            _check_numbers(x, label, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_numbers(x, label, f"{where}[{i}]")
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        if not (_finite(v) and abs(v) <= MAX_ARG):
            raise ProfileError(f"profile {label}: {where} must be a finite number within +-{MAX_ARG:g}, got {v!r}")
