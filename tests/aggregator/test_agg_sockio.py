"""Whole-message socket I/O in C (csrc/agg_io.c) over real socket pairs."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from aggregator.conns import Conn, Workers
from aggregator.sockio import recv_exact, send_all, send_nowait
from nodesvc.bus.procs import wait_until


def test_large_header_and_payload_arrive_whole_across_partial_sends():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force many partial sendmsg calls
    payload = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    header = b"H" * 48
    t = threading.Thread(target=send_all, args=(a, header, memoryview(payload)[1:]))
    t.start()
    hb = bytearray(48)
    assert recv_exact(b, hb) and bytes(hb) == header
    out = np.empty(len(payload) - 1, np.uint8)
    assert recv_exact(b, out)
    t.join()
    np.testing.assert_array_equal(out, payload[1:])
    send_all(a, b"only-a-header")
    got = bytearray(13)
    assert recv_exact(b, got) and got == b"only-a-header"
    a.close()
    b.close()


def test_eof_before_and_in_the_middle_of_a_message():
    a, b = socket.socketpair()
    a.close()
    assert recv_exact(b, bytearray(8)) is False
    b.close()
    a, b = socket.socketpair()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(ConnectionError, match="mid-message"):
        recv_exact(b, bytearray(8))
    b.close()


def test_send_to_a_closed_peer_raises_oserror():
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(OSError):
        for _ in range(100):
            send_all(a, b"x" * 65536)
    a.close()


def test_send_nowait_takes_what_fits_and_never_blocks():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = bytes(range(256)) * (1 << 14)  # 4 MiB: far more than the buffers hold
    sent = send_nowait(a, b"H" * 48, payload)
    assert 0 < sent < 48 + len(payload)
    assert send_nowait(a, b"more") == 0  # full: nothing goes, nothing blocks
    a.close()
    b.close()


def test_a_connection_sends_inline_and_hands_the_rest_to_a_worker():
    """Conn.send writes a small message as far as the socket takes it at once and queues the rest for
    a worker; a large one goes to the worker whole; all in order, each done() called once, after
    the message's last byte."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    workers = Workers("t", 4)
    conn = Conn(a, "127.0.0.1", 1, workers, hello_deadline=0.0)
    done: list[int] = []
    msgs = [(b"A" * 48, bytes([1]) * 10), (b"B" * 48, bytes([2]) * (200 << 10)), (b"C" * 48, None),
            (b"D" * 48, bytes([4]) * (3 << 20))]
    try:
        for i, (h, p) in enumerate(msgs):
            conn.send(h, None if p is None else memoryview(p), lambda i=i: done.append(i))
        want = b"".join(h + (p or b"") for h, p in msgs)
        got = bytearray(len(want))
        assert recv_exact(b, got)
        assert got == want
        wait_until(lambda: len(done) == 4, what="every done() called")
        assert done == [0, 1, 2, 3]
    finally:
        workers.stop()
        a.close()
        b.close()
