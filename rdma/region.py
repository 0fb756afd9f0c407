"""RemoteRegion: remote memory that programs use without an API.

``RemoteMemory.map(nbytes, local_bytes=...)`` returns a region: one anonymous
mapping whose pages live on donors, at most ``local_bytes`` of it resident.
``region.array(dtype, shape)`` is a numpy array and ``region.tensor(dtype,
shape)`` a CPU torch tensor over the mapping, with no copy: code that takes an
array needs no change.

The C engine (csrc/pager*.c) does the work without Python: a userfaultfd fault
thread, fetch workers and evictors.  This module only sets it up, keeps its
copy map in step with the copies RemoteMemory places, fails over and rebuilds
(:class:`RegionBuffer` is the RemoteBuffer those see), turns the engine's
events into RemoteMemory's (a copy failed) and into errors (units lost), and
tears it down.

Behaviour a caller can rely on:

- a unit whose every copy is gone is poisoned: touching it is SIGBUS, never
  zeros; :meth:`RemoteRegion.read`, :meth:`~RemoteRegion.write` and
  :meth:`~RemoteRegion.check` raise :class:`~rdma.buffer.DataLostError` instead;
- the mapping is MADV_DONTFORK: a forked child (a DataLoader worker) has no
  mapping at all, so touching it there is SIGSEGV, never unfetched zeros, and
  the region's methods raise in the child; the parent goes on unharmed;
- :meth:`~RemoteRegion.close` frees the memory at once and leaves the address
  range reserved and inaccessible (PROT_NONE) while any array or tensor over it
  lives: a thread that touches it then, or was blocked in a fault on it, gets
  SIGSEGV, never another mapping's bytes.  The range is released when the last
  view is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

from rdma import wire
from rdma.buffer import DataLostError, RemoteBuffer, ReplicaIO
from rdma.native import ffi, lib
from rdma.errors import RemoteMemoryError
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
          "stream_cancelled", "engine_errors", "evicted_moved", "move_evict", "writeback_lock_wait_ns")
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


def check_geometry(nbytes: int, local_bytes: int, unit: int, policy: str) -> None:
    """Refuse a region the engine could not run, with a message that says why."""
    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    if unit < 4096 or unit % 4096 or unit > lib.DLS_PAGER_MAX_UNIT:
        raise ValueError(f"unit must be a multiple of 4096 bytes, at most 1 MiB, got {unit}")
    if local_bytes < 4 * unit:
        raise ValueError(f"local_bytes must hold at least 4 units ({4 * unit} bytes), got {local_bytes}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")


class RegionBuffer(RemoteBuffer):
    """The remote side of a region: RemoteMemory places, fails over and rebuilds its copies as
    for any buffer, while the region's engine moves the data.  So the copy map is the engine's
    too (:meth:`replicas_changed`), a rebuild copies in C under the engine's write-back lock
    (:meth:`rebuild_into`), and byte-level reads and writes go through the mapping, not here."""

    def __init__(self, io: ReplicaIO, nbytes: int, page_size: int, extents: list[Extent], unit: int) -> None:
        if unit < 4096 or unit % 4096 or unit > lib.DLS_PAGER_MAX_UNIT:
            raise ValueError(f"unit must be a multiple of 4096 bytes, at most 1 MiB, got {unit}")
        for e in extents:
            if (e.first_page * page_size) % unit or (e.npages * page_size) % unit:
                raise ValueError(f"the donors' slabs ({e.npages * page_size} bytes for extent {e.index}) are "
                                 f"not a multiple of the unit ({unit} bytes): pick a unit that divides them")
        super().__init__(io, nbytes, page_size, extents, checksums=False)  # the engine keeps unit CRCs
        self.unit = unit
        self.engine: _Engine | None = None

    def replicas_changed(self, ext: Extent) -> None:
        if self.engine is not None and not self.engine.closed:  # a closed engine moves nothing any more
            with ext.lock:
                self.engine.sync(ext)

    def rebuild_into(self, ext: Extent, new: Replica, write_copy) -> int | None:
        if self.engine is None:
            return None
        return self.engine.copy_extent(ext, new)

    def free(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().free()

    def _no_bytes(self, *a, **kw):
        raise TypeError("a region's bytes are reached through its mapping (region.array/tensor/read/write)")

    read = write = read_pages = write_pages = _no_bytes


class _Engine:
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

    def copy_extent(self, ext: Extent, new: Replica) -> int | None:
        ep = self.endpoint(new.addr)
        try:
            p = self._enter()
        except ValueError:
            return None
        try:
            rc = lib.dls_pager_copy_extent(p, ext.index, ep, new.slab, new.token)
        finally:
            self._leave()
        if rc:
            log.warning("rebuilding extent %d on %s: %s", ext.index, new.node, wire.status_name(rc))
            return None
        return ext.npages * 4096

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


class _View:
    """What a numpy array over the mapping keeps as its base: it holds the region, so the
    mapping outlives every array and tensor made from it."""

    def __init__(self, region: "RemoteRegion", address: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._region = region
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": dtype.str,
                                    "descr": dtype.descr, "version": 3}


def _event_loop(engine: _Engine, buf: RegionBuffer) -> None:
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


def _close(buf: RegionBuffer, owned: Any) -> None:
    try:
        buf.free()  # closes the engine first, then gives the slabs back
    finally:
        if owned is not None:
            owned.close()


def _finish(engine: _Engine, buf: RegionBuffer, owned: Any, pid: int) -> None:
    """The region and every view of it are gone: close if that was not done, release the range."""
    if os.getpid() != pid:  # a forked child: the engine, the slabs and the memory are the parent's
        return
    try:
        _close(buf, owned)
    finally:
        engine.free()


class RemoteRegion:
    """``nbytes`` of memory on donors behind one mapping, ``local_bytes`` of it resident at most.

    Made by :meth:`rdma.RemoteMemory.map` or :func:`rdma.region_from_env`.  Thread-safe.
    """

    def __init__(self, buf: RegionBuffer, local_bytes: int, policy: str = DEFAULT_POLICY, *,
                 io_timeout_ms: int = 5000, fetch_workers: int | None = None, evict_threads: int = 1,
                 prefetch_bytes: int = 1 << 20, fault_threads: int = DEFAULT_FAULT_THREADS,
                 spin_us: int = DEFAULT_SPIN_US, move_evict: bool = True, owns: Any = None) -> None:
        check_geometry(buf.nbytes, local_bytes, buf.unit, policy)
        if fetch_workers is None:
            fetch_workers = default_fetch_workers()
        self.unit = buf.unit
        self.nbytes = buf.nbytes
        self.local_bytes = min(int(local_bytes), self.nbytes)
        self.policy = policy
        self._buf = buf
        self._engine = _Engine(self.nbytes, self.unit, max(self.local_bytes, 4 * self.unit), policy,
                               len(buf.extents), fetch_workers, evict_threads, prefetch_bytes, io_timeout_ms,
                               fault_threads, spin_us, move_evict)
        try:
            for ext in buf.extents:
                with ext.lock:
                    self._engine.sync(ext)
            self._engine.start()
        except BaseException:
            self._engine.free()
            raise
        buf.engine = self._engine
        self.address = self._engine.address
        self._pid = os.getpid()
        self._next = 0  # the next free offset for array()/tensor() without one
        self._alloc_mu = threading.Lock()
        self._events = threading.Thread(target=_event_loop, args=(self._engine, buf), name="rdma-region-events",
                                        daemon=True)
        self._events.start()
        self._owns = owns  # a RemoteMemory this region closes with itself (region_from_env's)
        self._finalizer = weakref.finalize(self, _finish, self._engine, buf, owns, self._pid)

    # --- views ------------------------------------------------------------------------------

    def array(self, dtype, shape: int | tuple[int, ...] | None = None, offset: int | None = None) -> np.ndarray:
        """A numpy array over the mapping (no copy).  ``shape`` None: as many items as fit from
        ``offset``.  ``offset`` None: the next free part of the region, starting on a unit boundary
        (so several arrays share a region without sharing units)."""
        self._check()
        dt = np.dtype(dtype)
        if shape is None:  # the rest of the region, from offset or from the next free part
            start = self._next if offset is None else int(offset)
            shape = ((self.nbytes - start) // dt.itemsize,)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        start = self._take(nbytes) if offset is None else int(offset)
        if start < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at offset {start} do not fit a region of {self.nbytes}")
        if start % dt.alignment:
            raise ValueError(f"offset {start} is not aligned for {dt}")
        return np.asarray(_View(self, self.address + start, shape, dt))

    def tensor(self, dtype, shape: int | tuple[int, ...] | None = None, offset: int | None = None):
        """A CPU torch tensor over the mapping (no copy); torch is imported here, on first use."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            start = self._next if offset is None else int(offset)
            shape = ((self.nbytes - start) // itemsize,)
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        count = 1
        for s in shape:
            count *= s
        raw = self.array(np.uint8, count * itemsize, offset=offset)
        if offset is not None and int(offset) % itemsize:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        return torch.from_numpy(raw).view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> int:
        with self._alloc_mu:
            start = self._next
            self._next = start + -(-max(nbytes, 1) // self.unit) * self.unit
            if start + nbytes > self.nbytes:
                self._next = start
                raise MemoryError(f"{nbytes} bytes do not fit: the region has {self.nbytes - start} left")
            return start

    # --- safe access for Python callers --------------------------------------------------------

    def units_of(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"range [{offset}, {offset + nbytes}) outside a region of {self.nbytes} bytes")
        if nbytes == 0:
            return np.empty(0, dtype=np.uint64)
        return np.arange(offset // self.unit, (offset + nbytes - 1) // self.unit + 1, dtype=np.uint64)

    def prefetch(self, offset: int = 0, nbytes: int | None = None, write: bool = False,
                 timeout: float | None = 30.0) -> int:
        """Bring a range in ahead of use; ``write``: it will be written (no write faults follow).
        With a timeout, wait for it: returns how many units are not in (lost, or still coming)."""
        self._check()
        n = self.nbytes - offset if nbytes is None else nbytes
        return self.prefetch_units(self.units_of(offset, n), write, timeout)

    def prefetch_units(self, units, write: bool = False, timeout: float | None = 30.0) -> int:
        return self._engine.prefetch(np.asarray(units, dtype=np.uint64), write,
                                     0 if not timeout else max(1, int(timeout * 1000)))

    def check(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Raise DataLostError when a unit of the range has lost every copy."""
        self._check()
        n = self.nbytes - offset if nbytes is None else nbytes
        units = self.units_of(offset, n)
        if len(units) and self._engine.lost_in(int(units[0]), len(units)):
            lost = [int(u) for u in units if self._engine.unit_state(int(u)) == "lost"]
            raise DataLostError(wire.E_IO, f"{len(lost)} units of the range lost every copy "
                                           f"(first {lost[0] if lost else '?'}); touching them is SIGBUS")

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A copy of ``nbytes`` from ``offset``: DataLostError, not SIGBUS, for lost units."""
        self.prefetch(offset, nbytes)
        self.check(offset, nbytes)
        return np.array(self.array(np.uint8, nbytes, offset=offset))

    def write(self, offset: int, data) -> None:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        self.prefetch(offset, len(src), write=True)
        self.check(offset, len(src))
        self.array(np.uint8, len(src), offset=offset)[:] = src

    def flush(self) -> None:
        """Write every dirty unit back to every copy (they stay resident)."""
        self._check()
        failed = self._engine.flush()
        if failed:
            raise RemoteMemoryError(wire.E_IO, f"{failed} units could not be written to any durable copy "
                                               "(they stay resident and dirty)")

    # --- state -------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return self._engine.stats()

    def unit_state(self, unit: int) -> str:
        return self._engine.unit_state(unit)

    def engine_errors(self) -> list[tuple[str, int, int, int]]:
        """The engine's system calls that failed, oldest first: (what, errno, first unit, count).  The
        units they concern stay correct (each is logged too, and counted in ``stats()["engine_errors"]``)."""
        return list(self._engine.errors)

    def engine_copies(self, extent: int) -> list[dict[str, Any]]:
        """The copies the engine reads and writes for extent ``extent`` (``addr``, ``slab``, ``role``,
        ``failed``): :meth:`placement` is RemoteMemory's view, this is the engine's."""
        return self._engine.copies(extent)

    def healthy(self) -> bool:
        return self._buf.healthy()

    def placement(self) -> list[list[dict[str, Any]]]:
        return self._buf.placement()

    @property
    def buffer(self) -> RegionBuffer:
        return self._buf

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def _check(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("a RemoteRegion does not cross fork(): the child has no mapping (MADV_DONTFORK); "
                               "touching one of its arrays there is SIGSEGV")
        if self._engine.closed:
            raise ValueError("the region is closed")

    def close(self) -> None:
        """Free the region's memory, local and remote.  The address range stays reserved and
        PROT_NONE until the last array or tensor over it is gone (touching one is SIGSEGV)."""
        if os.getpid() != self._pid:
            return
        _close(self._buf, self._owns)
        self._events.join(5)

    def _own(self, memory: Any) -> None:
        """Close ``memory`` (the RemoteMemory that placed this region) with the region."""
        self._finalizer.detach()
        self._owns = memory
        self._finalizer = weakref.finalize(self, _finish, self._engine, self._buf, memory, self._pid)

    def __enter__(self) -> "RemoteRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RemoteRegion({self.nbytes} bytes, local {self.local_bytes}, unit {self.unit}, {self.policy}"
                f"{', closed' if self.closed else ''})")
