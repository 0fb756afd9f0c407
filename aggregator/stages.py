"""Per-stage timestamps of reductions, for timelines (``Client(trace=True)``, ``agg.trace_file``).

A step's time beyond its bandwidth bound is latency: stages that do not overlap.  To see
which, both ends record wall-clock times (``time.time()``, comparable across the processes
and network namespaces of one machine) of every stage of every chunk:

- the client, per reduction (a DDP bucket): handed over (``ready``), each chunk's push
  started and done (its bytes in the socket), each result's first and last byte, and the
  future completed;
- the server, per chunk: each rank's header and payload in, the sum started and done, and
  each result's send done.

Recording is off unless asked for; when on it costs a few clock reads per chunk.  Both logs
are bounded (the oldest records go first).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Hashable

__all__ = ["ServerStages", "summarise_op"]


def summarise_op(rnd: int, key: int, nbytes: int, ready: float, done: float,
                 units: list[tuple[str, list[float]]]) -> dict[str, Any]:
    """One reduction's record from its chunks' ``(server, [push0, push1, pull0, pull1])``.

    Times are absolute (seconds since the epoch); a stage a chunk never reached is 0."""
    def span(idx: int, pick) -> float:
        vals = [t[idx] for _, t in units if t[idx]]
        return pick(vals) if vals else 0.0

    per: dict[str, list[float]] = {}
    for srv, t in units:
        p = per.setdefault(srv, [0.0, 0.0, 0.0, 0.0])
        for i, pick in ((0, min), (1, max), (2, min), (3, max)):
            if t[i]:
                p[i] = pick(p[i], t[i]) if p[i] else t[i]
    return {"round": rnd, "key": key, "bytes": nbytes, "chunks": len(units), "ready": ready, "done": done,
            "push_first": span(0, min), "push_first_done": span(1, min), "push_last": span(1, max),
            "pull_first": span(2, min), "pull_last": span(3, max),
            "servers": {s: [round(x, 6) for x in v] for s, v in sorted(per.items())},
            "chunk_times": [[s, *[round(x, 6) for x in t]] for s, t in units]}


class ServerStages:
    """A server's per-chunk stage log: ``(job, round, key, chunk)`` -> arrivals, sum, sends."""

    def __init__(self, max_units: int = 100_000) -> None:
        self._open: dict[tuple, dict[str, Any]] = {}
        self._done: deque[dict[str, Any]] = deque(maxlen=max_units)
        self._max_open = max_units
        self._lock = threading.Lock()

    def _rec(self, job: str, unit: tuple[int, int, int]) -> dict[str, Any]:
        k = (job, *unit)
        r = self._open.get(k)
        if r is None:
            if len(self._open) >= self._max_open:  # units of failed rounds are never closed
                self._open.pop(next(iter(self._open)))
            r = self._open[k] = {"job": job, "round": unit[0], "key": unit[1], "chunk": unit[2], "arrived": {},
                                 "sum": (0.0, 0.0), "sent": [], "targets": 0}
        return r

    def arrived(self, job: str, unit: tuple[int, int, int], rank: int, header_t: float, payload_t: float) -> None:
        with self._lock:
            self._rec(job, unit)["arrived"][rank] = (header_t, payload_t)

    def summed(self, job: str, unit: tuple[int, int, int], t0: float, t1: float, targets: int) -> None:
        with self._lock:
            r = self._rec(job, unit)
            r["sum"], r["targets"] = (t0, t1), targets
            self._close_if_done(job, unit, r)

    def sent(self, job: str, unit: tuple[int, int, int], rank: int, t: float | None = None) -> None:
        with self._lock:
            r = self._rec(job, unit)
            r["sent"].append((rank, time.time() if t is None else t))
            self._close_if_done(job, unit, r)

    def _close_if_done(self, job: str, unit: tuple[int, int, int], r: dict[str, Any]) -> None:
        if r["sum"][1] and len(r["sent"]) >= r["targets"]:
            self._open.pop((job, *unit), None)
            self._done.append(r)

    def records(self, job: Hashable | None = None) -> list[dict[str, Any]]:
        with self._lock:
            done = [r for r in self._done if job is None or r["job"] == job]
        # rounded and JSON-shaped here, not on the data path
        return [dict(r, arrived={str(k): [round(a, 6), round(b, 6)] for k, (a, b) in r["arrived"].items()},
                     sum=[round(t, 6) for t in r["sum"]], sent=[[k, round(t, 6)] for k, t in r["sent"]])
                for r in done]
