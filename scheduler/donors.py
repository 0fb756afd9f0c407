"""Lent memory as a cluster resource: :class:`DonorPool`, the core's books of the donors.

A **donor** is a node that reports lendable memory (``Node.lendable_bytes``): a CPU-only
data-preparation node with idle DRAM, or any node whose daemon lends.  Its lendable bytes are the
pool's capacity there.  The core **promises** bytes of that capacity to a job on a node (a
*holder*, ``(job, node)``), which the job then uses as remote memory; a donor that needs its memory
back (a reclaim, or its loss) lowers its capacity, and the core **takes back** the newest promises
first until what it promised fits.  The job keeps running on what is left (see
:mod:`scheduler.remote_memory` for what the bytes are worth).

Each holder also reserves the remote read rate it needs (its *demand*, bytes/s); a donor's bandwidth
is reserved to its borrowers' demands, oldest first (:func:`~scheduler.remote_memory.reserved_shares`):
a newcomer gets what is left, so it never slows an older borrower down.

Pure: no clock, no I/O.  The ledger (:mod:`scheduler.ledger`) owns one and changes it only while it
handles an event.
"""

from __future__ import annotations

from typing import Any

from scheduler.remote_memory import RemoteLink, reserved_shares

Holder = tuple[str, str]  # (job id, the node the job runs on)


class DonorPool:
    """Capacity, promises and reclaims of every donor (see the module docstring)."""

    def __init__(self, link: RemoteLink | None = None) -> None:
        self.link = link or RemoteLink()
        self.capacity: dict[str, int] = {}  # donor -> lendable bytes (0 once lost)
        self.promised: dict[str, dict[Holder, int]] = {}  # donor -> holder -> bytes, oldest first
        self.holds: dict[Holder, dict[str, int]] = {}  # holder -> donor -> bytes
        self.demand: dict[Holder, float] = {}  # holder -> remote read rate it needs (bytes/s)
        self.reclaimed_bytes = 0  # promised bytes taken back from jobs, all donors, so far
        self.freed = False  # bytes came free since the ledger last offered them round

    # ------------------------------------------------------------ reading

    @property
    def active(self) -> bool:
        """Any donor with capacity: otherwise nothing here runs (the core behaves as without donors)."""
        return any(c > 0 for c in self.capacity.values())

    def promised_on(self, donor: str) -> int:
        return sum(self.promised.get(donor, {}).values())

    def free_on(self, donor: str) -> int:
        return max(0, self.capacity.get(donor, 0) - self.promised_on(donor))

    def total_free(self) -> int:
        return sum(self.free_on(d) for d in self.capacity)

    def total_capacity(self) -> int:
        return sum(self.capacity.values())

    def held(self, holder: Holder) -> int:
        return sum(self.holds.get(holder, {}).values())

    def donors_of(self, holder: Holder) -> dict[str, int]:
        return dict(self.holds.get(holder, {}))

    def borrowers(self, donor: str) -> int:
        return len(self.promised.get(donor, {}))

    def supply(self, holder: Holder) -> float:
        """The read rate the holder's donors give it (bytes/s): what is left of the donor's
        bandwidth after the older borrowers' reservations, the least over its donors (no donor:
        the link's rate)."""
        out = self.link.read_bytes_per_s
        for donor in self.holds.get(holder, {}):
            demands = {h: self.demand.get(h, 0.0) for h in self.promised.get(donor, {})}
            out = min(out, reserved_shares(demands, self.link.donor_bytes_per_s).get(holder, out))
        return out

    def share_if_added(self, demand: float) -> float:
        """The read rate a new borrower of ``demand`` bytes/s would get on the donor it would be
        given (the one with the most free bytes): what the older borrowers leave."""
        donor = self._freest()
        if donor is None:
            return 0.0
        demands: dict[Any, float] = {h: self.demand.get(h, 0.0) for h in self.promised.get(donor, {})}
        demands["new"] = demand
        return reserved_shares(demands, self.link.donor_bytes_per_s)["new"]

    def stats(self) -> dict[str, Any]:
        return {"donors": sum(1 for c in self.capacity.values() if c > 0), "capacity_bytes": self.total_capacity(),
                "promised_bytes": sum(self.promised_on(d) for d in self.promised), "free_bytes": self.total_free(),
                "reclaimed_bytes": self.reclaimed_bytes, "borrowers": len(self.holds)}

    # ------------------------------------------------------------ changing

    def _freest(self, exclude: set[str] = frozenset()) -> str | None:
        best = None
        for d in self.capacity:
            if d in exclude or self.free_on(d) <= 0:
                continue
            if best is None or self.free_on(d) > self.free_on(best):
                best = d
        return best

    def set_capacity(self, donor: str, nbytes: int) -> list[Holder]:
        """The donor can lend ``nbytes`` now (0: lost).  Promises beyond it are taken back, newest
        first; returns the holders that lost bytes."""
        if nbytes < 0:
            raise ValueError(f"donor {donor}: lendable bytes must be >= 0, got {nbytes}")
        if nbytes == 0 and donor not in self.capacity:
            return []
        old = self.capacity.get(donor, 0)
        self.capacity[donor] = int(nbytes)
        if nbytes > old:
            self.freed = True
        over = self.promised_on(donor) - self.capacity[donor]
        losers: list[Holder] = []
        prom = self.promised.get(donor, {})
        for holder in reversed(list(prom)):
            if over <= 0:
                break
            take = min(over, prom[holder])
            prom[holder] -= take
            self.holds[holder][donor] -= take
            over -= take
            self.reclaimed_bytes += take
            if prom[holder] == 0:
                del prom[holder]
                del self.holds[holder][donor]
            if not self.holds[holder]:
                del self.holds[holder]
                self.demand.pop(holder, None)
            losers.append(holder)
        return losers

    def grant(self, holder: Holder, nbytes: int, demand: float = 0.0) -> int:
        """Set what ``holder`` holds to ``nbytes`` (or as much of it as is free): it shrinks from
        its newest donor, or grows on the donors with the most free bytes.  Returns what it holds."""
        nbytes = max(0, int(nbytes))
        have = self.held(holder)
        if nbytes < have:  # (not offered round: a job gives back only what it no longer needs)
            mine = self.holds[holder]
            for donor in reversed(list(mine)):
                cut = min(have - nbytes, mine[donor])
                mine[donor] -= cut
                self.promised[donor][holder] -= cut
                have -= cut
                if mine[donor] == 0:
                    del mine[donor]
                    del self.promised[donor][holder]
                if have == nbytes:
                    break
        tried: set[str] = set()
        while have < nbytes:
            donor = self._freest(tried)
            if donor is None:
                break
            tried.add(donor)
            take = min(nbytes - have, self.free_on(donor))
            self.holds.setdefault(holder, {})[donor] = self.holds.get(holder, {}).get(donor, 0) + take
            self.promised.setdefault(donor, {})[holder] = self.promised.get(donor, {}).get(holder, 0) + take
            have += take
        if have == 0:
            self.holds.pop(holder, None)
            self.demand.pop(holder, None)
        else:
            self.demand[holder] = max(0.0, float(demand))
        return have

    def release(self, holder: Holder) -> int:
        """The holder left: its promises are free again.  Returns the bytes freed."""
        return self._drop(holder)

    def _drop(self, holder: Holder) -> int:
        freed = 0
        for donor, n in self.holds.pop(holder, {}).items():
            self.promised.get(donor, {}).pop(holder, None)
            freed += n
        self.demand.pop(holder, None)
        if freed:
            self.freed = True
        return freed
