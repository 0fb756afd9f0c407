"""The live loop's own figures, for ``GET /v1/stats`` and the benchmark (pure: no I/O).

Each series keeps its latest samples (a bounded window) and reports p50/p99:

* ``telemetry_seen_ms``: a node published telemetry -> the loop folded it in;
* ``telemetry_to_core_ms``: a node published telemetry -> the core handled the
  ``NodeReport`` it became (after the batch was logged);
* ``batch_ms``: the core's pass over one batch, logging included;
* ``loop_lag_ms``: how late the loop's periodic wake-up ran (what a burst of
  HTTP work or a long batch costs everything else on that thread);
* ``round_ms``: each part of the loop's rounds (``stale``, ``batch``, ``account``,
  ``queue``, ``snapshot``), so a long hold of the loop says what held it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 20_000


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Series:
    def __init__(self, window: int = WINDOW) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1

    def summary(self) -> dict[str, Any]:
        xs = list(self.samples)
        p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
        return {"count": self.count, "p50_ms": None if p50 is None else p50 * 1e3,
                "p99_ms": None if p99 is None else p99 * 1e3, "max_ms": max(xs) * 1e3 if xs else None}


class ServiceStats:
    """The series above, plus the last restart's replay and the last snapshot."""

    def __init__(self) -> None:
        self.seen = Series()
        self.to_core = Series()
        self.batch = Series()
        self.loop_lag = Series()
        self.parts: dict[str, Series] = {}
        self.coalesced = 0  # node reports superseded by a newer one before the core saw them
        self.events = 0
        self.batches = 0
        self.refused = 0
        self.restore: dict[str, Any] = {}
        self.snapshot: dict[str, Any] = {}

    def telemetry_seen(self, seconds: float) -> None:
        self.seen.add(max(0.0, seconds))

    def telemetry_to_core(self, seconds: float) -> None:
        self.to_core.add(max(0.0, seconds))

    def part(self, name: str, seconds: float) -> None:
        self.parts.setdefault(name, Series(2_000)).add(seconds)

    def to_json(self) -> dict[str, Any]:
        return {"round_ms": {k: v.summary() for k, v in self.parts.items()}, "reports_coalesced": self.coalesced,
                "telemetry_seen_ms": self.seen.summary(), "telemetry_to_core_ms": self.to_core.summary(),
                "batch_ms": self.batch.summary(), "loop_lag_ms": self.loop_lag.summary(), "events": self.events,
                "batches": self.batches, "restore": self.restore, "snapshot": self.snapshot}
