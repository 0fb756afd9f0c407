"""The donor side of remote memory: a node-daemon extension that lends idle DRAM as slabs.

Lendable memory is MemAvailable minus a headroom, minus what local jobs were
promised and have not used yet (MemAvailable already excludes what they use)
unless ``donor.lend_reserved`` is true: then that reserved-but-unused memory,
the data-preparation over-allocation dlshare exists to lend, is lent too, and
reclaim gives it back when a job grows into its reservation.  It is carved into slabs (``donor.slab_bytes``) that consumers map
with the ``map`` command and give back with ``unmap``; the bytes move through
the C slab server (rdma.slab_server.SlabServer), never through Python.  A slab's
memory is mmapped when it is mapped and munmapped when it comes back, so a free
slab costs nothing and a returned one really goes back to the OS.

Commands (on the node's ``.../cmd`` topic):

- ``map {consumer, count?=1, lease_s?}`` -> ``{addr, provider, slab_bytes, slabs: [{slab, token}], slab, token}``
  (all ``count`` slabs or none; ``token`` is 128 random bits, hex);
- ``unmap {slab, token}`` or ``unmap {slabs: [{slab, token}, ...]}`` (all valid or none released);
- ``renew {consumer, lease_s}``: a consumer that mapped with ``lease_s`` must renew, or
  its slabs are taken back (a consumer that died leaks nothing);
- ``reclaim {bytes?, pause_s?}``: take memory back now (operators, tests); ``pause_s``
  also stops lending for that long;
- ``donor_status {}``: slabs, server counters, statistics.

Reclaim (nodesvc.reclaim) watches PSI and MemAvailable and evicts the least
recently used slabs: it notifies their consumers on ``.../events``
(``{"event": "evict", "slab", "consumer", "deadline_s", "reason", "addr"}``, QoS 1)
and unmaps when they ack (``unmap``) or when the deadline passes
(``{"event": "revoked", ...}``).

Run standalone for tests and development with
``python -m nodesvc.daemon.donor_shell --broker URL --node-id ID``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from nodesvc.bus import config, messages
from nodesvc.bus.ids import stimulus_id
from nodesvc.extension import NodeContext
from nodesvc.bus.messages import PayloadError
from nodesvc.reclaim import (
    ForceUnmap,
    Lease,
    MapGranted,
    MapRefused,
    MapRequested,
    NotifyEvict,
    PressureSample,
    ReclaimCore,
    ReclaimRequested,
    RenewRequested,
    Renewed,
    SlabAccessed,
    SlabLent,
    SlabReturned,
)

log = logging.getLogger("dlshare.donor")

GIB = 1 << 30
# Bounds of the commands' numbers: every one is finite, so 1e308 s or 10**30 bytes is refused.
MAX_LEASE_S = 7 * 86400.0   # consumers renew every few seconds; a lease over a week is a unit mistake
MAX_PAUSE_S = 86400.0       # a drain for maintenance: a day at most (send it again to extend)
MAX_RECLAIM_BYTES = 1 << 50  # 1 PiB: more than any node's memory

config.register_section("donor", {
    "slab_bytes": GIB,             # DESIGN.md: 1 GiB slabs (Infiniswap's slab size); tests use small ones
    "headroom_bytes": 2 * GIB,     # never lend the last 2 GiB of MemAvailable
    "lend_reserved": True,         # lend memory local jobs reserved but do not use (reclaim returns it)
    "listen": "127.0.0.1",         # address of the C slab server
    "port": 0,                     # 0: any free port
    "advertise": "",               # host consumers connect to (default: listen)
    "threads": 2,                  # slab-server worker threads
    "max_connections": 4096,       # slab-server connections (never above RLIMIT_NOFILE - 64)
    "max_connections_per_peer": 256,  # from one peer address
    "idle_timeout_s": 60.0,        # a connection with no valid token is closed this long after it opened
    "frame_timeout_s": 10.0,       # an incomplete request, or unread responses, this long: closed
    "max_slabs": 256,
    "psi_threshold": 10.0,         # PSI memory some avg10 (%) that starts reclaim
    "reclaim_deadline_s": 2.0,     # time a consumer gets to move an evicted slab
    "pressure_interval_s": 0.5,
    "hugepages": False,
    "mlock": False,
    "provider": "tcp",
})


def read_pressure() -> tuple[int, float | None]:
    """(MemAvailable bytes, PSI memory ``some avg10`` or None where the kernel lacks PSI)."""
    avail = psutil.virtual_memory().available
    psi = None
    try:
        with open("/proc/pressure/memory") as fh:
            for line in fh:
                if line.startswith("some "):
                    for part in line.split()[1:]:
                        k, _, v = part.partition("=")
                        if k == "avg10":
                            psi = float(v)
    except (OSError, ValueError):
        psi = None
    return avail, psi


@dataclass
class Slab:
    """What the shell holds for a lent slab: its memory and its token (the lease is the core's)."""

    token: bytes
    memory: Any  # rdma.slab_memory.SlabMemory: the mmapped bytes the slab server serves


@dataclass
class DonorStats:
    maps: int = 0
    unmaps: int = 0
    evictions: int = 0
    forced_unmaps: int = 0
    refused_maps: int = 0
    last_reclaim_s: float | None = None
    reclaim_started: dict[int, float] = field(default_factory=dict)


class DonorExtension:
    """NodeExtension (nodesvc/extension.py) that lends memory; loaded when ``node.lend`` is true."""

    name = "donor"

    def __init__(self, cfg: dict[str, dict[str, Any]],
                 pressure: Callable[[], tuple[int, float | None]] = read_pressure,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if "donor" not in cfg:
            # The config was loaded before this module registered its section (the
            # daemon imports it lazily): read the section again from the same layers
            # that can be reached from here (DLSHARE_CONFIG file and environment).
            log.warning("config has no [donor] section yet; reading it from DLSHARE_CONFIG and the environment")
            d = config.load(env=os.environ)["donor"]
        else:
            d = cfg["donor"]
        self.cfg = d
        self.slab_bytes = int(d["slab_bytes"])
        if self.slab_bytes <= 0 or self.slab_bytes % 4096:
            raise config.ConfigError("donor.slab_bytes must be a positive multiple of 4096")
        self.headroom = int(d["headroom_bytes"])
        self.lend_reserved = bool(d["lend_reserved"])
        self.max_slabs = int(d["max_slabs"])
        self.pressure = pressure
        self.clock = clock
        self.core = ReclaimCore(self.headroom, float(d["psi_threshold"]), float(d["reclaim_deadline_s"]),
                                slab_bytes=self.slab_bytes, max_slabs=self.max_slabs, lend_reserved=self.lend_reserved)
        self.slabs: dict[int, Slab] = {}
        self.stats = DonorStats()
        self.server = None
        self.ctx: NodeContext | None = None
        self._slab_ids = itertools.count(0)
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.addr = ""

    @property
    def leases(self) -> dict[int, Lease]:
        """The slabs lent, as the core records them."""
        return self.core.leases

    # --- NodeExtension -------------------------------------------------------------------

    async def start(self, ctx: NodeContext) -> None:
        from rdma.slab_server import SlabServer

        self.ctx = ctx
        c = self.cfg
        self.server = SlabServer(c["listen"], int(c["port"]), int(c["threads"]), int(c["max_connections"]),
                                 float(c["idle_timeout_s"]), float(c["frame_timeout_s"]),
                                 int(c["max_connections_per_peer"]))
        host = self.cfg["advertise"] or self.cfg["listen"]
        self.addr = f"{host}:{self.server.port}"
        log.info("lending memory: slab server on %s, %d-byte slabs", self.addr, self.slab_bytes)
        self._task = asyncio.create_task(self._reclaim_loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # a cancel of stop() itself propagates
        if self.server:
            self.server.stop()
        for slab in list(self.slabs.values()):
            slab.memory.release()
        self.slabs.clear()
        self.core.leases.clear()

    def commands(self) -> dict[str, Callable]:
        return {"map": self.cmd_map, "unmap": self.cmd_unmap, "renew": self.cmd_renew, "reclaim": self.cmd_reclaim,
                "donor_status": self.cmd_status}

    def telemetry(self) -> dict[str, Any]:
        lendable = self.lendable_bytes()
        lent = len(self.leases)
        total = lent + self.core.slabs_available(self.clock(), lendable)
        return {
            "enabled": True,
            "addr": self.addr,
            "provider": self.cfg["provider"],
            "slab_bytes": self.slab_bytes,
            "total_slabs": total,
            "free_slabs": total - lent,
            "lent_bytes": lent * self.slab_bytes,
            "lendable_bytes": lendable,
            "reserved_unused_bytes": self._ctx_bytes("reserved_unused_bytes"),
            "lent_to": self.core.lent_to(),
            "evicting": self.core.evicting,
            "last_reclaim_s": self.stats.last_reclaim_s,
            # Counters since the daemon started (Prometheus: dlshare_donor_*_total).
            "maps": self.stats.maps, "refused_maps": self.stats.refused_maps,
            "evictions": self.stats.evictions, "forced_unmaps": self.stats.forced_unmaps,
        }

    # --- memory accounting ---------------------------------------------------------------

    def _ctx_bytes(self, name: str) -> int:
        """Promised / reserved-but-unused bytes, from the daemon when it offers them."""
        fn = getattr(self.ctx, name, None)
        try:
            return int(fn()) if callable(fn) else 0
        except Exception:  # noqa: BLE001 - accounting must not break lending
            log.exception("reading %s from the daemon failed", name)
            return 0

    def _written(self) -> dict[int, int]:
        """Bytes written into each lent slab (the slab server's counters)."""
        out = {}
        for slab in list(self.slabs):
            st = self.server.slab_stats(slab) if self.server is not None else None
            out[slab] = st.bytes_written if st else 0
        return out

    def lendable_bytes(self) -> int:
        avail, _ = self.pressure()
        return self.core.lendable_bytes(avail, self._ctx_bytes("reserved_unused_bytes"), self._written())

    # --- commands ------------------------------------------------------------------------

    async def cmd_map(self, args: dict[str, Any]) -> dict[str, Any]:
        """Lend ``count`` slabs (default 1) to ``consumer``: all of them or none."""
        from rdma.slab_memory import SlabMemory
        from rdma.slab_token import random_token

        consumer = messages.check_id(messages.arg(args, "consumer", str), "consumer id")
        count = messages.bounded(args, "count", 1, 1024, int, required=False, default=1)
        lease_s = messages.bounded(args, "lease_s", 0.0, MAX_LEASE_S, required=False, default=0.0)
        granted: list[tuple[int, bytes, Any]] = []
        async with self._lock:
            avail, _ = self.pressure()
            (decision,) = self.core.handle(MapRequested(
                self._sid("map"), self.clock(), consumer, count, avail, self._ctx_bytes("reserved_unused_bytes"),
                tuple(self._written().items())))
            if isinstance(decision, MapRefused):
                self.stats.refused_maps += 1
                raise PayloadError(decision.reason)
            assert isinstance(decision, MapGranted)
            try:
                for _ in range(decision.count):
                    slab = self._next_slab_id()
                    region = SlabMemory(self.slab_bytes, huge=bool(self.cfg["hugepages"]), lock=bool(self.cfg["mlock"]))
                    token = random_token()
                    try:
                        self.server.add_slab(slab, region, token, self.slab_bytes)
                    except Exception:
                        region.release()
                        raise
                    self.slabs[slab] = Slab(token, region)
                    granted.append((slab, token, region))
            except Exception:
                for slab, _, _ in granted:
                    self._release(slab, "map failed", count_unmap=False)
                raise
            for slab, _, _ in granted:
                self.stats.maps += 1
                self.core.handle(SlabLent(decision.stimulus_id, self.clock(), slab, consumer, self.slab_bytes,
                                          lease_s))
        region = granted[0][2]
        if region.reason:
            log.warning("slabs of %s: %s", consumer, region.reason)
        slabs = [{"slab": slab, "token": token.hex()} for slab, token, _ in granted]
        return {"addr": self.addr, "provider": self.cfg["provider"], "slab_bytes": self.slab_bytes,
                "huge": region.huge, "locked": region.locked, "slabs": slabs, **slabs[0]}

    def _next_slab_id(self) -> int:
        from rdma.native import lib

        for _ in range(lib.DLS_MAX_SLAB_ID):
            sid = next(self._slab_ids) % lib.DLS_MAX_SLAB_ID
            if sid not in self.slabs:
                return sid
        raise PayloadError("slab ids exhausted")

    async def cmd_unmap(self, args: dict[str, Any]) -> dict[str, Any]:
        """Take back ``slab`` (with its ``token``), or each of ``slabs: [{slab, token}, ...]``."""
        if "slabs" in args:
            items = messages.arg(args, "slabs", list)
            if not all(isinstance(x, dict) for x in items):
                raise PayloadError("'slabs' must be a list of {slab, token} objects")
        else:
            items = [args]
        checked = []
        for item in items:
            slab = messages.bounded(item, "slab", 0, (1 << 16) - 1, int)
            token = messages.arg(item, "token", str)
            held = self.slabs.get(slab)
            if held is None:
                raise PayloadError(f"slab {slab} is not lent")
            try:
                ok = bytes.fromhex(token) == held.token
            except ValueError:
                ok = False
            if not ok:
                raise PayloadError(f"wrong token for slab {slab}")
            checked.append(slab)
        for slab in checked:  # all were valid: release them all
            self._release(slab, "returned by consumer")
        return {"released": checked, "slab": checked[0] if len(checked) == 1 else None}

    async def cmd_renew(self, args: dict[str, Any]) -> dict[str, Any]:
        """Extend ``consumer``'s lease by ``lease_s``; answers how many slabs it holds here."""
        consumer = messages.check_id(messages.arg(args, "consumer", str), "consumer id")
        lease_s = messages.bounded(args, "lease_s", 0.0, MAX_LEASE_S)
        if lease_s <= 0:
            raise PayloadError("'lease_s' must be positive")
        (answer,) = self.core.handle(RenewRequested(self._sid("renew"), self.clock(), consumer, lease_s))
        assert isinstance(answer, Renewed)
        return {"slabs": list(answer.slabs)}

    async def cmd_reclaim(self, args: dict[str, Any]) -> dict[str, Any]:
        """Take ``bytes`` back now; ``pause_s`` also stops lending for that long (a drain)."""
        nbytes = messages.bounded(args, "bytes", 1, MAX_RECLAIM_BYTES, int, required=False, default=self.slab_bytes)
        pause = messages.bounded(args, "pause_s", 0.0, MAX_PAUSE_S, required=False, default=0.0)
        decisions = self.core.handle(ReclaimRequested(self._sid("reclaim"), self.clock(), nbytes, pause))
        await self._execute(decisions)
        return {"evicting": [d.slab for d in decisions if isinstance(d, NotifyEvict)]}

    async def cmd_status(self, args: dict[str, Any]) -> dict[str, Any]:
        slabs = []
        for lease in self.leases.values():
            st = self.server.slab_stats(lease.slab) if self.server else None
            slabs.append({"slab": lease.slab, "consumer": lease.consumer, "bytes": lease.nbytes,
                          "evicting": lease.evicting, "reads": st.reads if st else 0,
                          "writes": st.writes if st else 0})
        return {"slabs": slabs, "server": self.server.counters() if self.server else {},
                "stats": {k: v for k, v in vars(self.stats).items() if k != "reclaim_started"}}

    # --- reclaim shell -------------------------------------------------------------------

    def _sid(self, what: str) -> str:
        return stimulus_id(f"donor:{what}")

    def _release(self, slab: int, why: str, count_unmap: bool = True) -> None:
        held = self.slabs.pop(slab, None)
        if held is None:
            return
        lease = self.core.leases.get(slab)
        self.server.remove_slab(slab)  # waits until no request touches it
        held.memory.release()          # munmap: the memory goes back to the OS now
        self.stats.unmaps += count_unmap
        started = self.stats.reclaim_started.pop(slab, None)
        if started is not None:
            self.stats.last_reclaim_s = self.clock() - started
        self.core.handle(SlabReturned(self._sid("unmap"), self.clock(), slab))
        log.info("slab %d of %s released (%s)", slab, lease.consumer if lease else "?", why)

    async def _execute(self, decisions) -> None:
        for d in decisions:
            if isinstance(d, NotifyEvict):
                if d.slab not in self.slabs:
                    continue
                self.stats.evictions += 1
                self.stats.reclaim_started[d.slab] = self.clock()
                log.info("evicting slab %d of %s: %s", d.slab, d.consumer, d.reason)
                await self._event({"event": "evict", "slab": d.slab, "consumer": d.consumer,
                                   "deadline_s": d.deadline_s, "reason": d.reason, "addr": self.addr})
            elif isinstance(d, ForceUnmap):
                if d.slab in self.slabs:
                    self.stats.forced_unmaps += 1
                    self._release(d.slab, d.reason)
                    await self._event({"event": "revoked", "slab": d.slab, "consumer": d.consumer,
                                       "reason": d.reason, "addr": self.addr})

    async def _event(self, body: dict[str, Any]) -> None:
        if self.ctx is None:
            return
        topic = messages.node_topic(self.ctx.node_id, "events")
        if not await self.ctx.publish(topic, messages.encode(body), qos=1):
            log.warning("could not publish %s event (broker away)", body.get("event"))

    def sample(self) -> list:
        """Feed one round of observations to the core (slab activity, pressure, time, the broker)."""
        now = self.clock()
        avail, psi = self.pressure()
        out = []
        mono_now_ns = None
        for slab in list(self.slabs):
            st = self.server.slab_stats(slab)
            if st and st.last_access_ns:
                if mono_now_ns is None:
                    from rdma.clock import monotonic_ns
                    mono_now_ns = monotonic_ns()
                age = (mono_now_ns - st.last_access_ns) / 1e9
                out += self.core.handle(SlabAccessed(self._sid("access"), now, slab, now - age))
        # Renewals travel over the broker: the core lets no lease expire while it is away.
        connected = self.ctx is None or self.ctx.connected is None or self.ctx.connected()
        out += self.core.handle(PressureSample(self._sid("pressure"), now, avail, psi, connected))
        return out

    async def _reclaim_loop(self) -> None:
        interval = float(self.cfg["pressure_interval_s"])
        while True:
            try:
                await self._execute(self.sample())
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad round
                log.exception("reclaim round failed")
            await asyncio.sleep(interval)

