"""A donor's slab memory: the mappings the slab server serves (csrc/slab_memory.c)."""

from __future__ import annotations

import numpy as np

from rdma.native import ffi, lib

HUGE = lib.DLS_SLAB_MEM_HUGE
LOCK = lib.DLS_SLAB_MEM_LOCK
POPULATE = lib.DLS_SLAB_MEM_POPULATE


class SlabMemory:
    """A donor's slab memory: a page-aligned anonymous mapping (huge pages and mlock when asked);
    :meth:`release` munmaps it.  (A consumer's paged mapping is :class:`rdma.region.RemoteRegion`.)"""

    def __init__(self, nbytes: int, huge: bool = False, lock: bool = False, populate: bool = False) -> None:
        self._r = ffi.new("dls_slab_mem *")
        reason = ffi.new("char[512]")
        flags = (HUGE if huge else 0) | (LOCK if lock else 0) | (POPULATE if populate else 0)
        rc = lib.dls_slab_mem_map(int(nbytes), flags, self._r, reason, 512)
        if rc:
            raise OSError(-rc, f"mmap of {nbytes} bytes failed")
        self.requested = int(nbytes)
        self.reason = ffi.string(reason).decode()
        self.huge = bool(self._r.flags & HUGE)
        self.locked = bool(self._r.flags & LOCK)

    @property
    def address(self) -> int:
        return int(ffi.cast("uintptr_t", self._r.base))

    @property
    def size(self) -> int:
        return int(self._r.size)

    @property
    def released(self) -> bool:
        return self._r.base == ffi.NULL

    def ptr(self):
        return self._r.base

    def view(self) -> np.ndarray:
        """A numpy uint8 view of the whole mapping (invalid after release)."""
        if self.released:
            raise ValueError("slab memory was released")
        return np.frombuffer(ffi.buffer(self._r.base, self._r.size), dtype=np.uint8)

    def release(self) -> None:
        if not self.released:
            rc = lib.dls_slab_mem_unmap(self._r)
            if rc:
                raise OSError(-rc, "munmap failed")
