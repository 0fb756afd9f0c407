"""The donor's slab server: C epoll worker threads serving batched page reads and writes on
registered slabs (csrc/tcp_server.c), with no Python on the data path."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from rdma.errors import RemoteMemoryError
from rdma.native import ffi, lib
from rdma.slab_memory import SlabMemory

MAX_TIMEOUT_S = 86400.0  # a slab-server timeout above a day is a unit mistake


@dataclass(frozen=True)
class SlabStats:
    size: int
    last_access_ns: int
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int


class SlabServer:
    """The C slab server (epoll worker threads); slabs are added and removed from Python."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, threads: int = 2, max_connections: int = 0,
                 idle_timeout_s: float | None = 60.0, frame_timeout_s: float | None = 10.0,
                 max_connections_per_peer: int = 0) -> None:
        """``idle_timeout_s``: close a connection that has not sent a request with a valid
        token this long after it opened, whatever it sent.  ``frame_timeout_s``: close any
        connection whose incomplete request has been pending this long, or whose responses
        its peer has not read any of for this long.  0 or None turns one off; the C server
        checks them on a sweep every quarter timeout.  ``max_connections`` (0: 4096, never
        above RLIMIT_NOFILE - 64; the cap in force is :attr:`max_connections`) and
        ``max_connections_per_peer`` (0: 256 per peer address) close connections beyond
        them on accept."""
        def ms(t: float | None) -> int:
            if not t or t <= 0:
                return 0
            if not math.isfinite(t) or t > MAX_TIMEOUT_S:
                raise ValueError(f"a slab-server timeout must be at most {MAX_TIMEOUT_S:g} s, got {t}")
            return max(1, int(round(float(t) * 1000)))

        for name, n in (("threads", threads), ("max_connections", max_connections),
                        ("max_connections_per_peer", max_connections_per_peer)):
            if not 0 <= int(n) < 1 << 31:
                raise ValueError(f"{name} must be between 0 and 2**31-1, got {n}")
        err, out = ffi.new("char[256]"), ffi.new("dls_server **")
        rc = lib.dls_server_start_ex(host.encode(), int(port), int(threads), int(max_connections),
                                     int(max_connections_per_peer), ms(idle_timeout_s), ms(frame_timeout_s),
                                     out, err, 256)
        if rc:
            raise OSError(-rc, f"slab server on {host}:{port}: {ffi.string(err).decode()}")
        self._s = out[0]
        self.host = host
        self.port = int(lib.dls_server_port(self._s))
        self.max_connections = int(lib.dls_server_max_connections(self._s))
        self._lock = threading.Lock()

    def add_slab(self, slab_id: int, memory: SlabMemory, token: bytes, nbytes: int | None = None) -> None:
        size = memory.size if nbytes is None else int(nbytes)
        if size > memory.size:
            raise ValueError("slab larger than its memory")
        rc = lib.dls_server_add_slab(self._s, int(slab_id), memory.ptr(), size, token)
        if rc:
            raise RemoteMemoryError(rc, f"add slab {slab_id}")

    def remove_slab(self, slab_id: int) -> bool:
        """Stop serving; returns once no request touches the slab.  False if it was not served."""
        return lib.dls_server_remove_slab(self._s, int(slab_id)) == 0

    def slab_stats(self, slab_id: int) -> SlabStats | None:
        st = ffi.new("dls_slab_stats *")
        if lib.dls_server_slab_stats(self._s, int(slab_id), st):
            return None
        return SlabStats(st.size, st.last_access_ns, st.reads, st.writes, st.bytes_read, st.bytes_written)

    def counters(self) -> dict[str, int]:
        c = ffi.new("dls_server_counters *")
        lib.dls_server_get_counters(self._s, c)
        return {k: int(getattr(c, k)) for k in
                ("connections", "open_connections", "requests", "errors", "bad_frames", "bytes_in", "bytes_out",
                 "refused", "refused_per_peer", "fd_exhausted")}

    def stop(self) -> None:
        with self._lock:
            if self._s is not None:
                lib.dls_server_stop(self._s)
                self._s = None

    def __enter__(self) -> "SlabServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
