"""Donor reclaim: a pure state machine that decides which lent slabs to take back.

Events start with an id (``stimulus_id``) and a time ``now`` (seconds, any
monotonic clock the shell chooses); the core keeps no clock of its own.  Each
decision carries the ``stimulus_id`` of the event that caused it.  Decisions tell
the shell to notify a consumer that a slab is being evicted (with a deadline to
move its data), or to unmap a slab whose deadline passed.

Policy (DESIGN.md, "Reclaim"): the node is under pressure when PSI memory
``some avg10`` exceeds a threshold or MemAvailable falls under the headroom.
Slabs are evicted least recently accessed first, until the shortfall is
covered (PSI alone asks for one slab per cooldown, since avg10 lags).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PressureSample:
    stimulus_id: str
    now: float
    mem_available: int
    psi_some_avg10: float | None = None


@dataclass(frozen=True)
class SlabLent:
    stimulus_id: str
    now: float
    slab: int
    consumer: str
    nbytes: int


@dataclass(frozen=True)
class SlabAccessed:
    stimulus_id: str
    now: float
    slab: int
    last_access: float  # same clock as now


@dataclass(frozen=True)
class SlabReturned:
    """The consumer unmapped the slab (its ack), or the shell unmapped it."""

    stimulus_id: str
    now: float
    slab: int


@dataclass(frozen=True)
class ReclaimRequested:
    """An operator (or a test) asks for ``nbytes`` back now."""

    stimulus_id: str
    now: float
    nbytes: int


@dataclass(frozen=True)
class Tick:
    """Time passed: slabs whose eviction deadline is over are unmapped."""

    stimulus_id: str
    now: float


Event = PressureSample | SlabLent | SlabAccessed | SlabReturned | ReclaimRequested | Tick


@dataclass(frozen=True)
class NotifyEvict:
    slab: int
    consumer: str
    deadline_s: float
    reason: str
    stimulus_id: str


@dataclass(frozen=True)
class ForceUnmap:
    slab: int
    consumer: str
    reason: str
    stimulus_id: str


Decision = NotifyEvict | ForceUnmap


@dataclass
class _Lease:
    slab: int
    consumer: str
    nbytes: int
    last_access: float
    evict_deadline: float | None = None


@dataclass
class ReclaimCore:
    headroom_bytes: int
    psi_threshold: float
    deadline_s: float
    psi_cooldown_s: float = 10.0  # PSI avg10 is a 10 s average: give an eviction time to show
    leases: dict[int, _Lease] = field(default_factory=dict)
    last_psi_evict: float = float("-inf")
    log: list[tuple[str, str]] = field(default_factory=list)  # (stimulus_id, what) for replay/debug

    def handle(self, ev: Event) -> list[Decision]:
        if isinstance(ev, SlabLent):
            self.leases[ev.slab] = _Lease(ev.slab, ev.consumer, ev.nbytes, ev.now)
            return []
        if isinstance(ev, SlabAccessed):
            lease = self.leases.get(ev.slab)
            if lease and ev.last_access > lease.last_access:
                lease.last_access = ev.last_access
            return []
        if isinstance(ev, SlabReturned):
            self.leases.pop(ev.slab, None)
            return []
        if isinstance(ev, ReclaimRequested):
            return self._evict(ev.nbytes, ev.now, "requested", ev.stimulus_id)
        if isinstance(ev, PressureSample):
            return self._pressure(ev)
        if isinstance(ev, Tick):
            return self._expire(ev)
        raise TypeError(f"unknown event {type(ev).__name__}")

    @property
    def evicting(self) -> list[int]:
        return sorted(s for s, lease in self.leases.items() if lease.evict_deadline is not None)

    def _pressure(self, ev: PressureSample) -> list[Decision]:
        shortfall = self.headroom_bytes - ev.mem_available
        out: list[Decision] = []
        if shortfall > 0:
            out += self._evict(shortfall, ev.now, f"MemAvailable {ev.mem_available} under headroom "
                                                f"{self.headroom_bytes}", ev.stimulus_id)
        psi = ev.psi_some_avg10
        if psi is not None and psi > self.psi_threshold and ev.now - self.last_psi_evict >= self.psi_cooldown_s:
            if not out and not self.evicting:
                out += self._evict(1, ev.now, f"PSI some avg10 {psi:.1f} > {self.psi_threshold:.1f}",
                                   ev.stimulus_id)
            if out:
                self.last_psi_evict = ev.now
        out += self._expire(Tick(ev.stimulus_id, ev.now))
        return out

    def _evict(self, nbytes: int, now: float, reason: str, sid: str) -> list[Decision]:
        """Notify the least recently used slabs until ``nbytes`` (beyond what is already going) is covered."""
        pending = sum(lease.nbytes for lease in self.leases.values() if lease.evict_deadline is not None)
        need = nbytes - pending
        out: list[Decision] = []
        for lease in sorted((x for x in self.leases.values() if x.evict_deadline is None),
                            key=lambda x: (x.last_access, x.slab)):
            if need <= 0:
                break
            lease.evict_deadline = now + self.deadline_s
            need -= lease.nbytes
            out.append(NotifyEvict(lease.slab, lease.consumer, self.deadline_s, reason, sid))
            self.log.append((sid, f"evict {lease.slab} ({reason})"))
        return out

    def _expire(self, ev: Tick) -> list[Decision]:
        out: list[Decision] = []
        for lease in sorted(self.leases.values(), key=lambda x: x.slab):
            if lease.evict_deadline is not None and ev.now >= lease.evict_deadline:
                out.append(ForceUnmap(lease.slab, lease.consumer, "eviction deadline passed", ev.stimulus_id))
                self.log.append((ev.stimulus_id, f"unmap {lease.slab} after deadline"))
                del self.leases[lease.slab]
        return out


@dataclass
class LeaseBook:
    """Consumer leases (pure): a consumer that maps with a lease must renew it, or the
    donor takes its slabs back.  This is what returns memory whose consumer died
    without unmapping.  Times come from the caller's clock."""

    expiry: dict[str, float] = field(default_factory=dict)
    ttl: dict[str, float] = field(default_factory=dict)

    def renew(self, consumer: str, now: float, ttl_s: float) -> None:
        self.expiry[consumer] = max(self.expiry.get(consumer, float("-inf")), now + ttl_s)
        self.ttl[consumer] = ttl_s

    def touch(self, consumer: str, now: float) -> None:
        """Data-plane use at time ``now`` renews too: a consumer reading and writing its slabs is alive,
        even if its renewals (over MQTT) do not get through."""
        if consumer in self.expiry:
            self.expiry[consumer] = max(self.expiry[consumer], now + self.ttl[consumer])

    def grace(self, now: float) -> None:
        """Every consumer gets a full lease from ``now``: after the donor was cut off from the
        broker, nobody's renewals could arrive, so none may expire for that."""
        for c in self.expiry:
            self.expiry[c] = max(self.expiry[c], now + self.ttl[c])

    def expired(self, now: float) -> list[str]:
        """Consumers whose lease ran out (they are forgotten)."""
        gone = sorted(c for c, until in self.expiry.items() if now >= until)
        for c in gone:
            del self.expiry[c]
            self.ttl.pop(c, None)
        return gone

    def forget(self, consumer: str) -> None:
        self.expiry.pop(consumer, None)
        self.ttl.pop(consumer, None)
