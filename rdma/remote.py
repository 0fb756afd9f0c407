"""RemoteMemory: replicated remote memory on donors found over MQTT.

``RemoteMemory(broker=URL, replicas=2).alloc(nbytes)`` maps ``replicas``
slabs per extent on different donors, chosen by power of two choices over the
free slabs the donors advertise.  A donor lost (its Last Will, an I/O error, a
bad checksum, or an eviction) loses one copy: reads fail over at once and a
background thread maps a new slab elsewhere and copies the data from a
surviving copy.  An evicted slab whose extent has another live copy is handed
back at once (the ack the donor waits for); a sole copy is moved first.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import uuid
import weakref
from typing import Any

from nodesvc.bus.rpc import CommandError
from rdma import wire
from rdma.buffer import RemoteBuffer
from rdma.control import ControlPlane
from rdma.dataplane import DataPlane
from rdma.endpoint import Endpoint
from rdma.errors import RemoteMemoryError
from rdma.placement import DonorView, NoDonorError, choose_one, place_replicas
from rdma.region import DEFAULT_POLICY, DEFAULT_UNIT, RegionBuffer, RemoteRegion, check_geometry
from rdma.replica import EVICTING, LIVE, LOST, REBUILDING, Extent, Replica, ReplicaState

log = logging.getLogger("dlshare.rdma")

# The failures of a copy that may mean its donor is gone (the connection failed, timed out, or was
# closed): the donor is pinged, and counted dead if it does not answer.  Any other status (a bad
# token, a checksum mismatch) comes from a donor that answered: that slab is given back.
_DONOR_MAY_BE_GONE = (wire.E_IO, wire.E_TIMEOUT, wire.E_CLOSED)


def _replica(node: str, res: dict, slab: dict, initial: ReplicaState = LIVE) -> Replica:
    """A replica from a donor's map reply; a token must be 16 bytes (it is read as such in C)."""
    token = bytes.fromhex(slab["token"])
    if len(token) != 16:
        raise ValueError(f"token of {len(token)} bytes")
    return Replica(node, str(res["addr"]), int(slab["slab"]), token, int(res["slab_bytes"]), initial)


