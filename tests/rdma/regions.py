"""Regions over slab servers in this process, for engine tests that need no broker.

:class:`LocalCopies` is the ReplicaIO a RegionBuffer reports to: an in-memory control plane
that marks a failed copy lost and hands the engine the new map, as RemoteMemory does.  The
slab servers are the real C servers; only the MQTT control plane is left out.
"""

from __future__ import annotations

from rdma.slab_memory import SlabMemory
from rdma.slab_server import SlabServer
from rdma.slab_token import random_token
from rdma.region import RegionBuffer, RemoteRegion
from rdma.replica import LIVE, LOST, Extent, Replica

PAGE = 4096
SLAB = 1 << 20


class LocalCopies:
    """The memory side of a region's buffer, without a broker."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.failed: list[tuple[int, str, BaseException]] = []
        self.released = 0

    def copy_failed(self, buf, ext: Extent, rep: Replica, exc: BaseException) -> None:
        self.failed.append((ext.index, rep.node, exc))
        if rep.move(LOST) is not None:
            buf.replicas_changed(ext)

    def failed_over(self) -> None:
        pass

    def release(self, buf) -> None:
        self.released += 1


class LocalCluster:
    """``n`` slab servers named s0, s1, ...; each extent's copies go to consecutive servers."""

    def __init__(self, n: int = 3) -> None:
        self.servers = [SlabServer(threads=2, idle_timeout_s=None) for _ in range(n)]
        self._keep: list[SlabMemory] = []  # alive as long as the servers serve it
        self._next_slab = 0

    def slab(self, k: int, nbytes: int = SLAB, initial=LIVE) -> Replica:
        sid = self._next_slab
        self._next_slab += 1
        reg, tok = SlabMemory(nbytes), random_token()
        self.servers[k].add_slab(sid, reg, tok)
        self._keep.append(reg)
        return Replica(f"s{k}", f"127.0.0.1:{self.servers[k].port}", sid, tok, nbytes, initial)

    def region(self, nbytes: int, local_bytes: int, unit: int = 64 << 10, replicas: int = 2, slab: int = SLAB,
               **kw) -> tuple[RemoteRegion, LocalCopies]:
        io = LocalCopies(replicas)
        extents = []
        for i in range(-(-nbytes // slab)):
            reps = [self.slab((i + k) % len(self.servers), slab) for k in range(replicas)]
            pages = min(slab, nbytes - i * slab) // PAGE
            extents.append(Extent(i, i * slab // PAGE, pages, reps))
        buf = RegionBuffer(io, nbytes, PAGE, extents, unit)
        return RemoteRegion(buf, local_bytes, **kw), io

    def read_copy(self, rep: Replica, nbytes: int):
        """The bytes a copy holds, read straight from its server (1 MiB a request: a server's limit)."""
        import numpy as np

        from rdma.endpoint import Endpoint

        host, _, port = rep.addr.rpartition(":")
        out = np.empty(nbytes, np.uint8)
        with Endpoint(host, int(port)) as ep:
            for off in range(0, nbytes, SLAB):
                n = min(SLAB, nbytes - off)
                ep.read(rep.slab, rep.token, [off], [n], out[off:off + n])
        return out

    def stop(self, k: int) -> None:
        self.servers[k].stop()

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        for r in self._keep:
            r.release()
