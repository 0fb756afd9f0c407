"""Whole-message socket I/O in C (csrc/agg_io.c) over real socket pairs."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from aggregator.sockio import recv_exact, send_all


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
