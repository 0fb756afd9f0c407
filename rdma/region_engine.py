"""The region engine's Python handle: the C pager (csrc/pager*.c) set up, its copy map kept in
step, its calls made safe against a racing close, and its events turned into RemoteMemory's.

:mod:`rdma.region` builds a :class:`~rdma.region.RemoteRegion` on it and passes on its defaults
(the unit and the policy, chosen by `dlshare bench paging`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

import numpy as np

from rdma import wire
from rdma.errors import RemoteMemoryError
from rdma.native import ffi, lib
from rdma.replica import EVICTING, LIVE, LOST, REBUILDING, Extent, Replica

log = logging.getLogger("dlshare.rdma.region")

# Chosen by `dlshare bench paging` (bench/RESULTS.md, "Paging"): the unit and policy sweep.
DEFAULT_UNIT = 4 << 10
DEFAULT_POLICY = "clock"
DEFAULT_FAULT_THREADS = 2  # one may wait on a slow donor while another takes the next fault
# How long a fault thread polls for its donor's answer before it sleeps: a 4 KiB round trip on a fast
# link is shorter than the wake-up of a sleeping thread in a VM (dev runs here: fault p50 34-51 us
# with 50, 69-90 us without); the faulting thread is blocked meanwhile, so the poll costs a core that
# would otherwise idle.  0 turns it off (a machine short of cores).
DEFAULT_SPIN_US = 50
POLICIES = {"fifo": lib.DLS_PAGER_FIFO, "clock": lib.DLS_PAGER_CLOCK, "random": lib.DLS_PAGER_RANDOM}
UNIT_STATES = ("absent", "fetching", "clean", "dirty", "writeback", "evicting", "lost")
_ROLES = {LIVE: lib.DLS_COPY_LIVE, REBUILDING: lib.DLS_COPY_REBUILDING, EVICTING: lib.DLS_COPY_EVICTING}
_STATS = ("faults_missing", "faults_wp", "faults_stale", "faults_inflight", "fetched_units", "zero_units", "fetch_runs",
          "prefetched_units", "evicted_clean", "evicted_dirty", "written_back_units", "writeback_failures",
          "failovers", "copy_failures", "units_lost", "bytes_fetched", "bytes_written", "resident_units",
          "local_units", "budget_waits", "over_budget", "events_dropped", "user_mode_only", "write_protect",
          "fault_ns", "fetch_ns", "install_ns", "reserve_wait_ns", "evict_ns", "demand_runs", "stream_runs",
          "stream_cancelled", "engine_errors", "evicted_moved", "move_evict", "writeback_lock_wait_ns",
          "evictors_idle", "rebuild_resident_bytes")
_CALLS = {lib.DLS_CALL_PROTECT: "write-protecting units for a write-back",
          lib.DLS_CALL_UNPROTECT: "making a unit writable", lib.DLS_CALL_DROP: "MADV_DONTNEED of evicted units",
          lib.DLS_CALL_WAKE: "waking threads that wait on units", lib.DLS_CALL_POISON: "poisoning lost units",
          lib.DLS_CALL_QUEUE: "queueing units (out of memory)", lib.DLS_CALL_UNMAP: "unmapping the region at close",
          lib.DLS_CALL_THREAD: "starting a fetch worker or evictor",
          lib.DLS_CALL_REINSTALL: "putting back a unit moved out for its write-back"}


def default_fetch_workers() -> int:
    """Half the machine's cores, between 2 and 4: on 2 cores, 4 workers beside the program, the fault
    threads and the donors cost more in wake-ups than they gain (dev runs of the stream bench: 0.7 GB/s
    with 4, 0.9-1.1 with 2)."""
    return min(4, max(2, (os.cpu_count() or 2) // 2))


class Engine:
    """The C engine's handle.  Calls may race close() (the C side returns at once); free() waits
    until no call is in flight, as rdma.endpoint.Endpoint does."""

    def __init__(self, nbytes: int, unit: int, local_bytes: int, policy: str, nextents: int,
                 fetch_workers: int, evict_threads: int, prefetch_bytes: int, io_timeout_ms: int,
                 fault_threads: int = 2, spin_us: int = 0, move_evict: bool = True) -> None:
        cfg = ffi.new("dls_pager_config *", {
            "nbytes": nbytes, "unit": unit, "local_bytes": local_bytes, "policy": POLICIES[policy],
            "fetch_workers": fetch_workers, "evict_threads": evict_threads, "prefetch_bytes": prefetch_bytes,
            "io_timeout_ms": io_timeout_ms, "nextents": nextents, "fault_threads": fault_threads,
            "spin_us": spin_us, "no_move": int(not move_evict)})
        err, out = ffi.new("char[512]"), ffi.new("dls_pager **")
        rc = lib.dls_pager_create(cfg, out, err, 512)
        if rc:
            raise OSError(-rc, f"region of {nbytes} bytes: {ffi.string(err).decode()}")
        p = out[0]
        self._p = p
        self.unit = unit
        self.nbytes = nbytes
        self.address = int(ffi.cast("uintptr_t", lib.dls_pager_base(p)))
        self.lost: list[tuple[int, int]] = []  # (first unit, count), from the engine's events
        # (what, errno, first unit, count): system calls of the engine that failed, from its events
        self.errors: list[tuple[str, int, int, int]] = []
        self._ep_ids: dict[str, int] = {}
        self._ep_addrs: dict[int, str] = {}
        self._mu = threading.Lock()
        self._users = 0
        self.closed = False
        self._free_pending = False

    # --- calls ----------------------------------------------------------------------------------

    def _enter(self, closed_ok: bool = False):
        with self._mu:
            if self._p is None or (self.closed and not closed_ok):
                raise ValueError("the region is closed")
            self._users += 1
            return self._p

    def _leave(self) -> None:
        with self._mu:
            self._users -= 1
            if self._free_pending and self._users == 0:
                self._release()

    def endpoint(self, addr: str) -> int:
        ep = self._ep_ids.get(addr)
        if ep is None:
            host, _, port = addr.rpartition(":")
            p = self._enter(closed_ok=True)
            try:
                ep = lib.dls_pager_endpoint(p, host.encode(), int(port))
            finally:
                self._leave()
            if ep < 0:
                raise RemoteMemoryError(ep, f"region endpoint {addr}")
            self._ep_ids[addr] = ep
            self._ep_addrs[ep] = addr
        return ep

    def addr_of(self, ep: int) -> str | None:
        return self._ep_addrs.get(ep)

    def sync(self, ext: Extent) -> None:
        """Hand the engine ext's copies as they are now (the caller holds ext.lock)."""
        reps = [r for r in list(ext.replicas) if r.state is not LOST]
        if len(reps) > lib.DLS_PAGER_MAX_COPIES:
            raise ValueError(f"extent {ext.index} has {len(reps)} copies; the engine takes at most "
                             f"{lib.DLS_PAGER_MAX_COPIES}")
        eps = ffi.new("int32_t[]", [self.endpoint(r.addr) for r in reps] or [0])
        slabs = ffi.new("uint32_t[]", [r.slab for r in reps] or [0])
        tokens = ffi.new("uint8_t[]", b"".join(r.token for r in reps) or bytes(16))
        roles = ffi.new("uint8_t[]", [_ROLES[r.state] for r in reps] or [0])
        first = ext.first_page * 4096 // self.unit
        n = ext.npages * 4096 // self.unit
        p = self._enter(closed_ok=True)
        try:
            rc = lib.dls_pager_set_extent(p, ext.index, first, n, len(reps), eps, slabs, tokens, roles)
        finally:
            self._leave()
        if rc:
            raise RemoteMemoryError(rc, f"copy map of extent {ext.index}")

    def copies(self, index: int) -> list[dict[str, Any]]:
        """The engine's own copy map of extent ``index``: what its reads and write-backs use."""
        n = lib.DLS_PAGER_MAX_COPIES
        eps, slabs = ffi.new("int32_t[]", n), ffi.new("uint32_t[]", n)
        roles, failed = ffi.new("uint8_t[]", n), ffi.new("uint8_t[]", n)
        p = self._enter(closed_ok=True)
        try:
            got = lib.dls_pager_extent_copies(p, index, eps, slabs, roles, failed, n)
        finally:
            self._leave()
        if got < 0:
            raise IndexError(f"extent {index} outside the region")
        names = {v: k.value for k, v in _ROLES.items()}
        return [{"addr": self.addr_of(eps[i]), "slab": int(slabs[i]), "role": names[roles[i]],
                 "failed": bool(failed[i])} for i in range(min(got, n))]

    def set_install_delay(self, us: int, streams_only: bool = False) -> None:
        """Tests only: pause ``us`` between mapping fetched units in and settling their states (it
        widens a window that must stay invisible to the threads that faulted on them); with
        ``streams_only``, only in the fetch workers' stream runs (it holds a stream's queue back)."""
        p = self._enter()
        try:
            lib.dls_pager_set_install_delay(p, int(us), int(streams_only))
        finally:
            self._leave()

    def start(self) -> None:
        err = ffi.new("char[256]")
        p = self._enter()
        try:
            rc = lib.dls_pager_start(p, err, 256)
        finally:
            self._leave()
        if rc:
            raise OSError(-rc, f"region engine: {ffi.string(err).decode()}")

    def prefetch(self, units: np.ndarray, write: bool, timeout_ms: int) -> int:
        units = np.ascontiguousarray(units, dtype=np.uint64)
        p = self._enter()
        try:
            rc = lib.dls_pager_prefetch(p, ffi.cast("uint64_t *", ffi.from_buffer(units)), len(units),
                                        int(write), int(timeout_ms))
        finally:
            self._leave()
        if rc == -errno.EINVAL:
            raise IndexError("unit outside the region")
        if rc == -errno.ESHUTDOWN:
            raise ValueError("the region is closed")
        if rc < 0:
            raise OSError(-rc, "region prefetch")
        return int(rc)

    def flush(self) -> int:
        p = self._enter()
        try:
            rc = int(lib.dls_pager_flush(p))
        finally:
            self._leave()
        if rc == -errno.ESHUTDOWN:
            raise ValueError("the region is closed")
        if rc < 0:
            raise OSError(-rc, "region flush")
        return rc

    def copy_extent(self, ext: Extent, new: Replica, bytes_per_s: float = 0) -> int | None:
        ep = self.endpoint(new.addr)
        try:
            p = self._enter()
        except ValueError:
            return None
        try:
            rate = max(1, int(bytes_per_s)) if bytes_per_s > 0 else 0  # 0: no cap
            rc = lib.dls_pager_copy_extent(p, ext.index, ep, new.slab, new.token, rate)
        finally:
            self._leave()
        if rc:
            log.warning("rebuilding extent %d on %s: %s", ext.index, new.node, wire.status_name(rc))
            return None
        return ext.npages * 4096

    def salvage_extent(self, ext: Extent, timeout_ms: int) -> int | None:
        """Ready ``ext``, whose every copy is gone, for an empty new copy: the units it had on no copy
        are lost now, the resident ones wait dirty for their write-back (csrc/pager.h).  The resident
        units kept, or None once closed; TimeoutError while units are on their way or a copy is still
        durable (try again later)."""
        try:
            p = self._enter()
        except ValueError:
            return None
        try:
            rc = int(lib.dls_pager_salvage_extent(p, ext.index, timeout_ms))
        finally:
            self._leave()
        if rc in (-errno.EAGAIN, -errno.EBUSY):
            raise TimeoutError("units still on their way" if rc == -errno.EAGAIN else "a copy is still durable")
        return None if rc < 0 else rc

    def next_event(self, ev, timeout_ms: int) -> int:
        """1 and an event in ``ev``, 0 after ``timeout_ms``, -1 once closed with no event left."""
        try:
            p = self._enter(closed_ok=True)
        except ValueError:
            return -1
        try:
            rc = int(lib.dls_pager_next_event(p, ev, timeout_ms))
        finally:
            self._leave()
        return 1 if rc == 0 else 0 if rc == -errno.EAGAIN else -1

    def stats(self) -> dict[str, int]:
        st = ffi.new("dls_pager_stats *")
        p = self._enter(closed_ok=True)
        try:
            lib.dls_pager_get_stats(p, st)
        finally:
            self._leave()
        return {k: int(getattr(st, k)) for k in _STATS}

    def lost_in(self, first: int, n: int) -> int:
        p = self._enter(closed_ok=True)
        try:
            return int(lib.dls_pager_lost_in(p, first, n))
        finally:
            self._leave()

    def unit_state(self, unit: int) -> str:
        p = self._enter(closed_ok=True)
        try:
            s = lib.dls_pager_unit_state(p, unit)
        finally:
            self._leave()
        if s < 0:
            raise IndexError(f"unit {unit} outside the region")
        return UNIT_STATES[s]

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._mu:
            if self.closed or self._p is None:
                return
            self.closed = True
            self._users += 1
        try:
            lib.dls_pager_close(self._p)  # joins the engine's threads; racing calls return at once
        finally:
            self._leave()

    def free(self) -> None:
        """Close, then release the address range and the engine once no call is in flight."""
        self.close()
        with self._mu:
            self._free_pending = True
            if self._users == 0:
                self._release()

    def _release(self) -> None:  # under _mu
        if self._p is not None:
            lib.dls_pager_free(self._p)
            self._p = None


