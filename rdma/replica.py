"""Replicas and extents: where the copies of a buffer's pages live, and what state each copy is in.

An extent is a run of a buffer's pages held by one slab on each of several
donors; each such slab is a :class:`Replica`.  A replica starts LIVE (mapped
with its buffer) or REBUILDING (mapped to replace a lost copy), and its state
changes only through :meth:`Replica.move`, which allows these transitions:

==========  ============================================================
from        to
==========  ============================================================
LIVE        EVICTING (its donor wants it back and no other copy is live),
            LOST (an I/O error, a bad checksum, its donor lost, freed)
REBUILDING  LIVE (filled from a live copy), LOST
EVICTING    LOST (moved elsewhere, or its donor took it back)
LOST        nothing: it is final
==========  ============================================================
"""

from __future__ import annotations

import enum
import threading
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np


class ReplicaState(enum.Enum):
    LIVE = "live"              # holds the data; reads and writes use it
    REBUILDING = "rebuilding"  # being filled from a live copy; writes reach it, reads do not
    EVICTING = "evicting"      # its donor wants it back: read only when no live copy is left
    LOST = "lost"              # gone for good; the repairer drops it from its extent


LIVE, REBUILDING, EVICTING, LOST = ReplicaState.LIVE, ReplicaState.REBUILDING, ReplicaState.EVICTING, ReplicaState.LOST

_MOVES: dict[ReplicaState, frozenset[ReplicaState]] = {
    LIVE: frozenset({EVICTING, LOST}),
    REBUILDING: frozenset({LIVE, LOST}),
    EVICTING: frozenset({LOST}),
    LOST: frozenset(),
}

# One short lock for every state change.  It is never held while taking another
# lock, so a copy can be marked lost from any thread, even one inside an extent lock.
_STATE_LOCK = threading.Lock()


@dataclass(eq=False)
class Replica:
    node: str
    addr: str
    slab: int
    token: bytes
    slab_bytes: int
    initial: InitVar[ReplicaState] = LIVE

    def __post_init__(self, initial: ReplicaState) -> None:
        if initial not in (LIVE, REBUILDING):
            raise ValueError(f"a replica starts live or rebuilding, not {initial}")
        self._state = initial

    @property
    def state(self) -> ReplicaState:
        return self._state

    def move(self, to: ReplicaState, only_from: ReplicaState | None = None) -> ReplicaState | None:
        """Change the state to ``to``; returns the state it left, or None when it did not move:
        the copy is already LOST (LOST is final), or it is not in ``only_from``.

        Raises ValueError for a transition the diagram above does not allow."""
        with _STATE_LOCK:
            old = self._state
            if old is LOST or (only_from is not None and old is not only_from):
                return None
            if to not in _MOVES[old]:
                raise ValueError(f"replica of slab {self.slab} on {self.node}: no move from {old.value} to {to.value}")
            self._state = to
            return old

    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "slab": self.slab, "state": self._state.value}


@dataclass(eq=False)
class Extent:
    index: int
    first_page: int
    npages: int
    replicas: list[Replica] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def readable(self) -> list[Replica]:
        """Copies a read may use, best first: live ones, then ones being evicted."""
        reps = list(self.replicas)
        return [r for r in reps if r.state is LIVE] + [r for r in reps if r.state is EVICTING]

    def writable(self) -> list[Replica]:
        return [r for r in list(self.replicas) if r.state is not LOST]

    def live_count(self) -> int:
        return sum(r.state is LIVE for r in list(self.replicas))

    def segments(self, pages: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets in the slab, lengths) of whole pages of this extent, for one batched call."""
        offs = (pages - self.first_page).astype(np.uint64) * np.uint64(page_size)
        lens = np.full(len(pages), page_size, dtype=np.uint32)
        return offs, lens
