"""Where a slab replica goes: power of two choices over donors' free slabs (pure).

Infiniswap placed slabs by one random choice by default; two random choices
and the better of them spread load nearly as well as a global search (Mitzenmacher,
"The Power of Two Choices in Randomized Load Balancing", 2001) without
needing fresh global state.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DonorView:
    """What a consumer knows of a donor, from its telemetry and retained state."""

    node: str
    addr: str
    slab_bytes: int
    free_slabs: int
    online: bool = True
    provider: str = "tcp"


class NoDonorError(RuntimeError):
    """Not enough donors with free slabs for the requested placement."""


def choose_one(donors: Mapping[str, DonorView], exclude: Iterable[str], rng: random.Random,
               min_slab_bytes: int = 1) -> str:
    """Sample two eligible donors at random, keep the one with more free slabs."""
    excl = set(exclude)
    eligible = sorted(n for n, d in donors.items()
                      if d.online and d.free_slabs > 0 and n not in excl and d.slab_bytes >= min_slab_bytes)
    if not eligible:
        raise NoDonorError("no online donor with a free slab" + (f" (excluding {sorted(excl)})" if excl else ""))
    if len(eligible) == 1:
        return eligible[0]
    a, b = rng.sample(eligible, 2)
    da, db = donors[a], donors[b]
    if da.free_slabs != db.free_slabs:
        return a if da.free_slabs > db.free_slabs else b
    return min(a, b)


def place_replicas(donors: Mapping[str, DonorView], k: int, rng: random.Random,
                   exclude: Iterable[str] = (), min_slab_bytes: int = 1) -> list[str]:
    """k distinct donors, each chosen by two choices among those not yet chosen."""
    chosen: list[str] = []
    excl = set(exclude)
    for _ in range(k):
        pick = choose_one(donors, excl | set(chosen), rng, min_slab_bytes)
        chosen.append(pick)
    return chosen
