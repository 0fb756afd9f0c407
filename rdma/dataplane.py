"""The consumer's data plane: connections to donors' slab servers and the threads that drive them.

:class:`DataPlane` is the :class:`rdma.buffer.ReplicaIO` that RemoteMemory gives
its buffers.  It keeps one Endpoint per donor address (reopened when one broke),
writes every copy of an extent at once on a small pool, and runs a large batch's
extents in parallel on another.  What a failed copy means (mark it lost, suspect
its donor, rebuild) and what freeing a buffer does (unmap its slabs) belong to
the memory: it hands them in as callbacks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from rdma.endpoint import Endpoint
from rdma.errors import RemoteMemoryError
from rdma.replica import Extent, Replica

if TYPE_CHECKING:  # pragma: no cover
    from rdma.buffer import RemoteBuffer

WRITE_ALL_PARALLEL_MIN = 256 << 10  # below this, writing the copies one after another is cheaper


class DataPlane:
    """Data-plane calls on the copies of one RemoteMemory's buffers.

    ``stats``: the memory's counters (``failover_reads`` is counted here).
    ``on_copy_failed(buf, ext, rep, exc)``: a copy failed; ``on_release(buf)``: a buffer was freed."""

    def __init__(self, replicas: int, io_timeout_ms: int, stats: dict[str, int],
                 on_copy_failed: Callable[["RemoteBuffer", Extent, Replica, BaseException], None],
                 on_release: Callable[["RemoteBuffer"], None]) -> None:
        self.replicas = replicas
        self.io_timeout_ms = io_timeout_ms
        self.stats = stats
        self._on_copy_failed = on_copy_failed
        self._on_release = on_release
        self._eps: dict[str, Endpoint] = {}
        self._ep_lock = threading.Lock()
        self._writers = ThreadPoolExecutor(max_workers=max(2, replicas), thread_name_prefix="rdma-write")
        # extent-level jobs of one large batch (separate from the replica writers they submit to)
        self._extent_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rdma-extent")

    def endpoint(self, rep: Replica) -> Endpoint:
        """The open connection to rep's slab server (a new one if it broke)."""
        ep = self._eps.get(rep.addr)
        if ep is not None and not ep.broken:
            return ep  # the common case, without the lock
        with self._ep_lock:
            ep = self._eps.get(rep.addr)
            if ep is not None and not ep.broken:
                return ep
            if ep is not None:
                ep.close()
            host, _, port = rep.addr.rpartition(":")
            ep = Endpoint(host, int(port), timeout_ms=self.io_timeout_ms)
            self._eps[rep.addr] = ep
            return ep

    # --- rdma.buffer.ReplicaIO ---------------------------------------------------------------

    def read(self, rep: Replica, offs: np.ndarray, lens: np.ndarray, dst: np.ndarray,
             checksums: bool) -> np.ndarray | None:
        return self.endpoint(rep).read(rep.slab, rep.token, offs, lens, dst, local_crc=checksums)

    def read_page(self, rep: Replica, off: int, n: int, dst: np.ndarray, checksums: bool) -> int:
        return self.endpoint(rep).read_one(rep.slab, rep.token, off, n, dst, local_crc=checksums)

    def write(self, rep: Replica, offs: np.ndarray, lens: np.ndarray, src: np.ndarray) -> None:
        """Segments to one copy (the rebuild's write)."""
        self.endpoint(rep).write(rep.slab, rep.token, offs, lens, src)

    def write_all(self, targets: list[Replica], offs: np.ndarray, lens: np.ndarray, src: np.ndarray,
                  checksums: bool) -> list[Any]:
        def one(rep: Replica):
            try:
                return self.endpoint(rep).write(rep.slab, rep.token, offs, lens, src, local_crc=checksums)
            except (RemoteMemoryError, ConnectionError) as exc:
                return exc

        if len(targets) == 1 or len(src) < WRITE_ALL_PARALLEL_MIN:
            return [one(r) for r in targets]
        return list(self._writers.map(one, targets))

    def run_parallel(self, calls: list[Callable[[], None]]) -> None:
        futures = [self._extent_pool.submit(fn) for fn in calls]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def copy_failed(self, buf: "RemoteBuffer", ext: Extent, rep: Replica, exc: BaseException) -> None:
        self._on_copy_failed(buf, ext, rep, exc)

    def failed_over(self) -> None:
        self.stats["failover_reads"] += 1

    def release(self, buf: "RemoteBuffer") -> None:
        self._on_release(buf)

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        self._writers.shutdown(wait=False)
        self._extent_pool.shutdown(wait=False)
        with self._ep_lock:
            for ep in self._eps.values():
                ep.close()
            self._eps.clear()
