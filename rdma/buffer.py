"""RemoteBuffer: a byte range backed by replicated slabs on donors.

A buffer is a run of extents (rdma.replica); each extent is one slab on each
of ``replicas`` donors (different nodes).  Writes go to every copy under the
extent's lock; reads use one live copy and fail over to the next at once.
With checksums on, the consumer keeps the CRC-32C of every page it wrote and
checks each page it reads against it: end to end, not just on the wire.

The buffer reaches its copies only through :class:`ReplicaIO`, which the
memory that placed it provides (RemoteMemory gives a rdma.dataplane.DataPlane).
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from rdma import wire
from rdma.native import crc32c
from rdma.errors import RemoteMemoryError
from rdma.replica import EVICTING, LIVE, REBUILDING, Extent, Replica

log = logging.getLogger("dlshare.rdma")

MAX_SEG = wire.MAX_SEG_BYTES
PARALLEL_MIN = 1 << 20  # below this a batch is not worth handing to other threads
REBUILD_CHUNK = 4 << 20  # bytes per rebuild step: long enough to stream, short enough not to stall writers


def _pace(due: float, stop: Callable[[], bool]) -> bool:
    """A paced rebuild waits after each chunk until ``due`` (time.monotonic; the last chunk too, so
    rebuilds of one extent after another keep to the cap), in slices so that ``stop`` is seen.
    False when ``stop`` said so."""
    while (left := due - time.monotonic()) > 0:
        if stop():
            return False
        time.sleep(min(left, 0.05))
    return not stop()


class DataLostError(RemoteMemoryError):
    """Every copy of some pages is gone."""


class ReplicaIO(Protocol):
    """What a RemoteBuffer needs from the memory that placed its copies, and all it may use.

    Reads and writes raise RemoteMemoryError or ConnectionError; the buffer decides
    what a failure means (fail over, or report the copy with :meth:`copy_failed`)."""

    replicas: int  # live copies each extent should have

    def read(self, rep: Replica, offs: np.ndarray, lens: np.ndarray, dst: np.ndarray,
             checksums: bool) -> np.ndarray | None:
        """Segments (offs, lens) of one copy, back to back into dst; their CRC-32Cs when checksums."""

    def read_page(self, rep: Replica, off: int, n: int, dst: np.ndarray, checksums: bool) -> int:
        """One segment of one copy (the small-read path); its CRC-32C when checksums."""

    def write_all(self, targets: list[Replica], offs: np.ndarray, lens: np.ndarray, src: np.ndarray,
                  checksums: bool) -> list[Any]:
        """The same segments to every copy in targets at once; for each copy, in order, the CRC-32Cs
        of what it was sent (None without checksums) or the exception it raised."""

    def run_parallel(self, calls: list[Callable[[], None]]) -> None:
        """Run the calls (one per extent of a large batch) at once; raise the first error."""

    def copy_failed(self, buf: "RemoteBuffer", ext: Extent, rep: Replica, exc: BaseException) -> None:
        """rep gave an I/O error or wrong bytes: it is lost; rebuild the extent elsewhere."""

    def failed_over(self) -> None:
        """A read was served by another copy after one failed."""

    def release(self, buf: "RemoteBuffer") -> None:
        """Give every slab of buf back to its donor."""


class RemoteBuffer:
    """``nbytes`` of remote memory.  Thread-safe; see RemoteMemory.alloc."""

    # Whether :meth:`salvage` can keep anything of an extent that lost every copy (a region keeps
    # its resident units); RemoteMemory's repair salvages only such buffers.
    keeps_resident = False

    def __init__(self, io: ReplicaIO, nbytes: int, page_size: int, extents: list[Extent],
                 checksums: bool) -> None:
        self.io = io
        self.nbytes = nbytes
        self.page = page_size
        self.extents = extents
        self.npages = sum(e.npages for e in extents)
        self.checksums = checksums
        self._starts = np.array([e.first_page for e in extents], dtype=np.int64)
        self._start_list = [e.first_page for e in extents]
        zero_crc = crc32c(bytes(page_size))  # fresh slabs are zero-filled mmaps
        self.page_crc = np.full(self.npages, zero_crc, dtype=np.uint32) if checksums else None
        self.freed = False
        # Called with the extent whenever its copies change, before a copy that left is given back
        # to its donor (a sample cache republishes its copy table from it).  It must not block.
        self.on_replicas_changed: Callable[[Extent], None] | None = None

    # --- public API ----------------------------------------------------------------------

    def __len__(self) -> int:
        return self.nbytes

    def read(self, offset: int, n: int, out=None) -> np.ndarray:
        """``n`` bytes from ``offset`` into ``out`` (a writable buffer; a new uint8 array if None)."""
        self._check_range(offset, n)
        dst = np.empty(n, dtype=np.uint8) if out is None else _as_u8(out, writable=True)
        if len(dst) < n:
            raise ValueError(f"out holds {len(dst)} bytes, {n} asked")
        if n == 0:
            return dst
        p0, p1 = offset // self.page, (offset + n - 1) // self.page
        if p0 == p1 and offset % self.page == 0 and n == self.page:
            self._read_page(p0, dst)
        elif p0 == p1:
            tmp = np.empty(self.page, dtype=np.uint8)
            self._read_page(p0, tmp)
            s = offset - p0 * self.page
            dst[:n] = tmp[s:s + n]
        elif offset % self.page == 0 and n % self.page == 0:
            self._read_run(p0, p1 - p0 + 1, dst[:n])
        else:
            tmp = np.empty((p1 - p0 + 1) * self.page, dtype=np.uint8)
            self._read_run(p0, p1 - p0 + 1, tmp)
            s = offset - p0 * self.page
            dst[:n] = tmp[s:s + n]
        return dst

    def write(self, offset: int, data) -> None:
        src = _as_u8(data)
        n = len(src)
        self._check_range(offset, n)
        if n == 0:
            return
        p0, p1 = offset // self.page, (offset + n - 1) // self.page
        if offset % self.page == 0 and n % self.page == 0:
            self._write_run(p0, p1 - p0 + 1, src)
            return
        # partial pages: read-modify-write under the locks of the extents involved
        locks = [e.lock for e in self._extents_of(p0, p1)]
        for lk in locks:
            lk.acquire()
        try:
            tmp = np.empty((p1 - p0 + 1) * self.page, dtype=np.uint8)
            s = offset - p0 * self.page
            # sequential from here: other threads would wait on the locks this one holds
            if s:
                self._read_run(p0, 1, tmp[: self.page], parallel=False)
            if (offset + n) % self.page and (p1 > p0 or not s):
                self._read_run(p1, 1, tmp[-self.page:], parallel=False)
            tmp[s:s + n] = src
            self._write_run(p0, p1 - p0 + 1, tmp, parallel=False)
        finally:
            for lk in reversed(locks):
                lk.release()

    def read_pages(self, pages, out=None) -> np.ndarray:
        """Pages (indices) gathered back to back into ``out`` (len(pages) * page_size bytes)."""
        idx = self._check_pages(pages)
        size = len(idx) * self.page
        dst = np.empty(size, dtype=np.uint8) if out is None else _as_u8(out, writable=True)
        if len(dst) < size:
            raise ValueError(f"out holds {len(dst)} bytes, {size} needed")
        if len(idx) == 0:
            return dst
        if np.all(idx[1:] >= idx[:-1]):
            self._gather(idx, dst[:size])
        else:
            order = np.argsort(idx, kind="stable")
            tmp = np.empty(size, dtype=np.uint8)
            self._gather(idx[order], tmp)
            dst[:size].reshape(-1, self.page)[order] = tmp.reshape(-1, self.page)
        return dst

    def write_pages(self, pages, data) -> None:
        idx = self._check_pages(pages)
        src = _as_u8(data)
        if len(src) != len(idx) * self.page:
            raise ValueError(f"data is {len(src)} bytes; {len(idx)} pages need {len(idx) * self.page}")
        if len(np.unique(idx)) != len(idx):
            raise ValueError("write_pages: a page index appears twice")
        if len(idx) == 0:
            return
        if np.all(idx[1:] > idx[:-1]):
            self._scatter(idx, src)
        else:
            order = np.argsort(idx, kind="stable")
            self._scatter(idx[order], np.ascontiguousarray(src.reshape(-1, self.page)[order]).reshape(-1))

    def free(self) -> None:
        """Give every slab back to its donor."""
        if self.freed:
            return
        self.freed = True
        self.io.release(self)

    def healthy(self) -> bool:
        """Every extent has its full number of live copies."""
        return all(e.live_count() >= self.io.replicas for e in self.extents)

    def placement(self) -> list[list[dict[str, Any]]]:
        return [[r.describe() for r in list(e.replicas)] for e in self.extents]

    def replicas_changed(self, ext: Extent) -> None:
        """The copies of ``ext`` changed (one added, lost, or moved to another state).  A plain
        buffer reads ``ext.replicas`` on every call and only tells ``on_replicas_changed``; a
        region's engine keeps its own copy map and follows (rdma.region)."""
        if self.on_replicas_changed is not None:
            self.on_replicas_changed(ext)

    def rebuild_into(self, ext: Extent, new: Replica, write_copy: Callable[..., None],
                     bytes_per_s: float = 0) -> int | None:
        """Fill ``new`` (already in ``ext.replicas``, REBUILDING: writes reach it) with the extent's
        data from a live copy, a chunk at a time under ``ext.lock`` so no write lands between a
        chunk's read and its write.  ``write_copy(rep, offs, lens, src)`` writes one copy.
        ``bytes_per_s`` > 0 paces it (after each chunk, outside the lock).  Returns the bytes
        copied, or None when it failed (the caller drops ``new``)."""
        P = self.page
        chunk_pages = REBUILD_CHUNK // P
        tmp = np.empty(chunk_pages * P, dtype=np.uint8)
        copied = 0
        t0 = time.monotonic()
        for p in range(0, ext.npages, chunk_pages):
            n = min(chunk_pages, ext.npages - p)
            pages = np.arange(ext.first_page + p, ext.first_page + p + n, dtype=np.int64)
            offs, lens = ext.segments(pages, P)
            with ext.lock:
                if new.state is not REBUILDING:
                    return None
                try:
                    self.read_extent_locked(ext, pages, tmp[: n * P])
                    write_copy(new, offs, lens, tmp[: n * P])
                except DataLostError:
                    return None
                except (RemoteMemoryError, ConnectionError) as exc:
                    log.warning("rebuild target %s failed: %s", new.node, exc)
                    return None
            copied += n * P
            if bytes_per_s > 0 and not _pace(t0 + copied / bytes_per_s,
                                             lambda: self.freed or new.state is not REBUILDING):
                return None
        return copied

    def salvage(self, ext: Extent, timeout_s: float) -> int | None:
        """``ext`` lost every copy: ready it for an empty new copy and return the units kept, or None
        when there is nothing to keep.  A plain buffer keeps nothing locally: None (its pages stay
        lost, each read of them raises DataLostError).  A region keeps what is resident, and raises
        TimeoutError while it cannot yet (units still on their way: try again later)."""
        return None

    def read_extent_locked(self, ext: Extent, pages: np.ndarray, dst: np.ndarray) -> None:
        """Pages of ``ext`` (sorted indices) from a live copy into dst, failing over and checking
        checksums as any read does.  For the repairer, which holds ``ext.lock``."""
        offs, lens = ext.segments(pages, self.page)
        self._read_extent(ext, pages, offs, lens, dst, locked=True)

    def __enter__(self) -> "RemoteBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # --- internals -----------------------------------------------------------------------

    def _check_range(self, offset: int, n: int) -> None:
        if self.freed:
            raise ValueError("buffer was freed")
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise IndexError(f"range [{offset}, {offset + n}) outside a buffer of {self.nbytes} bytes")

    def _check_pages(self, pages) -> np.ndarray:
        if self.freed:
            raise ValueError("buffer was freed")
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.npages):
            raise IndexError(f"page index outside 0..{self.npages - 1}")
        return idx

    def _extent_index(self, page: int) -> int:
        return int(np.searchsorted(self._starts, page, side="right") - 1)

    def _extents_of(self, p0: int, p1: int) -> list[Extent]:
        return self.extents[self._extent_index(p0): self._extent_index(p1) + 1]

    def _read_page(self, p: int, dst: np.ndarray) -> None:
        """One page: the small random read, kept short (one C call, one CRC compare)."""
        ext = self.extents[bisect.bisect_right(self._start_list, p) - 1]
        reps = ext.replicas
        n = len(reps)
        off = (p - ext.first_page) * self.page
        for k in range(n):
            rep = reps[(p + k) % n]  # spread single-page reads over the copies
            if rep.state is not LIVE:
                continue
            try:
                crc = self.io.read_page(rep, off, self.page, dst, self.checksums)
            except (RemoteMemoryError, ConnectionError):
                break  # the general path below fails over and reports it
            if not self.checksums or crc == self.page_crc[p]:
                return
            with ext.lock:  # not a write racing this read?  then this copy is bad
                try:
                    crc = self.io.read_page(rep, off, self.page, dst, True)
                except (RemoteMemoryError, ConnectionError):
                    break
                if crc == self.page_crc[p]:
                    return
                self.io.copy_failed(self, ext, rep, RemoteMemoryError(
                    wire.E_CRC, f"page {p} of slab {rep.slab} on {rep.node} does not match what was written"))
            break
        self._read_run(p, 1, dst[: self.page])

    def _read_run(self, p0: int, npages: int, dst: np.ndarray, parallel: bool = True) -> None:
        self._gather(np.arange(p0, p0 + npages, dtype=np.int64), dst, parallel)

    def _write_run(self, p0: int, npages: int, src: np.ndarray, parallel: bool = True) -> None:
        self._scatter(np.arange(p0, p0 + npages, dtype=np.int64), src, parallel)

    def _split(self, idx: np.ndarray):
        """Sorted page indices -> (extent, slice of idx) groups."""
        ext_ids = np.searchsorted(self._starts, idx, side="right") - 1
        bounds = np.flatnonzero(np.diff(ext_ids)) + 1
        start = 0
        for end in [*bounds.tolist(), len(idx)]:
            yield self.extents[int(ext_ids[start])], start, end
            start = end

    def _gather(self, idx: np.ndarray, dst: np.ndarray, parallel: bool = True) -> None:
        jobs = []
        for ext, a, b in self._split(idx):
            pages = idx[a:b]
            offs, lens = ext.segments(pages, self.page)
            jobs.append((self._read_extent, ext, pages, offs, lens, dst[a * self.page:b * self.page]))
        self._run(jobs, len(dst) if parallel else 0)

    def _scatter(self, idx: np.ndarray, src: np.ndarray, parallel: bool = True) -> None:
        jobs = []
        for ext, a, b in self._split(idx):
            pages = idx[a:b]
            offs, lens = ext.segments(pages, self.page)
            jobs.append((self._write_extent, ext, pages, offs, lens, src[a * self.page:b * self.page]))
        self._run(jobs, len(src) if parallel else 0)

    def _run(self, jobs, nbytes: int) -> None:
        """One job per extent; a large batch over several extents runs them in parallel
        (their slabs sit on different donors, and the C calls release the GIL)."""
        if len(jobs) == 1 or nbytes < PARALLEL_MIN:
            for fn, *a in jobs:
                fn(*a)
            return
        self.io.run_parallel([functools.partial(fn, *a) for fn, *a in jobs])

    def _read_extent(self, ext: Extent, pages, offs, lens, dst: np.ndarray, locked: bool = False) -> None:
        tried: set[int] = set()
        while True:
            candidates = [r for r in ext.readable() if id(r) not in tried]
            if not candidates:
                raise DataLostError(wire.E_IO, f"extent {ext.index}: no live copy left "
                                               f"({[r.describe() for r in ext.replicas]})")
            live = [r for r in candidates if r.state is LIVE]
            # spread extents' reads over their live copies; a copy being evicted only as a last resort
            rep = live[(ext.index + int(pages[0])) % len(live)] if live else candidates[0]
            tried.add(id(rep))
            try:
                crcs = self.io.read(rep, offs, lens, dst, self.checksums)
            except (RemoteMemoryError, ConnectionError) as exc:
                self.io.copy_failed(self, ext, rep, exc)
                continue
            if self.checksums and not np.array_equal(crcs, self.page_crc[pages]):
                if not locked:
                    # a concurrent write may have raced this read: read again, serialised
                    with ext.lock:
                        return self._read_extent(ext, pages, offs, lens, dst, locked=True)
                bad = int(np.flatnonzero(crcs != self.page_crc[pages])[0])
                self.io.copy_failed(self, ext, rep, RemoteMemoryError(
                    wire.E_CRC, f"page {int(pages[bad])} of slab {rep.slab} on {rep.node} does not match what was written"))
                continue
            if len(tried) > 1:
                self.io.failed_over()
            return

    def _write_extent(self, ext: Extent, pages, offs, lens, src: np.ndarray) -> None:
        with ext.lock:
            targets = ext.writable()
            if not targets:
                raise DataLostError(wire.E_IO, f"extent {ext.index}: no copy left to write")
            results = self.io.write_all(targets, offs, lens, src, self.checksums)
            wrote_durable = False
            crcs = None
            for rep, res in zip(targets, results):
                if isinstance(res, BaseException):
                    self.io.copy_failed(self, ext, rep, res)
                else:
                    if rep.state in (LIVE, EVICTING):
                        wrote_durable = True
                    crcs = res if res is not None else crcs
            if not wrote_durable:
                raise DataLostError(wire.E_IO, f"extent {ext.index}: every copy failed the write")
            if self.checksums and crcs is not None:
                self.page_crc[pages] = crcs


def _as_u8(data, writable: bool = False) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            if writable:
                raise ValueError("out must be C-contiguous")
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    mv = memoryview(data)
    if writable and mv.readonly:
        raise ValueError("out must be writable")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8) if not writable else np.asarray(mv.cast("B"), dtype=np.uint8)


