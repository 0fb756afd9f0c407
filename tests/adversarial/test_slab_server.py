"""Attacks on the slab server's port (csrc/tcp_server.c, slab_service.c): anyone who can reach it.

The ceilings checked here are the ones the README's Security section documents: connections
(global and per peer address), file descriptors, threads, and memory per connection with and
without a valid token."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from nodesvc.bus.procs import wait_until
from rdma import wire
from rdma.native import lib
from rdma.endpoint import Endpoint
from tests.adversarial.conftest import ROOT
from tests.rdma.rawsock import closed_within, recv_exact

MiB = 1 << 20
PING = wire.encode_request(wire.Request(wire.OP_PING, 7, 0, b"\0" * 16))


def _ping(s: socket.socket, timeout: float = 5.0) -> int:
    """One PING round trip on a raw socket; the response's status."""
    s.settimeout(timeout)
    s.sendall(PING)
    status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
    return hdr.status


def _served(port: int, source: str = "127.0.0.1") -> bool:
    """Whether a new connection from ``source`` is admitted (it answers a PING) rather than closed."""
    s = socket.socket()
    try:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        return _ping(s, 3) == wire.OK
    except (ConnectionError, OSError):
        return False
    finally:
        s.close()


def test_a_tokenless_pinger_cannot_hold_a_slot_past_the_idle_window(slab_server):
    """Promise: a connection that has not presented a valid token is closed within idle_timeout_s
    of opening (plus one sweep, a quarter of it), whatever it sends: PINGs do not extend it.
    (Issue 16, failure 3: a PING reset the idle timer, so the timeout never fired.)"""
    srv, _ = slab_server(idle_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        t0 = time.monotonic()
        closed_at = None
        while time.monotonic() - t0 < 8:
            try:
                _ping(s, 2)
            except (ConnectionError, OSError):
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.1)
    assert closed_at is not None, "a tokenless client kept its slot for 8 s by sending PINGs"
    assert 0.9 <= closed_at < 4.0, closed_at


def test_a_token_holder_keeps_its_idle_connection(slab_server):
    """Promise: a connection that presented a valid token is not closed for idling (consumers keep
    one per donor between bursts), so the idle window costs real clients nothing."""
    srv, tok = slab_server(idle_timeout_s=0.5)
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tok, [0], [3], b"abc")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # three idle windows, pinging only
            ep.ping()
            time.sleep(0.1)
        out = np.zeros(3, np.uint8)
        ep.read(1, tok, [0], [3], out)
        assert out.tobytes() == b"abc"


def test_tokenless_clients_cannot_lock_out_a_token_holder(slab_server):
    """Promise: when every connection slot is held by tokenless clients that keep PINGing, a client
    with a valid token gets a slot within the idle window (1 s here, plus a sweep).
    (Issue 16, failure 3: a valid client was refused for as long as the strangers pinged.)"""
    srv, tok = slab_server(max_connections=6, idle_timeout_s=1.0)
    holders = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(6)]
    stop = threading.Event()

    def keep_pinging() -> None:
        while not stop.is_set():
            for s in holders:
                try:
                    _ping(s, 1)
                except (ConnectionError, OSError):
                    pass
            stop.wait(0.1)

    t = threading.Thread(target=keep_pinging, daemon=True)
    t.start()
    try:
        wait_until(lambda: srv.counters()["open_connections"] == 6, 5, "the holders to be in")
        t0 = time.monotonic()
        got_in = None
        while time.monotonic() - t0 < 8:
            try:
                with Endpoint("127.0.0.1", srv.port, timeout_ms=1000) as ep:
                    ep.write(1, tok, [0], [2], b"ok")
                    got_in = time.monotonic() - t0
                    break
            except (ConnectionError, OSError):
                time.sleep(0.1)
        assert got_in is not None, "the token holder was locked out for 8 s"
        assert got_in < 4.0, got_in
    finally:
        stop.set()
        t.join(5)
        for s in holders:
            s.close()


def test_one_peer_address_cannot_take_more_than_its_share(slab_server):
    """Promise: one peer address holds at most max_connections_per_peer connections; more from it
    are closed at once, another address still gets in, and a closed connection frees its place."""
    srv, _ = slab_server(max_connections=64, max_connections_per_peer=4, idle_timeout_s=0)
    mine = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
    try:
        for s in mine:
            assert _ping(s) == wire.OK
        extra = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        for s in extra:
            assert closed_within(s, 5), "a fifth connection from the same address was admitted"
            s.close()
        assert srv.counters()["refused_per_peer"] == 2
        assert _served(srv.port, source="127.0.0.2"), "another address was refused"
        mine.pop().close()
        wait_until(lambda: srv.counters()["open_connections"] == 3, 5, "the server to see the close")
        assert _served(srv.port), "a freed place was not given back to its peer"
    finally:
        for s in mine:
            s.close()