class RemoteMemory:
    """Replicated remote memory from the donors on ``broker``.

    ``replicas``: copies of every extent, on different donors (2 survives the loss of
    any one donor).  ``consumer_id``: the borrower's name in donors' telemetry
    (default: ``$DLSHARE_NODE_ID``, else random).  ``checksums``: keep the CRC-32C of
    every page written and check every page read against it.  ``io_timeout_s``:
    how long one data-plane call may wait before its donor counts as lost.
    ``lease_s``: donors take this consumer's slabs back if it stops renewing for
    that long (it renews every third of it), so a consumer that dies leaks nothing.
    ``rebuild_bytes_per_s``: the most a rebuild copies a second (0: as fast as the copies
    answer).  A cap leaves more of this node's CPU and network to the job while a lost copy
    is rebuilt, and keeps the extent on fewer copies for longer.

    ``stats`` counts reads served by another copy after one failed (``failover_reads``),
    copies lost and rebuilt, evictions, bytes copied by rebuilds, donors reported
    offline on the bus whose slab server still answered (``offline_kept``: their
    copies are kept), successful lease renewals (``leases_renewed``), and extents of regions
    that lost every copy and were given a new one for what was resident (``extents_salvaged``).
    """

    def __init__(self, broker: str, replicas: int = 2, consumer_id: str | None = None, checksums: bool = True,
                 page_size: int = 4096, io_timeout_s: float = 5.0, discover_timeout_s: float = 15.0,
                 seed: int | None = None, lease_s: float = 30.0, rebuild_bytes_per_s: float = 0) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        if not 0 <= rebuild_bytes_per_s < float("inf"):  # NaN too
            raise ValueError(f"rebuild_bytes_per_s must be 0 (no cap) or positive, got {rebuild_bytes_per_s!r}")
        self.rebuild_bytes_per_s = float(rebuild_bytes_per_s)
        self.replicas = replicas
        self.checksums = checksums
        self.page_size = page_size
        self.io_timeout_ms = int(io_timeout_s * 1000)
        # Name the borrower after its node (DLSHARE_NODE_ID, as `dlshare node` uses) so that
        # `dlshare status` counts what this node borrows; otherwise a random id.
        self.consumer_id = consumer_id or os.environ.get("DLSHARE_NODE_ID") or f"mem-{uuid.uuid4().hex[:12]}"
        self.rng = random.Random(seed)
        self.stats: dict[str, int] = {"failover_reads": 0, "replicas_lost": 0, "replicas_rebuilt": 0,
                                      "evictions": 0, "bytes_copied": 0, "offline_kept": 0, "leases_renewed": 0,
                                      "extents_salvaged": 0}
        self._dead_nodes: set[str] = set()
        self._buffers: "weakref.WeakSet[RemoteBuffer]" = weakref.WeakSet()
        self._repairs: "queue.Queue[tuple[RemoteBuffer, Extent] | None]" = queue.Queue()
        # what the buffers see of this memory (rdma.buffer.ReplicaIO)
        self.dataplane = DataPlane(replicas, self.io_timeout_ms, self.stats,
                                   on_copy_failed=self._replica_failed, on_release=self._release_buffer)
        self.control = ControlPlane(broker, self.consumer_id, on_offline=self._offline_state,
                                    on_event=self._donor_event, on_online=self._online_state)
        self.control.wait_donors(replicas, discover_timeout_s)
        self._closed = False
        self.repair_retry_s = (0.5, 8.0)  # a failed repair's first retry, and the longest wait between two
        self._repair_lock = threading.Lock()
        self._repair_queued: set[tuple[int, int]] = set()  # (buffer, extent) in the queue
        self._repair_waiting: set[tuple[int, int]] = set()  # with a retry timer pending
        self._repair_tries: dict[tuple[int, int], int] = {}  # failed attempts in a row
        self._repair_thread = threading.Thread(target=self._repair_loop, name="rdma-repair", daemon=True)
        self._repair_thread.start()
        self.lease_s = lease_s
        self._stop_leases = threading.Event()
        self._lease_thread = threading.Thread(target=self._renew_loop, name="rdma-lease", daemon=True)
        self._lease_thread.start()

    # --- allocation ----------------------------------------------------------------------

    def donors(self):
        return self.control.donors()

    def alloc(self, nbytes: int) -> RemoteBuffer:
        """Map enough slabs for ``nbytes`` (rounded up to pages), ``replicas`` copies each.

        Placement is planned for every extent first (two choices per replica over
        the advertised free slabs, counted down as the plan fills), then each
        donor gets one batched ``map`` command, all donors at once.  Positions a
        donor refuses are placed again one by one."""
        buf = RemoteBuffer(self.dataplane, nbytes, self.page_size, self._place(nbytes), self.checksums)
        self._buffers.add(buf)
        return buf

    def map(self, nbytes: int, local_bytes: int, unit: int = DEFAULT_UNIT, policy: str = DEFAULT_POLICY,
            **engine: Any) -> RemoteRegion:
        """A :class:`~rdma.region.RemoteRegion`: one anonymous mapping of ``nbytes`` (rounded up to
        ``unit``) whose pages live on donors, at most ``local_bytes`` of it resident.

        The copies are placed as :meth:`alloc` places a buffer's (and fail over, are rebuilt and
        move on reclaim the same way); the region's C engine moves the data.  ``unit``: bytes a
        fault fetches, a multiple of 4096 (at most 1 MiB) that divides the donors' slab size.
        ``policy``: ``clock``, ``fifo`` or ``random``.  ``engine``: ``fetch_workers`` (half the cores, 2 to 4),
        ``evict_threads``, ``prefetch_bytes`` (0: no sequential prefetch), ``fault_threads`` (2),
        ``spin_us`` (50: how long a fault thread polls for a donor's answer before it sleeps),
        ``move_evict`` (True: a dirty unit leaves by ``UFFDIO_MOVE`` where the kernel has it, Linux 6.8+;
        ``stats()["move_evict"]`` says whether it does)."""
        check_geometry(nbytes, local_bytes, unit, policy)
        size = -(-nbytes // unit) * unit
        extents = self._place(size)
        try:
            buf = RegionBuffer(self.dataplane, size, self.page_size, extents, unit)
        except ValueError:
            self._unmap_many([r for e in extents for r in e.replicas])
            raise
        self._buffers.add(buf)
        try:
            return RemoteRegion(buf, local_bytes, policy, io_timeout_ms=self.io_timeout_ms, **engine)
        except BaseException:
            buf.free()
            raise

    def _place(self, nbytes: int) -> list[Extent]:
        """Extents of slabs for ``nbytes`` (see :meth:`alloc`)."""
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        P = self.page_size
        total_pages = -(-nbytes // P)
        view = {n: d for n, d in self.control.donors().items() if n not in self._dead_nodes}
        plan: list[list[str]] = []
        page = 0
        while page < total_pages:
            try:
                nodes = place_replicas(view, self.replicas, self.rng)
            except NoDonorError:
                nodes = []
            if not nodes:
                break
            for n in nodes:
                d = view[n]
                view[n] = DonorView(d.node, d.addr, d.slab_bytes, d.free_slabs - 1, d.online, d.provider)
            plan.append(nodes)
            page += min(view[n].slab_bytes for n in nodes) // P
        want: dict[str, int] = {}
        for nodes in plan:
            for n in nodes:
                want[n] = want.get(n, 0) + 1
        granted: dict[str, list[Replica]] = {}
        results = self.control.call_many([(n, "map", {"consumer": self.consumer_id, "count": k,
                                                      "lease_s": self.lease_s}) for n, k in want.items()])
        for (n, k), res in zip(want.items(), results):
            if isinstance(res, BaseException):
                log.info("batched map of %d slabs on %s refused: %s", k, n, res)
                granted[n] = []
                continue
            self.control.note_mapped(n, k)
            try:
                granted[n] = [_replica(n, res, x) for x in res["slabs"]]
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("donor %s sent a malformed map reply (%s); not using it", n, exc)
                granted[n] = []
        extents: list[Extent] = []
        page = 0
        try:
            for nodes in plan + [None] * total_pages:  # planned extents, then one by one if short
                if page >= total_pages:
                    break
                reps: list[Replica] = []
                for n in nodes or []:
                    if granted.get(n):
                        reps.append(granted[n].pop())
                while len(reps) < self.replicas:
                    min_bytes = min((r.slab_bytes for r in reps), default=P)
                    reps.append(self._map_slab(exclude={r.node for r in reps}, min_slab_bytes=min_bytes))
                ext_pages = min(min(r.slab_bytes for r in reps) // P, total_pages - page)
                extents.append(Extent(len(extents), page, ext_pages, reps))
                page += ext_pages
        except BaseException:
            self._unmap_many([r for e in extents for r in e.replicas] + [r for v in granted.values() for r in v])
            raise
        leftover = [r for v in granted.values() for r in v]
        if leftover:
            self._unmap_many(leftover)
        return extents

    def _unmap_many(self, reps: list[Replica]) -> None:
        """Give slabs back, one command per donor, all donors at once."""
        by_node: dict[str, list[Replica]] = {}
        for r in reps:
            if r.node not in self._dead_nodes:
                by_node.setdefault(r.node, []).append(r)
        if not by_node:
            return
        calls = [(n, "unmap", {"slabs": [{"slab": r.slab, "token": r.token.hex()} for r in rs]})
                 for n, rs in by_node.items()]
        for (n, _, _), res in zip(calls, self.control.call_many(calls, timeout=5)):
            if isinstance(res, BaseException):
                log.info("unmap on %s: %s", n, res)

    def _map_slab(self, exclude: set[str], min_slab_bytes: int, initial: ReplicaState = LIVE) -> Replica:
        failed: set[str] = set()
        while True:
            donors = self.control.donors()
            for n in self._dead_nodes:
                if n in donors:
                    failed.add(n)
            try:
                node = choose_one(donors, exclude | failed, self.rng, min_slab_bytes)
            except NoDonorError as exc:
                raise MemoryError(f"cannot place a slab: {exc}") from None
            try:
                # a donor counted dead meanwhile (its Last Will, another copy's failure) will not answer
                res = self.control.call(node, "map", {"consumer": self.consumer_id, "lease_s": self.lease_s},
                                        timeout=10, give_up=lambda: node in self._dead_nodes)
            except (CommandError, TimeoutError, ConnectionError) as exc:
                log.info("map on %s refused: %s", node, exc)
                failed.add(node)
                continue
            self.control.note_mapped(node)
            try:
                return _replica(node, res, res, initial)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("donor %s sent a malformed map reply (%s); not using it", node, exc)
                failed.add(node)

    def _unmap(self, rep: Replica, wait: bool = True) -> None:
        args = {"slab": rep.slab, "token": rep.token.hex()}
        try:
            if wait:
                self.control.call(rep.node, "unmap", args, timeout=5)
            else:
                self.control.call_nowait(rep.node, "unmap", args)
        except Exception as exc:  # noqa: BLE001 - a dead donor has nothing to give back
            log.info("unmap of slab %d on %s: %s", rep.slab, rep.node, exc)

    def _release_buffer(self, buf: RemoteBuffer) -> None:
        reps: list[Replica] = []
        for ext in buf.extents:
            with ext.lock:
                reps += [r for r in ext.replicas if r.state is not LOST]
                for r in ext.replicas:
                    r.move(LOST)
                ext.replicas = []
        self._unmap_many(reps)
        self._buffers.discard(buf)

    # --- failed copies ---------------------------------------------------------------------

    def _lose(self, rep: Replica) -> bool:
        """Mark a copy lost; False when it already was.  A copy still being rebuilt held
        no data of its own, so it does not count as a lost replica."""
        was = rep.move(LOST)
        if was is None:
            return False
        if was is not REBUILDING:
            self.stats["replicas_lost"] += 1
        return True

    def _changed(self, buf: RemoteBuffer, ext: Extent) -> None:
        try:
            buf.replicas_changed(ext)
        except Exception:  # noqa: BLE001 - a region closing under us; the repairer must go on
            log.exception("following the copies of extent %d failed", ext.index)

    def _replica_failed(self, buf: RemoteBuffer, ext: Extent, rep: Replica, exc: BaseException) -> None:
        if not self._lose(rep):
            return
        self._changed(buf, ext)
        log.warning("lost copy of extent %d on %s (slab %d): %s", ext.index, rep.node, rep.slab, exc)
        code = getattr(exc, "code", None)
        if rep.node not in self._dead_nodes:  # a donor known gone is not pinged again for each copy
            if code in _DONOR_MAY_BE_GONE or isinstance(exc, ConnectionError):
                self._suspect(rep.node)  # before the repair is queued: it must not place the new copy there
            else:
                self._unmap(rep, wait=False)  # the donor answered: give the bad slab back
        self._queue_repair(buf, ext)

    def _data_plane_alive(self, node: str) -> bool:
        view = self.control.donors().get(node)
        if view is None:
            return False
        try:
            host, _, port = view.addr.rpartition(":")
            with Endpoint(host, int(port), timeout_ms=1000) as ep:
                ep.ping()
            return True
        except (RemoteMemoryError, ConnectionError, OSError):
            return False

    def _suspect(self, node: str) -> None:
        """An I/O error: treat the donor as gone unless it answers a ping."""
        if not self._data_plane_alive(node):
            self._donor_offline(node)

    # --- donor loss and eviction (called from the control thread or I/O paths) -------------

    def _offline_state(self, node: str) -> None:
        """The donor's Last Will (or clean stop) says offline.  A donor that only lost
        the broker still serves its slabs: check the data plane before failing over."""
        if not self._data_plane_alive(node):
            self._donor_offline(node)
        else:
            self.stats["offline_kept"] += 1
            log.warning("donor %s is offline on the bus but its slab server answers: keeping its copies", node)

    def _online_state(self, node: str) -> None:
        if node in self._dead_nodes:
            log.info("donor %s is back: it may take new slabs again", node)
            self._dead_nodes.discard(node)

    def _donor_offline(self, node: str) -> None:
        if node in self._dead_nodes:
            return
        self._dead_nodes.add(node)
        self.control.mark_offline(node)
        log.warning("donor %s lost: failing over its copies", node)
        for buf in list(self._buffers):
            for ext in buf.extents:
                hit = False
                for r in list(ext.replicas):
                    if r.node == node and self._lose(r):
                        hit = True
                if hit:
                    self._changed(buf, ext)
                    self._queue_repair(buf, ext)

    def _donor_event(self, node: str, body: dict[str, Any]) -> None:
        event, slab = body.get("event"), body.get("slab")
        for buf in list(self._buffers):
            for ext in buf.extents:
                rep = next((r for r in list(ext.replicas) if r.node == node and r.slab == slab), None)
                if rep is None:
                    continue
                give_back = False
                if event == "evict":
                    self.stats["evictions"] += 1
                    others = [r for r in list(ext.replicas) if r is not rep and r.state is LIVE]
                    if others or rep.state is REBUILDING:
                        # another copy holds the data: hand this one back now, rebuild in the background
                        give_back = rep.move(LOST) is not None
                    else:
                        rep.move(EVICTING, only_from=LIVE)  # the sole copy: move it first, then hand it back
                elif event == "revoked":
                    rep.move(LOST)
                else:
                    return
                self._changed(buf, ext)  # (before the slab goes: whoever follows the copies stops using it)
                if give_back:
                    self._unmap(rep, wait=False)
                self._queue_repair(buf, ext)
                return

    # --- rebuild ---------------------------------------------------------------------------

    def _queue_repair(self, buf: RemoteBuffer, ext: Extent) -> None:
        """Ask the repairer to look at ``ext``, once: an extent already queued is not queued again."""
        key = (id(buf), ext.index)
        with self._repair_lock:
            if key in self._repair_queued:
                return
            self._repair_queued.add(key)
        self._repairs.put((buf, ext))

    def _retry_repair(self, buf: RemoteBuffer, ext: Extent) -> None:
        key = (id(buf), ext.index)
        with self._repair_lock:
            self._repair_waiting.discard(key)
        self._queue_repair(buf, ext)

    def _repair_loop(self) -> None:
        """One repair at a time.  One that cannot finish (no donor to place on, units on their way) is
        tried again after ``repair_retry_s[0]`` s, twice as long each time up to ``repair_retry_s[1]``,
        with one retry pending per extent however many failures asked for it: an outage costs a few
        attempts and log lines a minute, not two a second for every extent."""
        while True:
            item = self._repairs.get()
            if item is None:
                return
            buf, ext = item
            key = (id(buf), ext.index)
            with self._repair_lock:
                self._repair_queued.discard(key)
            if buf.freed:
                with self._repair_lock:
                    self._repair_tries.pop(key, None)
                continue
            try:
                done = self._repair(buf, ext)
            except Exception:  # the repairer must survive anything one extent throws
                log.exception("repair of extent %d failed", ext.index)
                done = False
            with self._repair_lock:
                if done:
                    self._repair_tries.pop(key, None)
                    continue
                if self._closed or key in self._repair_waiting:
                    continue
                tries = self._repair_tries[key] = self._repair_tries.get(key, 0) + 1
                self._repair_waiting.add(key)
            first, most = self.repair_retry_s
            delay = min(most, first * 2 ** min(tries - 1, 30))  # (an outage of hours: no float overflow)
            timer = threading.Timer(delay, self._retry_repair, args=(buf, ext))
            timer.daemon = True
            timer.start()

    def _repair(self, buf: RemoteBuffer, ext: Extent) -> bool:
        """Bring ext back to ``replicas`` live copies; True when done (or nothing to do)."""
        while not buf.freed:
            with ext.lock:
                ext.replicas = [r for r in ext.replicas if r.state is not LOST]
                live = [r for r in ext.replicas if r.state is LIVE]
                evicting = [r for r in ext.replicas if r.state is EVICTING]
                if len(live) >= self.replicas:
                    released = [r for r in evicting if r.move(LOST) is not None]
                    ext.replicas = [r for r in ext.replicas if r.state is not LOST]
                    # the new copies are followed (a cache's table lists them) before the old slabs go, so
                    # a reader that finds an old one gone finds the table changed too
                    self._changed(buf, ext)
                    for r in released:
                        self._unmap(r, wait=False)
                    return True
                lost_all = not live and not evicting
                exclude = {r.node for r in ext.replicas} | self._dead_nodes
            if lost_all:
                if not self._salvage(buf, ext, exclude):
                    return buf.freed or not buf.keeps_resident
                continue  # the salvaged copy is live: rebuild the others from it
            new = self._place_copy(buf, ext, exclude, REBUILDING, "cannot rebuild extent %d yet")
            if new is None:
                return False
            with ext.lock:
                ext.replicas.append(new)  # from now on writes reach it too
                self._changed(buf, ext)
            copied = buf.rebuild_into(ext, new, self.dataplane.write, self.rebuild_bytes_per_s)
            if copied is None:
                with ext.lock:
                    if new in ext.replicas:
                        ext.replicas.remove(new)
                    new.move(LOST)
                    self._changed(buf, ext)
                self._unmap(new, wait=False)
                return False
            self.stats["bytes_copied"] += copied
            with ext.lock:
                if new in ext.replicas and new.move(LIVE, only_from=REBUILDING) is not None:
                    self.stats["replicas_rebuilt"] += 1
                    log.info("extent %d rebuilt on %s (slab %d)", ext.index, new.node, new.slab)
                self._changed(buf, ext)
        return True

    def _place_copy(self, buf: RemoteBuffer, ext: Extent, exclude: set[str], initial: ReplicaState,
                    why: str) -> Replica | None:
        """A new slab for a copy of ``ext``, off the ``exclude`` nodes; None (logged: ``why`` % index, and
        the reason) when no donor can take it now."""
        try:
            return self._map_slab(exclude, ext.npages * buf.page, initial=initial)
        except MemoryError as exc:
            log.warning(why + ": %s", ext.index, exc)
            return None

    def _salvage(self, buf: RemoteBuffer, ext: Extent, exclude: set[str]) -> bool:
        """Every copy of ``ext`` is gone.  A region still holds its resident units: they go to a new,
        empty copy (their write-backs fill it) and the units that were only on the lost copies stay
        lost.  True once the new copy is live; False to try again later, or for a buffer that keeps
        nothing locally (its data is lost: logged)."""
        if not buf.keeps_resident:
            log.error("extent %d of a buffer has no copy left: its data is lost", ext.index)
            return False
        try:
            kept = buf.salvage(ext, 2 * self.io_timeout_ms / 1000)
        except TimeoutError as exc:
            log.warning("extent %d lost every copy; salvaging what is resident: %s (again later)", ext.index, exc)
            return False
        if kept is None:  # closed meanwhile
            return False
        new = self._place_copy(buf, ext, exclude, LIVE,
                               "extent %d lost every copy; cannot place one for what is resident yet")
        if new is None:
            return False
        with ext.lock:
            stale = [r for r in ext.replicas if r.move(LOST) is not None]  # copies never filled: nothing to read
            ext.replicas = [new]  # empty but live: the kept units reach it by their write-backs
            self._changed(buf, ext)
        for r in stale:
            self._unmap(r, wait=False)
        self.stats["extents_salvaged"] += 1
        log.error("extent %d lost every copy: %d resident units kept on a new copy on %s; the rest is lost",
                  ext.index, kept, new.node)
        return True

    def _renew_loop(self) -> None:
        while not self._stop_leases.wait(self.lease_s / 3):
            nodes = {r.node for b in list(self._buffers) for e in b.extents for r in list(e.replicas)
                     if r.state is not LOST} - self._dead_nodes
            if not nodes:
                continue
            try:
                results = self.control.call_many(
                    [(n, "renew", {"consumer": self.consumer_id, "lease_s": self.lease_s}) for n in sorted(nodes)],
                    timeout=max(1.0, self.lease_s / 3))
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("lease renewal failed")
                continue
            for n, res in zip(sorted(nodes), results):
                if isinstance(res, BaseException):
                    log.warning("renewing the lease on %s failed: %s", n, res)
                else:
                    self.stats["leases_renewed"] += 1

    def wait_healthy(self, buf: RemoteBuffer, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if buf.healthy():
                return True
            time.sleep(0.05)
        return buf.healthy()

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        for buf in list(self._buffers):
            buf.free()
        self._closed = True
        self._stop_leases.set()
        self._repairs.put(None)
        self._repair_thread.join(5)
        self.control.close()
        self.dataplane.close()

    def __enter__(self) -> "RemoteMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
