"""SpillCache: key -> bytes with a local LRU tier that spills to remote memory.

The object a data-loading pipeline uses to cache decoded samples that do not
fit in RAM: the hot set stays local; the rest goes, page-packed, to remote
memory (replicated, see RemoteMemory) instead of being decoded again.

Remote space is a set of arenas (RemoteBuffers) cut into pages; an entry
takes ceil(len / page) pages anywhere in one arena (read back with one batched
gather).  When remote memory runs out the cache drops its least recently used
remote entries: it is a cache, and a miss only costs a decode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from rdma.remote import RemoteMemory


@dataclass
class SpillStats:
    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    spilled: int = 0
    dropped: int = 0
    local_bytes: int = 0
    remote_bytes: int = 0


@dataclass
class _Arena:
    buf: object  # RemoteBuffer
    free: list[int] = field(default_factory=list)  # free page indices (a stack)


@dataclass(frozen=True)
class _Remote:
    arena: int
    pages: np.ndarray
    nbytes: int


class SpillCache:
    def __init__(self, capacity_bytes: int, remote: "RemoteMemory | None" = None,
                 arena_bytes: int = 64 << 20, remote_capacity_bytes: int | None = None,
                 owns_remote: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must not be negative")
        self.capacity = capacity_bytes
        self.remote = remote
        self.arena_bytes = arena_bytes
        self.remote_capacity = remote_capacity_bytes
        self._owns_remote = owns_remote  # close() closes ``remote`` too (spill_cache_from_env made it)
        self.page = remote.page_size if remote is not None else 4096
        self._local: "OrderedDict[Hashable, bytes]" = OrderedDict()
        self._remote: "OrderedDict[Hashable, _Remote]" = OrderedDict()
        self._arenas: list[_Arena] = []
        self._lock = threading.RLock()
        self.stats = SpillStats()

    # --- mapping API ---------------------------------------------------------------------

    def put(self, key: Hashable, value) -> None:
        data = bytes(value)
        with self._lock:
            self._discard(key)
            if len(data) > self.capacity:
                self._spill([(key, data)])  # too big for the local tier: straight to remote
                return
            self._local[key] = data
            self.stats.local_bytes += len(data)
            self._shrink_local()

    __setitem__ = put

    def get(self, key: Hashable, default=None):
        with self._lock:
            data = self._local.get(key)
            if data is not None:
                self._local.move_to_end(key)
                self.stats.local_hits += 1
                return data
            ent = self._remote.get(key)
            if ent is None:
                self.stats.misses += 1
                return default
            arena = self._arenas[ent.arena]
            raw = arena.buf.read_pages(ent.pages)
            data = raw[: ent.nbytes].tobytes()
            self.stats.remote_hits += 1
            if len(data) <= self.capacity:  # promote: it is hot again
                self._drop_remote(key)
                self._local[key] = data
                self.stats.local_bytes += len(data)
                self._shrink_local()
            else:
                self._remote.move_to_end(key)
            return data

    def __getitem__(self, key: Hashable) -> bytes:
        v = self.get(key)
        if v is None:
            raise KeyError(key)
        return v

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._local or key in self._remote

    def __len__(self) -> int:
        with self._lock:
            return len(self._local) + len(self._remote)

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if not self._discard(key):
                raise KeyError(key)

    def where(self, key: Hashable) -> str | None:
        """"local", "remote" or None."""
        with self._lock:
            return "local" if key in self._local else "remote" if key in self._remote else None

    def close(self) -> None:
        with self._lock:
            for a in self._arenas:
                a.buf.free()
            self._arenas.clear()
            self._remote.clear()
            self._local.clear()
            self.stats.local_bytes = self.stats.remote_bytes = 0
            if self._owns_remote and self.remote is not None:
                self.remote.close()

    def __enter__(self) -> "SpillCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _discard(self, key: Hashable) -> bool:
        data = self._local.pop(key, None)
        if data is not None:
            self.stats.local_bytes -= len(data)
            return True
        return self._drop_remote(key)

    def _drop_remote(self, key: Hashable) -> bool:
        ent = self._remote.pop(key, None)
        if ent is None:
            return False
        self._arenas[ent.arena].free.extend(ent.pages.tolist())
        self.stats.remote_bytes -= ent.nbytes
        return True

    def _shrink_local(self) -> None:
        victims = []
        while self.stats.local_bytes > self.capacity and self._local:
            key, data = self._local.popitem(last=False)
            self.stats.local_bytes -= len(data)
            victims.append((key, data))
        if victims:
            self._spill(victims)

    def _pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page))

    def _spill(self, items: list[tuple[Hashable, bytes]]) -> None:
        if self.remote is None:
            self.stats.dropped += len(items)
            return
        # place every item, then write each arena's share with one batched call
        by_arena: dict[int, list[tuple[Hashable, bytes, np.ndarray]]] = {}
        for key, data in items:
            need = self._pages_for(len(data))
            if need * self.page > self.arena_bytes:
                self.stats.dropped += 1
                continue
            idx = self._take_pages(need)
            if idx is None:
                self.stats.dropped += 1
                continue
            a, pages = idx
            by_arena.setdefault(a, []).append((key, data, pages))
        for a, lst in by_arena.items():
            pages = np.concatenate([p for _, _, p in lst])
            blob = np.zeros(len(pages) * self.page, dtype=np.uint8)
            pos = 0
            for _, data, p in lst:
                blob[pos:pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
                pos += len(p) * self.page
            self._arenas[a].buf.write_pages(pages, blob)
            for key, data, p in lst:
                self._remote[key] = _Remote(a, p, len(data))
                self.stats.remote_bytes += len(data)
                self.stats.spilled += 1

    def _take_pages(self, need: int) -> tuple[int, np.ndarray] | None:
        while True:
            for i, arena in enumerate(self._arenas):
                if len(arena.free) >= need:
                    pages = np.array([arena.free.pop() for _ in range(need)], dtype=np.int64)
                    return i, pages
            if not self._grow():
                if not self._remote:
                    return None
                self._drop_remote(next(iter(self._remote)))  # oldest remote entry goes
                self.stats.dropped += 1

    def _grow(self) -> bool:
        used = len(self._arenas) * self.arena_bytes
        if self.remote_capacity is not None and used + self.arena_bytes > self.remote_capacity:
            return False
        try:
            buf = self.remote.alloc(self.arena_bytes)
        except MemoryError:
            return False
        self._arenas.append(_Arena(buf, list(range(buf.npages - 1, -1, -1))))
        return True
