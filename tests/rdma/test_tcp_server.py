"""The slab server (csrc/tcp_server.c, slab_service.c) frees places held by stalled peers, and refuses a
bad WRITE before buffering its payload."""

from __future__ import annotations

import socket
import time

import numpy as np
import psutil
import pytest

from rdma import wire
from rdma.native import lib
from rdma.endpoint import Endpoint
from rdma.slab_memory import SlabMemory
from rdma.slab_server import SlabServer
from rdma.slab_token import random_token
from tests.rdma.rawsock import closed_within, recv_exact, still_open

MiB = 1 << 20


@pytest.fixture
def quick():
    """A server with short timeouts: 0.3 s for an incomplete frame, 1 s idle."""
    srv = SlabServer("127.0.0.1", 0, threads=2, idle_timeout_s=1.0, frame_timeout_s=0.3)
    reg = SlabMemory(1 << 20)
    tok = random_token()
    srv.add_slab(1, reg, tok)
    yield srv, reg, tok
    srv.stop()
    reg.release()


def _outlive_a_timeout(srv, stall: bytes = b"", rounds: int = 2) -> None:
    """Wait, on events, until srv's timeout has passed for every connection opened before the call:
    open a connection that sends ``stall`` (nothing: the idle timeout; a partial frame: the frame
    timeout) and wait until the server closes it, ``rounds`` times over.  Each worker sweeps its
    own connections, so after one round another worker may not have swept yet; after two, it has."""
    for _ in range(rounds):
        with socket.create_connection(("127.0.0.1", srv.port)) as canary:
            if stall:
                canary.sendall(stall)
            assert closed_within(canary, 10), "the canary was never closed"


def _response(s, timeout=5.0):
    s.settimeout(timeout)
    status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
    assert status == wire.OK
    recv_exact(s, hdr.body_len)
    return hdr


def test_partial_frame_is_closed_after_the_frame_timeout_while_valid_clients_carry_on(quick):
    srv, _, tok = quick
    good = wire.encode_request(wire.Request(wire.OP_READ, 9, 1, tok, (wire.Segment(0, 4096),)))
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tok, [0], [3], b"abc")
        stalled = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        stalled[0].sendall(good[:1])  # one byte
        stalled[1].sendall(good[:45])  # the header and part of a descriptor
        stalled[2].sendall(good + good[:20])  # a whole frame, then a stall
        assert _response(stalled[2]).status == wire.OK
        t0 = time.monotonic()
        for s in stalled:
            assert closed_within(s, 5), "a stalled partial frame kept its place"
            s.close()
        assert time.monotonic() - t0 < 3
        assert lib.dls_server_timed_out(srv._s) >= 3
        out = np.zeros(3, np.uint8)
        ep.read(1, tok, [0], [3], out)  # the valid client is unaffected
        assert out.tobytes() == b"abc"


def test_trickled_frame_is_closed_even_though_bytes_keep_coming(quick):
    """Slowloris: a byte every 50 ms never completes the frame; the deadline is per frame, not per byte."""
    srv, _, tok = quick
    good = wire.encode_request(wire.Request(wire.OP_READ, 9, 1, tok, (wire.Segment(0, 4096),)))
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        t0 = time.monotonic()
        closed = False
        for b in good[:-1]:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if closed_within(s, 0.05):
                closed = True
                break
        assert closed
        assert time.monotonic() - t0 < 2


def test_silent_unauthenticated_connection_is_closed_but_an_idle_consumer_is_not(quick):
    srv, _, tok = quick
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tok, [0], [3], b"xyz")  # carried a valid token, then idles
        _outlive_a_timeout(srv)  # silent connections opened after it are closed: it idled longer
        assert lib.dls_server_timed_out(srv._s) >= 2
        out = np.zeros(3, np.uint8)
        ep.read(1, tok, [0], [3], out)
        assert out.tobytes() == b"xyz"
        assert srv.counters()["open_connections"] == 1


