"""RemoteRegion: remote memory that programs use without an API.

``RemoteMemory.map(nbytes, local_bytes=...)`` returns a region: one anonymous
mapping whose pages live on donors, at most ``local_bytes`` of it resident.
``region.array(dtype, shape)`` is a numpy array and ``region.tensor(dtype,
shape)`` a CPU torch tensor over the mapping, with no copy: code that takes an
array needs no change.

The C engine (csrc/pager*.c) does the work without Python: a userfaultfd fault
thread, fetch workers and evictors; :mod:`rdma.region_engine` is its handle and
keeps its defaults.  This module only sets it up, keeps its
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

import os
import threading
import weakref
from typing import Any

import numpy as np

from rdma import wire
from rdma.buffer import DataLostError, RemoteBuffer, ReplicaIO
from rdma.errors import RemoteMemoryError
from rdma.native import lib
from rdma.region_engine import (DEFAULT_FAULT_THREADS, DEFAULT_POLICY, DEFAULT_SPIN_US, DEFAULT_UNIT, POLICIES,
                                Engine, default_fetch_workers, event_loop)
from rdma.replica import Extent, Replica

__all__ = ["DEFAULT_POLICY", "DEFAULT_UNIT", "RegionBuffer", "RemoteRegion", "check_geometry"]


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

    keeps_resident = True

    def __init__(self, io: ReplicaIO, nbytes: int, page_size: int, extents: list[Extent], unit: int) -> None:
        if unit < 4096 or unit % 4096 or unit > lib.DLS_PAGER_MAX_UNIT:
            raise ValueError(f"unit must be a multiple of 4096 bytes, at most 1 MiB, got {unit}")
        for e in extents:
            if (e.first_page * page_size) % unit or (e.npages * page_size) % unit:
                raise ValueError(f"the donors' slabs ({e.npages * page_size} bytes for extent {e.index}) are "
                                 f"not a multiple of the unit ({unit} bytes): pick a unit that divides them")
        super().__init__(io, nbytes, page_size, extents, checksums=False)  # the engine keeps unit CRCs
        self.unit = unit
        self.engine: Engine | None = None

    def replicas_changed(self, ext: Extent) -> None:
        if self.engine is not None and not self.engine.closed:  # a closed engine moves nothing any more
            with ext.lock:
                self.engine.sync(ext)

    def rebuild_into(self, ext: Extent, new: Replica, write_copy, bytes_per_s: float = 0) -> int | None:
        if self.engine is None:
            return None
        return self.engine.copy_extent(ext, new, bytes_per_s)

    def salvage(self, ext: Extent, timeout_s: float) -> int | None:
        if self.engine is None:
            return None
        return self.engine.salvage_extent(ext, max(0, int(timeout_s * 1000)))

    def free(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().free()

    def _no_bytes(self, *a, **kw):
        raise TypeError("a region's bytes are reached through its mapping (region.array/tensor/read/write)")

    read = write = read_pages = write_pages = _no_bytes


class _View:
    """What a numpy array over the mapping keeps as its base: it holds the region, so the
    mapping outlives every array and tensor made from it."""

    def __init__(self, region: "RemoteRegion", address: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._region = region
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": dtype.str,
                                    "descr": dtype.descr, "version": 3}


def _close(buf: RegionBuffer, owned: Any) -> None:
    try:
        buf.free()  # closes the engine first, then gives the slabs back
    finally:
        if owned is not None:
            owned.close()


def _finish(engine: Engine, buf: RegionBuffer, owned: Any, pid: int) -> None:
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
        self._engine = Engine(self.nbytes, self.unit, max(self.local_bytes, 4 * self.unit), policy,
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
        self._events = threading.Thread(target=event_loop, args=(self._engine, buf), name="rdma-region-events",
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
