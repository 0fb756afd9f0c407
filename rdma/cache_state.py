"""The state a sample cache shares between a job's processes: one memory file, mapped shared.

A DataLoader forks its workers after the dataset (and its cache) exist, so every worker inherits
the same ``MAP_SHARED`` mappings: the index of what is cached where, the segment tables of both
tiers, the copies of each remote segment, per-process counters, and the local tier's bytes (a
second memory file).  What one worker stores, the others and the next epoch find.

Layout of the state file (all little-endian, offsets fixed at creation):

- a header of 64 u64 (:data:`H`);
- per tier (local, remote), per segment: generation (u32), state (u32), fill (u64), seal order (u64),
  and for the remote tier which of its last 64 generations ended because every copy was lost (a u64
  mask, bit ``gen % 64``; :func:`lost_at`), so a miss is counted as lost or as recycled;
- counters: one row of u64 per process (:data:`COUNTERS`), claimed by pid, so no two processes
  ever add to the same word;
- the slots (:data:`SLOT`, 64 bytes each, one per dataset index), written under the file lock
  with a sequence count (odd while being written) that readers check without the lock;
- a dirty byte per 4 KiB page of slots (a named cache copies dirty pages to its index on donors);
- the copies of every remote segment, as JSON (rdma.cache_manifest's copy lists), with a version.

Writers take :meth:`SharedState.lock`: a ``lockf`` lock on the file (between processes) and a
thread lock (between threads of one process).  Both are per process, and a forked child makes
its own, so a lock held by another thread at fork time cannot wedge a worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import threading
from typing import Any

import numpy as np

MAGIC = 0x31434D4353444C44  # "DLSCMC1" little-endian, plus a byte
SLOT = np.dtype([("seq", "<u4"), ("length", "<u4"), ("crc", "<u4"), ("lseg", "<u4"), ("lgen", "<u4"),
                 ("rseg", "<u4"), ("rgen", "<u4"), ("pad0", "<u4"), ("loff", "<u8"), ("roff", "<u8"),
                 ("pad1", "<u8", (2,))])
assert SLOT.itemsize == 64
SLOTS_PER_PAGE = 4096 // SLOT.itemsize

# segment states
UNMAPPED, SPARE, FILLING, FULL, LOST = 0, 1, 2, 3, 4

COUNTERS = ("hits_local", "hits_remote", "misses", "stores_local", "stores_remote", "store_failed", "too_big",
            "full", "corrupt", "lost", "stale", "read_errors", "evicted_segments", "bytes_stored_local",
            "bytes_stored_remote", "bytes_read_remote", "index_reads")
MAX_PROCS = 256
TABLE_BYTES = 1 << 20

# header words
H = {name: i for i, name in enumerate((
    "magic", "slots", "lsegs", "lseg_bytes", "rsegs", "rseg_bytes", "lcur", "rcur", "order", "table_version",
    "table_len", "named", "read_only", "owner_pid", "procs"))}

ALIGN = 64


def lost_at(mask: int, gen: int, current: int) -> bool:
    """Did generation ``gen`` of a segment now at ``current`` end because its copies were lost?"""
    return 0 < current - gen <= 64 and bool(mask >> (gen % 64) & 1)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedState:
    """The mapped state file (see the module docstring).  ``create`` makes one; a forked child uses
    its parent's mapping as it is (:meth:`after_fork` gives it locks of its own)."""

    def __init__(self, fd: int, local_fd: int | None) -> None:
        self.fd = fd
        self.local_fd = local_fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        head = np.frombuffer(self._map, dtype="<u8", count=64)
        if int(head[0]) != MAGIC:
            raise ValueError("not a sample-cache state file")
        self.head = head
        self._views(int(head[H["slots"]]), int(head[H["lsegs"]]), int(head[H["rsegs"]]))
        lbytes = int(head[H["lsegs"]]) * int(head[H["lseg_bytes"]])
        self._lmap = None
        self.local = np.empty(0, np.uint8)
        if local_fd is not None and lbytes:
            self._lmap = mmap.mmap(local_fd, lbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.local = np.frombuffer(self._lmap, dtype=np.uint8)
        self._pid = os.getpid()
        self._tlock = threading.Lock()
        self._row: int | None = None

    # --- creation ------------------------------------------------------------------------------------

    @staticmethod
    def layout(slots: int, lsegs: int, rsegs: int) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) of every part of the file."""
        parts = [("head", 64 * 8), ("lgen", 4 * lsegs), ("lstate", 4 * lsegs), ("lfill", 8 * lsegs),
                 ("lorder", 8 * lsegs), ("rgen", 4 * rsegs), ("rstate", 4 * rsegs), ("rfill", 8 * rsegs),
                 ("rorder", 8 * rsegs), ("rlost", 8 * rsegs), ("pids", 8 * MAX_PROCS),
                 ("counters", 8 * MAX_PROCS * len(COUNTERS)), ("slots", SLOT.itemsize * slots),
                 ("dirty", -(-slots // SLOTS_PER_PAGE)), ("table", TABLE_BYTES)]
        out, off = {}, 0
        for name, n in parts:
            off = -(-off // 4096) * 4096 if name in ("slots", "table") else _align(off)
            out[name] = (off, n)
            off += n
        out["_end"] = (off, 0)
        return out

    @classmethod
    def create(cls, slots: int, local_bytes: int, lseg_bytes: int, rsegs: int, rseg_bytes: int,
               named: bool = False, read_only: bool = False) -> "SharedState":
        if slots <= 0:
            raise ValueError("a sample cache needs at least one slot")
        lsegs, seg = 0, 0
        if local_bytes >= ALIGN:  # segments of about lseg_bytes that use the whole local budget
            lsegs = max(1, -(-local_bytes // max(ALIGN, lseg_bytes)))
            seg = local_bytes // lsegs // ALIGN * ALIGN
        lseg_bytes = seg
        lay = cls.layout(slots, lsegs, rsegs)
        fd = os.memfd_create("dlshare-cache-state", os.MFD_CLOEXEC)
        os.ftruncate(fd, lay["_end"][0])
        local_fd = None
        if lsegs:
            local_fd = os.memfd_create("dlshare-cache-local", os.MFD_CLOEXEC)
            os.ftruncate(local_fd, lsegs * lseg_bytes)
        with mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            head = np.frombuffer(m, dtype="<u8", count=64)
            head[H["slots"]], head[H["lsegs"]], head[H["lseg_bytes"]] = slots, lsegs, lseg_bytes
            head[H["rsegs"]], head[H["rseg_bytes"]] = rsegs, rseg_bytes
            head[H["lcur"]] = head[H["rcur"]] = np.uint64(2 ** 64 - 1)
            head[H["named"]], head[H["read_only"]], head[H["owner_pid"]] = int(named), int(read_only), os.getpid()
            head[H["magic"]] = MAGIC
            del head
        st = cls(fd, local_fd)
        st.lstate[:] = SPARE  # the local tier is all there from the start
        return st

    def _views(self, slots: int, lsegs: int, rsegs: int) -> None:
        lay = self.layout(slots, lsegs, rsegs)
        m = self._map

        def v(name: str, dtype, count: int | None = None):
            off, n = lay[name]
            dt = np.dtype(dtype)
            return np.frombuffer(m, dtype=dt, count=n // dt.itemsize if count is None else count, offset=off)

        self.lgen, self.lstate = v("lgen", "<u4"), v("lstate", "<u4")
        self.lfill, self.lorder = v("lfill", "<u8"), v("lorder", "<u8")
        self.rgen, self.rstate = v("rgen", "<u4"), v("rstate", "<u4")
        self.rfill, self.rorder, self.rlost = v("rfill", "<u8"), v("rorder", "<u8"), v("rlost", "<u8")
        self.pids = v("pids", "<i8")
        self.counters = v("counters", "<u8").reshape(MAX_PROCS, len(COUNTERS))
        self.slots = v("slots", SLOT)
        self.slot_bytes = v("slots", np.uint8)  # the same bytes, for page copies
        self.dirty = v("dirty", np.uint8)
        self.table = v("table", np.uint8)
        self.nslots = slots

    # --- processes -----------------------------------------------------------------------------------

    def after_fork(self) -> bool:
        """Called on every use: in a new process, make this process's locks (True when it did)."""
        if self._pid == os.getpid():
            return False
        self._pid = os.getpid()
        self._tlock = threading.Lock()
        self._row = None
        return True

    @contextlib.contextmanager
    def lock(self):
        self.after_fork()
        with self._tlock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def count(self, name: str, n: int = 1) -> None:
        """Add to this process's counter ``name``."""
        self.after_fork()
        row = self._row
        if row is None:
            row = self._row = self._claim_row()
        self.counters[row, COUNTERS.index(name)] += np.uint64(n)

    def _claim_row(self) -> int:
        pid = os.getpid()
        with self.lock():
            hit = np.flatnonzero(self.pids == pid)
            if len(hit):
                return int(hit[0])
            free = np.flatnonzero(self.pids == 0)
            if not len(free):  # more processes than rows over the cache's life: share the last one
                return MAX_PROCS - 1
            self.pids[free[0]] = pid
            self.head[H["procs"]] += np.uint64(1)
            return int(free[0])

    def totals(self) -> dict[str, int]:
        sums = self.counters.sum(axis=0)
        return {k: int(v) for k, v in zip(COUNTERS, sums)}

    # --- slots ---------------------------------------------------------------------------------------

    def read_slot(self, i: int):
        """A consistent copy of slot ``i`` (a numpy record), waiting out a writer; None when it stays
        mid-write (its writer died there: the slot reads as empty until it is written again)."""
        s = self.slots
        for _ in range(10000):
            a = int(s["seq"][i])
            if a & 1:
                continue
            rec = s[i].copy()
            if int(s["seq"][i]) == a:
                return rec
        return None

    def write_slot(self, i: int, **fields: int) -> None:
        """Change fields of slot ``i`` (call under :meth:`lock`)."""
        s = self.slots
        busy = int(s["seq"][i]) | 1  # odd (also when a writer died mid-write)
        s["seq"][i] = busy
        for k, v in fields.items():
            s[k][i] = v
        s["seq"][i] = (busy + 1) & 0xFFFFFFFF
        self.dirty[i // SLOTS_PER_PAGE] = 1

    def install_pages(self, first_page: int, raw: np.ndarray) -> None:
        """Slot pages read from a cache's index on donors (call under :meth:`lock`); a slot caught
        mid-write there (odd sequence) installs as empty."""
        recs = raw.view(SLOT)
        a = first_page * SLOTS_PER_PAGE
        b = min(self.nslots, a + len(recs))
        recs = recs[: b - a]
        s = self.slots
        seq = s["seq"][a:b].copy()
        s["seq"][a:b] = seq | 1
        body = recs.copy()
        body["length"][recs["seq"] & 1 == 1] = 0
        body["lseg"] = 0  # the owner's local tier is not this process's
        for k in SLOT.names:
            if k != "seq":
                s[k][a:b] = body[k]
        s["seq"][a:b] = (seq | 1) + 1

    # --- the copies of the remote segments -----------------------------------------------------------

    def write_table(self, doc: dict[str, Any]) -> None:
        raw = json.dumps(doc, separators=(",", ":")).encode()
        if len(raw) > TABLE_BYTES:
            raise ValueError(f"segment table of {len(raw)} bytes exceeds {TABLE_BYTES}")
        with self.lock():
            v = int(self.head[H["table_version"]])
            self.head[H["table_version"]] = v + 1
            self.table[: len(raw)] = np.frombuffer(raw, np.uint8)
            self.head[H["table_len"]] = len(raw)
            self.head[H["table_version"]] = v + 2

    def read_table(self) -> tuple[int, dict[str, Any]]:
        for _ in range(100000):
            v = int(self.head[H["table_version"]])
            if v & 1:
                continue
            n = int(self.head[H["table_len"]])
            raw = self.table[:n].tobytes()
            if int(self.head[H["table_version"]]) == v:
                return v, (json.loads(raw) if n else {})
        raise RuntimeError("segment table stayed busy")

    def table_version(self) -> int:
        return int(self.head[H["table_version"]])

    def close(self) -> None:
        for name in ("lgen", "lstate", "lfill", "lorder", "rgen", "rstate", "rfill", "rorder", "rlost", "pids",
                     "counters", "slots", "slot_bytes", "dirty", "table", "head", "local"):
            setattr(self, name, None)
        for m in (self._map, self._lmap):
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a sample still views the local tier: the mapping goes with it
                    pass
        for fd in (self.fd, self.local_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
