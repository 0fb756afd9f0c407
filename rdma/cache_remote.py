"""A sample cache's remote tier as one process sees it: its own connections to the donors' slab
servers, and reads and writes of entries on the copies the shared segment table lists.

Every process (the job's main process and each forked DataLoader worker) opens its own
:class:`~rdma.endpoint.Endpoint` per slab server, on first use in that process; a parent's
connections, inherited by a fork, are never used nor closed by the child (their C state may be mid-call
in the parent's threads).  The copies of each segment come from the table the owner keeps in the
shared state (rdma.cache_state), parsed again only when its version changes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from rdma import wire
from rdma.cache_manifest import CopyRef
from rdma.cache_state import SharedState
from rdma.endpoint import Endpoint
from rdma.errors import RemoteMemoryError
from rdma.native import crc32c

log = logging.getLogger("dlshare.rdma.cache")

_abandoned: list[Any] = []  # a parent's connections, inherited by a fork
TABLE_WAIT_S = 0.5  # a read whose every copy failed waits this long for the owner to list new ones


def _refs(raw: list) -> tuple[CopyRef, ...]:
    return tuple(CopyRef(c[0], int(c[1]), bytes.fromhex(c[2]), c[3]) for c in raw)


def readable(copies: tuple[CopyRef, ...]) -> list[CopyRef]:
    """Copies a read may use, best first: live ones, then ones being evicted (never one being rebuilt)."""
    return [c for c in copies if c.state == "live"] + [c for c in copies if c.state == "evicting"]


class RemoteTier:
    def __init__(self, state: SharedState, io_timeout_ms: int) -> None:
        self.state = state
        self.io_timeout_ms = io_timeout_ms
        self._eps: dict[str, Endpoint] = {}
        self._pid = os.getpid()
        self._copies: tuple[int, dict[int, tuple[CopyRef, ...]], list] = (-1, {}, [])

    # --- connections ---------------------------------------------------------------------------------

    def _mine(self) -> dict[str, Endpoint]:
        if self._pid != os.getpid():
            _abandoned.append(self._eps)
            self._eps, self._pid = {}, os.getpid()
        return self._eps

    def endpoint(self, addr: str) -> Endpoint:
        eps = self._mine()
        ep = eps.get(addr)
        if ep is None or ep.broken:
            if ep is not None:
                ep.close()
            host, _, port = addr.rpartition(":")
            ep = eps[addr] = Endpoint(host, int(port), timeout_ms=self.io_timeout_ms)
        return ep

    def close(self) -> None:
        """Close this process's connections (a forked child's only its own)."""
        for ep in self._mine().values():
            ep.close()
        self._eps.clear()

    # --- the segment table ---------------------------------------------------------------------------

    def table(self) -> tuple[dict[int, tuple[CopyRef, ...]], list]:
        """(segment -> copies, index extents as (first page, pages, copies))."""
        v = self.state.table_version()
        if v != self._copies[0]:
            v, doc = self.state.read_table()
            segs = {int(k): _refs(cs) for k, cs in doc.get("segments", {}).items()}
            index = [(int(e["first_page"]), int(e["npages"]), _refs(e["copies"])) for e in doc.get("index", [])]
            self._copies = (v, segs, index)
        return self._copies[1], self._copies[2]

    # --- entries -------------------------------------------------------------------------------------

    @staticmethod
    def _segments(off: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        step = wire.MAX_SEG_BYTES
        offs = np.arange(off, off + n, step, dtype=np.uint64)
        lens = np.minimum(step, off + n - offs).astype(np.uint32)
        return offs, lens

    def read(self, seg: int, gen: int, off: int, n: int, crc: int) -> np.ndarray | None:
        """The entry at ``off`` of segment ``seg`` from a copy whose bytes match ``crc``; None when no
        copy gives it (or the segment was recycled meanwhile).  Counts what went wrong."""
        st = self.state
        offs, lens = self._segments(off, n)
        out = np.empty(n, np.uint8)
        for attempt in range(2):
            version = st.table_version()
            copies = readable(self.table()[0].get(seg, ()))
            failed = 0
            for c in copies:
                try:
                    self.endpoint(c.addr).read(c.slab, c.token, offs, lens, out)
                except (RemoteMemoryError, ConnectionError, OSError) as exc:
                    log.info("cache: reading segment %d from %s failed: %s", seg, c.addr, exc)
                    st.count("read_errors")
                    failed += 1
                    continue
                if int(st.rgen[seg]) != gen:
                    st.count("stale")
                    return None
                if crc32c(out) == crc:
                    return out
                st.count("corrupt")
            # Every listed copy failed to answer: the copies may have just moved (a donor reclaimed the
            # slab, or died, and the owner placed the data elsewhere); its keeper lists the new ones
            # within a tick, so wait for the table to change once before calling it a miss.
            if attempt or not copies or failed < len(copies) or not self._table_changes(version, TABLE_WAIT_S):
                return None
        return None

    def _table_changes(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.state.table_version() != version:
                return True
            time.sleep(0.005)
        return False

    def write(self, seg: int, off: int, buf: np.ndarray) -> bool:
        """The entry to every copy of the segment; True when a copy that holds data took it."""
        offs, lens = self._segments(off, len(buf))
        durable = False
        for c in self.table()[0].get(seg, ()):
            try:
                self.endpoint(c.addr).write(c.slab, c.token, offs, lens, buf)
            except (RemoteMemoryError, ConnectionError, OSError) as exc:
                log.info("cache: writing segment %d to %s failed: %s", seg, c.addr, exc)
                continue
            durable = durable or c.state != "rebuilding"
        return durable

    def load_index(self, pages) -> None:
        """Pages of a named cache's index, from its copy on donors into this job's slots (readers)."""
        _, index = self.table()
        P = 4096
        pages = sorted(set(int(p) for p in pages))
        for first, npages, copies in index:
            mine = [p for p in pages if first <= p < first + npages]
            for a in range(0, len(mine), wire.MAX_SEGS):
                chunk = mine[a:a + wire.MAX_SEGS]
                offs = np.array([(p - first) * P for p in chunk], np.uint64)
                lens = np.full(len(chunk), P, np.uint32)
                raw = np.empty(len(chunk) * P, np.uint8)
                for c in readable(copies):
                    try:
                        self.endpoint(c.addr).read(c.slab, c.token, offs, lens, raw)
                    except (RemoteMemoryError, ConnectionError, OSError):
                        self.state.count("read_errors")
                        continue
                    self.state.count("index_reads")
                    with self.state.lock():
                        for k, p in enumerate(chunk):
                            self.state.install_pages(p, raw[k * P:(k + 1) * P])
                    break


__all__ = ["RemoteTier", "readable"]