def event_loop(engine: Engine, buf: Any) -> None:
    """The engine's events, on their own thread: a failed copy goes to RemoteMemory (which marks it
    lost, suspects its donor and rebuilds); lost units are logged and remembered."""
    ev = ffi.new("dls_pager_event *")
    while True:
        rc = engine.next_event(ev, 500)
        if rc < 0:
            return
        if rc == 0:
            continue
        try:
            if ev.kind == lib.DLS_EV_COPY_FAILED and ev.extent < len(buf.extents):
                ext = buf.extents[ev.extent]
                addr = engine.addr_of(ev.endpoint)
                rep = next((r for r in list(ext.replicas) if r.addr == addr and r.slab == ev.slab), None)
                if rep is not None and not buf.freed:
                    buf.io.copy_failed(buf, ext, rep, RemoteMemoryError(
                        ev.code, f"region copy of extent {ev.extent} on {rep.node} (slab {rep.slab})"))
            elif ev.kind == lib.DLS_EV_ENGINE_ERROR:
                what = _CALLS.get(ev.call, f"call {ev.call}")
                engine.errors.append((what, -int(ev.code), int(ev.unit), int(ev.count)))
                log.error("region engine: %s failed (%s) on units %d..%d", what, os.strerror(-ev.code), ev.unit,
                          ev.unit + max(int(ev.count), 1) - 1)
            elif ev.kind == lib.DLS_EV_UNITS_LOST:
                engine.lost.append((int(ev.unit), int(ev.count)))
                log.error("units %d..%d of a region are lost: every copy is gone (%s); touching them is SIGBUS",
                          ev.unit, ev.unit + ev.count - 1, wire.status_name(ev.code))
        except Exception:  # noqa: BLE001 - the loop must outlive one bad event
            log.exception("handling a region event failed")
