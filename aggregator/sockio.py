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


def send_nowait(sock: socket.socket, header, payload=None) -> int:
    """Send as much of ``header`` then ``payload`` as the socket takes now, in one call; the bytes sent."""
    a = ffi.from_buffer(header)
    if payload is None:
        rc = lib.dls_agg_send2_nowait(sock.fileno(), a, len(a), ffi.NULL, 0)
    else:
        b = ffi.from_buffer(payload)
        rc = lib.dls_agg_send2_nowait(sock.fileno(), a, len(a), b, len(b))
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return rc


IDLE = -1  # recv_frame: nothing arrived within wait_ms


def recv_frame(sock: socket.socket, view, wait_ms: int, timeout_ms: int) -> int:
    """Fill ``view`` within ``timeout_ms`` of its first byte (a frame deadline).

    With ``wait_ms >= 0``, wait at most that long for the first byte and return :data:`IDLE` if none
    came.  Returns 1 when filled, 0 on EOF before the first byte; raises :class:`TimeoutError` when
    the deadline passed mid-frame and :class:`ConnectionError` when the peer closed mid-frame."""
    buf = ffi.from_buffer(view, require_writable=True)
    n = len(buf)
    rc = lib.dls_agg_recv_deadline(sock.fileno(), buf, n, wait_ms, timeout_ms)
    if rc == n:
        return 1
    if rc == 0 and n:
        return 0
    if rc == -errno.EAGAIN:
        return IDLE
    if rc == -errno.ETIMEDOUT:
        raise TimeoutError(f"frame of {n} bytes not received within {timeout_ms / 1000:g} s")
    if rc == -errno.ECONNRESET:
        raise ConnectionError("peer closed the connection mid-message")
    raise OSError(-rc, os.strerror(-rc))
