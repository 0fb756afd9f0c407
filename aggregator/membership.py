"""Which rounds of a job a server serves: the join barrier and the drain hand-off (pure, no I/O).

Failover needs every rank of a job to route a given chunk to the same server,
with no message between the ranks.  A rank stops using a server the moment it
loses it, and finishes or retries elsewhere what it had sent there; the hard
part is agreeing when to use a server *again*.  The server decides:

- Each rank's HELLO carries ``next_round``, the first round it has not started,
  and the rank starts no round from there on until the server answers.
- When every rank of the job has said HELLO, the server answers all of them
  with ``JOINED {"from_round": R}``, ``R = max(next_round)``.  Every rank has
  started only rounds below its own ``next_round <= R``, and sends those
  elsewhere; every round from ``R`` on comes here.  The same rule joins a
  fresh job (all ranks say 0) and a server that comes back.
- A barrier that does not fill within the timeout is abandoned (an error and a
  close to the ranks that joined), so they keep routing around this server and
  try again later.

Draining is the reverse: a rank that has nothing left below the drain's
``from_round`` on a draining server says ``DRAINED``; once every rank of every
job has (or left) and no reduction is in flight, the move is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

ConnId = Hashable


@dataclass(frozen=True)
class DrainAck:
    """A rank has nothing left below its job's drain round on this server."""

    stimulus_id: str
    now: float
    conn: ConnId


@dataclass
class _Waiting:
    conn: ConnId
    next_round: int
    since: float


@dataclass
class _Barrier:
    world: int
    ranks: dict[int, _Waiting] = field(default_factory=dict)

    def since(self) -> float:
        return min(w.since for w in self.ranks.values())


@dataclass(frozen=True)
class JoinAbandoned:
    job: str
    conns: tuple  # (rank, conn) of the ranks that had joined
    missing: tuple  # ranks that never said HELLO
    waited_s: float


class JoinBarrier:
    """Per job: the ranks waiting to join, or the round the job joined from."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._waiting: dict[str, _Barrier] = {}
        self._joined: dict[str, int] = {}

    def joined_from(self, job: str) -> int | None:
        return self._joined.get(job)

    def waiting(self, job: str) -> list[int]:
        b = self._waiting.get(job)
        return sorted(b.ranks) if b else []

    def hello(self, job: str, world: int, rank: int, conn: ConnId, next_round: int,
              now: float) -> list[tuple[int, ConnId, int]]:
        """A rank asks to join; returns ``(rank, conn, from_round)`` for each rank to tell now."""
        r = self._joined.get(job)
        if r is not None:
            # The job already runs here (a rank reconnected): it joins from no earlier than it asked.
            return [(rank, conn, max(r, next_round))]
        b = self._waiting.get(job)
        if b is None or b.world != world:
            b = self._waiting[job] = _Barrier(world)
        b.ranks[rank] = _Waiting(conn, next_round, now)
        if len(b.ranks) < world:
            return []
        del self._waiting[job]
        start = max(w.next_round for w in b.ranks.values())
        self._joined[job] = start
        return [(rk, w.conn, start) for rk, w in sorted(b.ranks.items())]

    def lost(self, job: str, rank: int, conn: ConnId) -> None:
        b = self._waiting.get(job)
        if b is not None and rank in b.ranks and b.ranks[rank].conn == conn:
            del b.ranks[rank]
            if not b.ranks:
                del self._waiting[job]

    def forget(self, job: str) -> None:
        self._waiting.pop(job, None)
        self._joined.pop(job, None)

    def expired(self, now: float) -> list[JoinAbandoned]:
        out = []
        for job, b in list(self._waiting.items()):
            waited = now - b.since()
            if waited >= self.timeout_s:
                del self._waiting[job]
                out.append(JoinAbandoned(job, tuple((r, w.conn) for r, w in sorted(b.ranks.items())),
                                         tuple(r for r in range(b.world) if r not in b.ranks), waited))
        return out


class DrainProgress:
    """Which ranks of which jobs still have work below the drain round on this server."""

    def __init__(self) -> None:
        self._done: dict[str, set[int]] = {}

    def ack(self, job: str, rank: int) -> None:
        self._done.setdefault(job, set()).add(rank)

    def forget(self, job: str) -> None:
        self._done.pop(job, None)

    def ranks_left(self, jobs: dict[str, tuple[int, set[int]]]) -> dict[str, list[int]]:
        """``jobs``: name -> (world, connected ranks).  A rank that left has nothing left here."""
        out = {}
        for name, (_world, ranks) in jobs.items():
            left = sorted(ranks - self._done.get(name, set()))
            if left:
                out[name] = left
        return out
