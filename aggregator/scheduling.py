"""Pure policies of the shared pool: fair task order across jobs, and pool sizing.

Neither reads a clock nor starts a thread: the shell passes ``now`` and the
measured busy time in, and carries the answers out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class _Flow:
    items: deque = field(default_factory=deque)
    deficit: int = 0
    in_turn: bool = False


class FairQueue:
    """Deficit round robin (Shreedhar and Varghese, SIGCOMM'95) over jobs, by bytes.

    Each job's turn grants it ``quantum`` bytes of reduction work, so a job that
    pushes 64 MiB tensors and a job that pushes 64 KiB ones get equal bytes per
    turn, and the small job's chunks never queue behind all of the large job's.
    """

    def __init__(self, quantum: int = 1 << 20) -> None:
        if quantum <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = quantum
        self._flows: dict[Hashable, _Flow] = {}
        self._active: deque[Hashable] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, flow: Hashable, item: Any, cost: int) -> None:
        f = self._flows.get(flow)
        if f is None:
            f = self._flows[flow] = _Flow()
        if not f.items:
            self._active.append(flow)
        f.items.append((max(1, int(cost)), item))
        self._len += 1

    def pop(self) -> Any | None:
        while self._active:
            name = self._active[0]
            f = self._flows[name]
            if not f.in_turn:
                f.deficit += self.quantum
                f.in_turn = True
            cost, item = f.items[0]
            if f.deficit >= cost:
                f.deficit -= cost
                f.items.popleft()
                self._len -= 1
                if not f.items:
                    f.deficit, f.in_turn = 0, False
                    self._active.popleft()
                    del self._flows[name]
                return item
            f.in_turn = False
            self._active.rotate(-1)
        return None

    def backlog(self) -> dict[Hashable, int]:
        return {k: len(f.items) for k, f in self._flows.items()}


@dataclass(frozen=True)
class PoolSample:
    """What the controller saw and decided at one observation (for telemetry)."""

    now: float
    size: int
    busy_fraction: float
    demand_cores: float
    target: int


class PoolController:
    """Sizes the pool from measured busy time, between ``min_cores`` and ``max_cores``.

    ``demand`` is the busy core-seconds per second over the last interval.  The
    pool grows at once when it is more than ``grow_above`` busy,
    to ``ceil(demand / target_util)`` and at least one more thread; a backlog of more than
    two tasks per thread also grows it when the pool is more than ``shrink_below`` busy.  It shrinks
    only after ``shrink_after_s`` below ``shrink_below`` busy (hysteresis), so a
    burst-idle-burst pattern with a short gap keeps its threads.
    """

    def __init__(self, min_cores: int, max_cores: int, target_util: float = 0.7, grow_above: float = 0.85,
                 shrink_below: float = 0.4, shrink_after_s: float = 1.0) -> None:
        if not 1 <= min_cores <= max_cores:
            raise ValueError(f"need 1 <= min_cores ({min_cores}) <= max_cores ({max_cores})")
        if not 0 < shrink_below < target_util < grow_above <= 1.0:
            raise ValueError("need 0 < shrink_below < target_util < grow_above <= 1")
        self.min, self.max = min_cores, max_cores
        self.target_util, self.grow_above, self.shrink_below = target_util, grow_above, shrink_below
        self.shrink_after_s = shrink_after_s
        self.size = min_cores
        self._last: tuple[float, float] | None = None
        self._low_since: float | None = None

    def observe(self, now: float, busy_total_s: float, queued: int) -> PoolSample:
        """Feed the pool's cumulative busy seconds; returns the new target size."""
        if self._last is None:
            self._last = (now, busy_total_s)
            return PoolSample(now, self.size, 0.0, 0.0, self.size)
        t0, b0 = self._last
        dt = now - t0
        if dt <= 0:
            return PoolSample(now, self.size, 0.0, 0.0, self.size)
        self._last = (now, busy_total_s)
        demand = max(0.0, busy_total_s - b0) / dt
        frac = min(1.0, demand / self.size)
        want = math.ceil(demand / self.target_util - 1e-9) if demand > 0 else 0
        # A backlog alone is a burst the pool drains in a moment; it adds threads only when the pool is
        # also measurably busy, so bursty low-volume work keeps the pool small.
        if frac > self.grow_above or (queued > 2 * self.size and frac > self.shrink_below):
            self.size = min(self.max, max(self.size + 1, want))
            self._low_since = None
        elif frac < self.shrink_below:
            if self._low_since is None:
                self._low_since = now
            if now - self._low_since >= self.shrink_after_s:
                self.size = max(self.min, min(self.size - 1, max(want, self.min)))
                self._low_since = now
        else:
            self._low_since = None
        return PoolSample(now, self.size, frac, demand, self.size)
