"""The donor's policy: a pure state machine that decides what to lend, to whom, and what to take back.

Events start with an id (``stimulus_id``) and a time ``now`` (seconds, any
monotonic clock the shell chooses); the core keeps no clock of its own.  Each
decision carries the ``stimulus_id`` of the event that caused it.  The core holds
the one record of each lent slab (:class:`Lease`) and of each consumer's lease
(it must renew, or its slabs are taken back).  It decides:

- how much memory is lendable (:meth:`ReclaimCore.lendable_bytes`) and whether a
  ``map`` of ``count`` slabs is admitted (:class:`MapRequested` ->
  :class:`MapGranted` or :class:`MapRefused`: all of them or none);
- which slabs to evict (:class:`NotifyEvict`, with a deadline to move the data) and
  which to unmap (:class:`ForceUnmap`: an eviction deadline passed, or a consumer's
  lease ran out);
- a renewal's answer (:class:`Renewed`: the slabs the consumer holds here).

The shell (nodesvc/daemon/donor.py) owns the memory and the tokens, and carries the
decisions out.

Policy (DESIGN.md, "Reclaim"): the node is under pressure when PSI memory
``some avg10`` exceeds a threshold or MemAvailable falls under the headroom.
Slabs are evicted least recently accessed first, until the shortfall is
covered (PSI alone asks for one slab per cooldown, since avg10 lags).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PressureSample:
    """One round of observations.  ``connected``: whether the donor reaches the broker, over which
    consumers renew: while it does not, no consumer lease may expire, and once it is back every
    consumer gets a full lease from then to renew in."""

    stimulus_id: str
    now: float
    mem_available: int
    psi_some_avg10: float | None = None
    connected: bool = True


@dataclass(frozen=True)
class MapRequested:
    """``consumer`` asks for ``count`` slabs.  The shell observes the memory: ``mem_available``,
    ``reserved_unused`` (promised to local jobs, not used yet) and ``written``: ``(slab, bytes
    written)`` of each lent slab (its server counters)."""

    stimulus_id: str
    now: float
    consumer: str
    count: int
    mem_available: int
    reserved_unused: int = 0
    written: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class SlabLent:
    """The shell mapped a slab that a :class:`MapGranted` admitted.  ``lease_s`` > 0: the
    consumer must renew within that, or loses its slabs."""

    stimulus_id: str
    now: float
    slab: int
    consumer: str
    nbytes: int
    lease_s: float = 0.0


@dataclass(frozen=True)
class SlabAccessed:
    """The slab's last data-plane access.  A consumer reading and writing its slabs is alive even
    if its renewals (over MQTT) do not get through, so this renews its lease too."""

    stimulus_id: str
    now: float
    slab: int
    last_access: float  # same clock as now


@dataclass(frozen=True)
class RenewRequested:
    stimulus_id: str
    now: float
    consumer: str
    lease_s: float


@dataclass(frozen=True)
class SlabReturned:
    """The consumer unmapped the slab (its ack), or the shell unmapped it."""

    stimulus_id: str
    now: float
    slab: int


@dataclass(frozen=True)
class ReclaimRequested:
    """An operator (or a test) asks for ``nbytes`` back now; ``pause_s`` also stops lending for
    that long (a drain)."""

    stimulus_id: str
    now: float
    nbytes: int
    pause_s: float = 0.0


@dataclass(frozen=True)
class Tick:
    """Time passed: slabs whose eviction deadline is over are unmapped."""

    stimulus_id: str
    now: float


Event = (PressureSample | MapRequested | SlabLent | SlabAccessed | RenewRequested | SlabReturned
         | ReclaimRequested | Tick)


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


@dataclass(frozen=True)
class MapGranted:
    """Map ``count`` slabs for ``consumer`` (then tell the core each one with :class:`SlabLent`)."""

    consumer: str
    count: int
    stimulus_id: str


@dataclass(frozen=True)
class MapRefused:
    consumer: str
    reason: str
    stimulus_id: str


@dataclass(frozen=True)
class Renewed:
    """The answer to a renewal: the slabs ``consumer`` holds here (its lease renewed only if any)."""

    consumer: str
    slabs: tuple[int, ...]
    stimulus_id: str


Decision = NotifyEvict | ForceUnmap | MapGranted | MapRefused | Renewed


@dataclass
class LeaseBook:
    """Consumer leases (the core's part): a consumer that maps with a lease must renew it, or the
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


@dataclass
class Lease:
    """The one record of a lent slab."""

    slab: int
    consumer: str
    nbytes: int
    lent_at: float
    last_access: float
    evict_deadline: float | None = None  # set while it is being evicted

    @property
    def evicting(self) -> bool:
        return self.evict_deadline is not None


@dataclass
class ReclaimCore:
    headroom_bytes: int
    psi_threshold: float
    deadline_s: float
    psi_cooldown_s: float = 10.0  # PSI avg10 is a 10 s average: give an eviction time to show
    slab_bytes: int = 1 << 30
    max_slabs: int = 256
    lend_reserved: bool = True  # lend memory local jobs reserved but do not use (reclaim returns it)
    leases: dict[int, Lease] = field(default_factory=dict)
    consumers: LeaseBook = field(default_factory=LeaseBook)
    paused_until: float = float("-inf")
    cut_off: bool = False
    last_psi_evict: float = float("-inf")
    log: list[tuple[str, str]] = field(default_factory=list)  # (stimulus_id, what) for replay/debug

    def handle(self, ev: Event) -> list[Decision]:
        if isinstance(ev, MapRequested):
            return self._map(ev)
        if isinstance(ev, SlabLent):
            self.leases[ev.slab] = Lease(ev.slab, ev.consumer, ev.nbytes, ev.now, ev.now)
            if ev.lease_s > 0:
                self.consumers.renew(ev.consumer, ev.now, ev.lease_s)
            return []
        if isinstance(ev, SlabAccessed):
            lease = self.leases.get(ev.slab)
            if lease and ev.last_access > lease.last_access:
                lease.last_access = ev.last_access
            if lease:
                self.consumers.touch(lease.consumer, ev.last_access)
            return []
        if isinstance(ev, RenewRequested):
            held = self.held(ev.consumer)
            if held:
                self.consumers.renew(ev.consumer, ev.now, ev.lease_s)
            return [Renewed(ev.consumer, tuple(held), ev.stimulus_id)]
        if isinstance(ev, SlabReturned):
            lease = self.leases.pop(ev.slab, None)
            if lease is not None and not self.held(lease.consumer):
                self.consumers.forget(lease.consumer)
            return []
        if isinstance(ev, ReclaimRequested):
            if ev.pause_s > 0:
                self.paused_until = max(self.paused_until, ev.now + ev.pause_s)
            return self._evict(ev.nbytes, ev.now, "requested", ev.stimulus_id)
        if isinstance(ev, PressureSample):
            return self._pressure(ev)
        if isinstance(ev, Tick):
            return self._expire(ev)
        raise TypeError(f"unknown event {type(ev).__name__}")

    # --- queries (pure) -------------------------------------------------------------------

    @property
    def evicting(self) -> list[int]:
        return sorted(s for s, lease in self.leases.items() if lease.evicting)

    def held(self, consumer: str) -> list[int]:
        return sorted(s for s, lease in self.leases.items() if lease.consumer == consumer)

    def lent_to(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lease in self.leases.values():
            out[lease.consumer] = out.get(lease.consumer, 0) + lease.nbytes
        return out

    def untouched_bytes(self, written: dict[int, int]) -> int:
        """Lent memory not written yet.  Slabs are mapped lazily (MAP_NORESERVE), so their pages
        leave MemAvailable only as consumers write them: without this, two consumers could be
        promised the same free memory.  Bytes written count once even if rewritten, so this may
        undercount slightly; reclaim (PSI, MemAvailable under the headroom) covers the rest."""
        return sum(max(0, lease.nbytes - written.get(s, 0)) for s, lease in self.leases.items())

    def lendable_bytes(self, mem_available: int, reserved_unused: int, written: dict[int, int]) -> int:
        """MemAvailable minus the headroom, minus what is lent but not written yet, minus what local
        jobs were promised and have not used (unless ``lend_reserved``: that is the memory dlshare
        exists to lend, and reclaim gives it back when a job grows into its reservation)."""
        kept = 0 if self.lend_reserved else reserved_unused
        return max(0, mem_available - self.headroom_bytes - kept - self.untouched_bytes(written))

    def slabs_available(self, now: float, lendable: int) -> int:
        if now < self.paused_until:
            return 0
        return max(0, min(self.max_slabs - len(self.leases), lendable // self.slab_bytes))

    # --- policy ---------------------------------------------------------------------------

    def _map(self, ev: MapRequested) -> list[Decision]:
        lendable = self.lendable_bytes(ev.mem_available, ev.reserved_unused, dict(ev.written))
        available = self.slabs_available(ev.now, lendable)
        if ev.count < 1 or available < ev.count:
            why = "lending is paused" if ev.now < self.paused_until else f"{available} lendable on this node"
            return [MapRefused(ev.consumer, f"no free slab: {ev.count} asked, {why}", ev.stimulus_id)]
        return [MapGranted(ev.consumer, ev.count, ev.stimulus_id)]

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
        out += self._consumer_leases(ev)
        return out

    def _consumer_leases(self, ev: PressureSample) -> list[Decision]:
        """Take back the slabs of consumers whose lease ran out, but never for renewals that could
        not arrive: not while the donor is cut off from the broker, and with a full lease for every
        consumer once it is back."""
        if not ev.connected:
            self.cut_off = True
            return []
        if self.cut_off:
            self.cut_off = False
            self.consumers.grace(ev.now)
        out: list[Decision] = []
        for consumer in self.consumers.expired(ev.now):
            for slab in self.held(consumer):
                out.append(ForceUnmap(slab, consumer, "consumer lease expired", ev.stimulus_id))
                self.log.append((ev.stimulus_id, f"unmap {slab}: lease of {consumer} expired"))
                del self.leases[slab]
        return out

    def _evict(self, nbytes: int, now: float, reason: str, sid: str) -> list[Decision]:
        """Notify the least recently used slabs until ``nbytes`` (beyond what is already going) is covered."""
        pending = sum(lease.nbytes for lease in self.leases.values() if lease.evicting)
        need = nbytes - pending
        out: list[Decision] = []
        for lease in sorted((x for x in self.leases.values() if not x.evicting),
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
