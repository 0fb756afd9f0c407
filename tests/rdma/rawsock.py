"""Speaking the slab server's wire by hand, for tests that send what no client would."""

from __future__ import annotations

import socket


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly n bytes from s (ConnectionError if it closes first)."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the peer hangs up on s within ``seconds``."""
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def still_open(s: socket.socket) -> bool:
    """True when the peer has neither closed s nor sent anything on it (checked without waiting)."""
    s.setblocking(False)
    try:
        s.recv(1)  # b"": closed; anything else: it spoke
        return False
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        s.setblocking(True)
