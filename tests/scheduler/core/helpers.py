"""Shared builders for the scheduler tests."""

import random

from scheduler import Node, SchedulerState, load_profile
from scheduler.model import GiB


def nodes(n: int = 2, gpus: int = 4, cores: int = 12, mem_gib: int = 256) -> list[Node]:
    return [Node(f"n{i}", gpus, cores, mem_gib * GiB) for i in range(n)]


def make_state(profile: str = "fifo", n: int = 2, gpus: int = 4, seed: int = 0, **kw) -> SchedulerState:
    return SchedulerState(load_profile(profile), nodes(n, gpus), rng=random.Random(seed), **kw)