def test_timeouts_can_be_turned_off(quick):
    """A partial frame and a silent peer: the server with timeouts (quick) closes such
    connections opened later; the one without keeps them."""
    on, _, _ = quick
    srv = SlabServer(idle_timeout_s=0, frame_timeout_s=None)
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as partial, \
                socket.create_connection(("127.0.0.1", srv.port)) as silent:
            partial.sendall(b"D")
            _outlive_a_timeout(on, stall=b"D")  # the frame timeout, twice
            _outlive_a_timeout(on, rounds=1)    # and the idle timeout
            assert still_open(partial) and still_open(silent)
        assert lib.dls_server_timed_out(srv._s) == 0
    finally:
        srv.stop()


BAD_WRITES = {
    "token": (1, False, 0, wire.E_TOKEN),
    "noslab": (77, True, 0, wire.E_NOSLAB),
    "bounds": (1, True, 1 << 20, wire.E_BOUNDS),
    "flags": (1, True, 0, wire.E_FLAGS),
}


@pytest.mark.parametrize("case", sorted(BAD_WRITES))
def test_bad_write_is_refused_before_its_payload_and_the_stream_carries_on(quick, case):
    srv, reg, tok = quick
    slab, good_token, base, code = BAD_WRITES[case]
    nseg = 4
    segs = tuple(wire.Segment(base + i * 4096, 4096) for i in range(nseg))
    payload = bytes([0xAB]) * (4096 * nseg)
    flags = 0x80 if case == "flags" else 0
    frame = wire.encode_request(
        wire.Request(wire.OP_WRITE, 31, slab, tok if good_token else random_token(), segs, payload, flags))
    head = len(frame) - len(payload)
    before = reg.view()[: len(payload)].copy()
    ping = wire.encode_request(wire.Request(wire.OP_PING, 32, 0, b"\0" * 16))
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(frame[:head])  # header and descriptors only
        hdr = _response(s, 2)  # refused now, not after the payload
        assert hdr.status == code and hdr.req_id == 31 and hdr.body_len == 0
        # the payload is dropped as it comes, and a request right behind it is served
        s.sendall(frame[head:head + 1000])
        s.sendall(frame[head + 1000:] + ping)
        hdr = _response(s)
        assert hdr.op == wire.OP_PING and hdr.status == wire.OK and hdr.req_id == 32
    assert np.array_equal(reg.view()[: len(payload)], before)


def test_unauthenticated_writes_do_not_grow_server_memory():
    """Four connections each declare and send a 16 MiB WRITE under a wrong token: the
    server must not buffer them (before the fix each kept a 16 MiB buffer)."""
    srv = SlabServer("127.0.0.1", 0, threads=2)
    reg = SlabMemory(16 * MiB)
    tok = random_token()
    srv.add_slab(1, reg, tok)
    proc = psutil.Process()
    segs = tuple(wire.Segment(i * MiB, MiB) for i in range(16))
    payload = bytes(16 * MiB)
    conns = []
    try:
        frame = wire.encode_request(wire.Request(wire.OP_WRITE, 7, 1, random_token(), segs, payload))
        view = memoryview(frame)
        rss0 = proc.memory_info().rss
        for k in range(4):
            s = socket.create_connection(("127.0.0.1", srv.port))
            conns.append(s)
            s.sendall(view)  # all of it at once: whatever the server does, it sees the whole frame
            assert _response(s).status == wire.E_TOKEN
        # everything sent has been taken in (dropped) by the server: prove it with a ping each
        ping = wire.encode_request(wire.Request(wire.OP_PING, 8, 0, b"\0" * 16))
        for s in conns:
            s.sendall(ping)
            assert _response(s).req_id == 8
        grown = proc.memory_info().rss - rss0
        assert srv.counters()["bytes_in"] >= 4 * len(frame)
        assert grown < 8 * MiB, f"server RSS grew by {grown / MiB:.1f} MiB for refused writes"
    finally:
        for s in conns:
            s.close()
        srv.stop()
        reg.release()