_FD_STARVED = r"""
import os, sys
from rdma.slab_server import SlabServer
srv = SlabServer("127.0.0.1", 0, threads=2, idle_timeout_s=0, frame_timeout_s=0)
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
except OSError:
    pass
print(srv.port, len(filler), flush=True)
sys.stdin.readline()
for fd in filler:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
srv.stop()
"""


def _cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def test_out_of_file_descriptors_the_server_backs_off_and_recovers():
    """Promise: a server whose process has run out of file descriptors does not spin (pending
    connections are refused or wait, at under 10% of a core), and serves again once
    descriptors are free.  (Issue 16, failure 2: accept returned on EMFILE while the listening
    socket stayed readable, and each worker burnt a core.)"""
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    child = subprocess.Popen([sys.executable, "-c", _FD_STARVED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             cwd=ROOT, preexec_fn=low_limit, text=True)
    clients: list[socket.socket] = []
    try:
        port, filled = (int(x) for x in child.stdout.readline().split())
        assert filled > 100  # the process really is out of descriptors
        for _ in range(16):  # each completes the handshake into the backlog: the listener is readable
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        proc = psutil.Process(child.pid)
        time.sleep(0.3)  # past the first reaction to the pending connections
        c0, t0 = _cpu_s(proc), time.monotonic()
        time.sleep(2.0)
        busy = (_cpu_s(proc) - c0) / (time.monotonic() - t0)
        assert busy < 0.1, f"the server burnt {busy:.2f} cores while out of descriptors"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "freed"
        wait_until(lambda: _served(port), 30, "the server to serve again once descriptors were free")
    finally:
        for s in clients:
            s.close()
        if child.poll() is None:
            try:
                child.stdin.write("\n")
                child.stdin.flush()
                child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait()


def test_a_tokenless_peer_that_does_not_read_pins_little_memory(slab_server):
    """Promise: a connection without a valid token cannot make the server queue much for it: once
    its socket is full the server stops reading from it, so its queue stays within one input
    buffer's worth of responses (~64 KiB), and 16 such peers flooding PINGs cost under 24 MiB."""
    srv, _ = slab_server(idle_timeout_s=0, frame_timeout_s=0)
    flood = PING * ((16 * MiB) // len(PING))  # 16 MiB of PINGs: 9.6 MiB of responses each
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    conns = []
    try:
        for _ in range(16):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            conns.append([s, memoryview(flood)])
        deadline = time.monotonic() + 3.0  # send what the server takes in
        while time.monotonic() < deadline and any(len(v) for _, v in conns):
            moved = 0
            for c in conns:
                try:
                    n = c[0].send(c[1][: 1 << 20])
                    c[1] = c[1][n:]
                    moved += n
                except BlockingIOError:
                    pass
            if not moved:
                time.sleep(0.05)
        grown = proc.memory_info().rss - rss0
        assert srv.counters()["requests"] > 16 * 2000  # it did serve them, until the queues filled
        assert grown < 24 * MiB, f"16 non-reading tokenless peers grew the server by {grown / MiB:.0f} MiB"
    finally:
        for s, _ in conns:
            s.close()


def test_a_token_holder_that_stops_reading_is_closed_after_the_frame_timeout(slab_server):
    """Promise: a peer that stops reading its responses, even one with a valid token, is closed once
    its queued output has made no progress for frame_timeout_s; the memory it pinned is freed."""
    srv, tok = slab_server(frame_timeout_s=0.5)
    segs = tuple(wire.Segment(i * 256 * 1024, 256 * 1024) for i in range(4))
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for i in range(16):  # 16 MiB of responses that are never read
            s.sendall(wire.encode_request(wire.Request(wire.OP_READ, i, 1, tok, segs)))
        wait_until(lambda: srv.counters()["requests"] >= 2, 5, "the server to take the requests")
        wait_until(lambda: srv.counters()["open_connections"] == 0, 6,
                   "the server to close a token holder that stopped reading")
        assert lib.dls_server_timed_out(srv._s) >= 1
    finally:
        s.close()


def test_connections_do_not_add_threads(slab_server):
    """Promise: the server's threads are its ``threads`` workers however many peers connect."""
    srv, _ = slab_server(threads=2, idle_timeout_s=0, max_connections_per_peer=400)
    me = psutil.Process()
    before = me.num_threads()
    conns = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(300)]
    try:
        for s in conns[::30]:
            assert _ping(s) == wire.OK
        wait_until(lambda: srv.counters()["open_connections"] == 300, 10, "300 connections to be in")
        assert me.num_threads() == before
    finally:
        for s in conns:
            s.close()


def test_connection_churn_leaks_no_descriptors(slab_server):
    """Promise: every connection the server drops (peer hang-up, reset, refusal over the cap, a
    stalled frame, a bad frame) gives its file descriptor back."""
    srv, tok = slab_server(max_connections=20, frame_timeout_s=0.3)
    me = psutil.Process()
    base = me.num_fds()
    good = wire.encode_request(wire.Request(wire.OP_READ, 9, 1, tok, (wire.Segment(0, 4096),)))
    for round_ in range(10):
        batch = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(30)]  # 10 over the cap
        for k, s in enumerate(batch):
            try:
                if k % 3 == 0:
                    s.sendall(good[:20])  # a stalled frame
                elif k % 3 == 1:
                    s.sendall(b"\xff" * 64)  # garbage: the stream cannot be resynchronised
                else:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST on close
            except OSError:
                pass  # one of the refused ones
        for s in batch:
            s.close()
    wait_until(lambda: srv.counters()["open_connections"] == 0, 10, "every connection to be dropped")
    assert srv.counters()["refused"] > 0
    wait_until(lambda: me.num_fds() <= base, 5, "the descriptors to come back")


