"""Whole-message blocking socket I/O for the aggregation data path (csrc/agg_io.c).

Each call releases the GIL once for the whole message (cffi API mode), instead of
once per partial ``send``/``recv`` as ``socket.sendall``/``recv_into`` loops do.
On a busy machine that matters: a thread preempted while holding the GIL stalls
every connection of the process.  Sockets must be in blocking mode.
"""

from __future__ import annotations

import errno
import os
import socket

from rdma.native import ffi, lib

SOCK_BUF = 4 << 20  # socket buffers large enough for a whole chunk in flight


def recv_exact(sock: socket.socket, view) -> bool:
    """Fill ``view`` (a writable bytes-like object) from ``sock``; False on EOF before the first byte."""
    buf = ffi.from_buffer(view, require_writable=True)
    n = len(buf)
    if n == 0:
        return True
    rc = lib.dls_agg_recv_exact(sock.fileno(), buf, n)
    if rc == n:
        return True
    if rc == 0:
        return False
    if rc == -errno.ECONNRESET:
        raise ConnectionError("peer closed the connection mid-message")
    raise OSError(-rc, os.strerror(-rc))


def send_all(sock: socket.socket, header, payload=None) -> None:
    """Send ``header`` then ``payload`` completely, in one call."""
    a = ffi.from_buffer(header)
    if payload is None:
        rc = lib.dls_agg_send2(sock.fileno(), a, len(a), ffi.NULL, 0)
        want = len(a)
    else:
        b = ffi.from_buffer(payload)
        rc = lib.dls_agg_send2(sock.fileno(), a, len(a), b, len(b))
        want = len(a) + len(b)
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    if rc != want:  # pragma: no cover - dls_agg_send2 loops until done
        raise OSError(errno.EIO, f"sent {rc} of {want} bytes")