def test_garbage_from_many_peers_does_not_disturb_a_valid_client(slab_server):
    """Promise: random bytes on many connections get error statuses or a closed connection, never
    a crash or an access outside a slab, and a valid client is served meanwhile."""
    srv, tok = slab_server()
    rng = np.random.default_rng(16)
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tok, [0], [4], b"good")
        for k in range(50):
            junk = rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
            if k % 2:  # a valid header in front of junk: the parser goes deeper
                junk = wire.REQ_HDR.pack(wire.MAGIC, wire.VERSION, wire.OP_READ, 0, k, 1, 1000, tok) + junk
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                try:
                    s.sendall(junk)
                except OSError:
                    pass
        out = np.zeros(4, np.uint8)
        ep.read(1, tok, [0], [4], out)
        assert out.tobytes() == b"good"
    assert srv.counters()["bad_frames"] > 0


@pytest.mark.parametrize("offset,length", [((1 << 64) - 4096, 8192), ((1 << 20) - 1, 2), (1 << 40, 4096)])
def test_segments_past_the_slab_or_wrapping_around_are_refused(slab_server, offset, length):
    """Promise: a segment that ends past its slab, including one whose offset + length wraps past
    2**64, is refused with E_BOUNDS and touches nothing."""
    srv, tok = slab_server()
    req = wire.encode_request(wire.Request(wire.OP_READ, 5, 1, tok, (wire.Segment(offset, length),)))
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.settimeout(5)
        s.sendall(req)
        status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
        assert hdr.status == wire.E_BOUNDS and hdr.body_len == 0
        assert _ping(s) == wire.OK  # and the stream goes on


def test_descriptor_ceiling_follows_the_process_limit():
    """Promise: the server never admits more connections than RLIMIT_NOFILE leaves room for (the
    soft limit minus a reserve for the rest of the process), whatever max_connections says."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    from rdma.slab_server import SlabServer

    srv = SlabServer(max_connections=1 << 30, idle_timeout_s=0)
    try:
        assert 0 < srv.max_connections <= max(1, soft - 64)
    finally:
        srv.stop()


def test_a_token_holder_gives_big_buffers_back_when_it_idles(slab_server):
    """Promise: the input buffer a single 16 MiB WRITE grew is given back once the connection idles
    (about a second), so a peer between bursts pins a 64 KiB buffer, not 16 MiB and more."""
    from rdma.slab_memory import SlabMemory
    from rdma.slab_token import random_token

    srv, _ = slab_server(idle_timeout_s=0, frame_timeout_s=0)  # no timeouts: the sweep runs each second
    big, tok = SlabMemory(16 * MiB), random_token()
    srv.add_slab(2, big, tok)
    big.view()[:] = 1  # the slab's own pages are in before the measure
    segs = tuple(wire.Segment(i * MiB, MiB) for i in range(16))
    frame = wire.encode_request(wire.Request(wire.OP_WRITE, 1, 2, tok, segs, bytes(16 * MiB)))
    me = psutil.Process()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(frame)  # one frame: the server buffers all of it before it writes the slab
            s.settimeout(10)
            status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
            assert hdr.status == wire.OK
            after_write = me.memory_info().rss
            wait_until(lambda: after_write - me.memory_info().rss >= 8 * MiB, 8,
                       "the server to give back the 16 MiB input buffer of an idle connection")
            assert _ping(s) == wire.OK  # and the connection still works
    finally:
        srv.remove_slab(2)
        big.release()
