"""The C data plane against real sockets: slab server, tcp provider, regions."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading

import numpy as np
import psutil
import pytest

from nodesvc.bus.procs import wait_until
from rdma import wire
from rdma.endpoint import Endpoint, provider_available
from rdma.errors import RemoteMemoryError
from rdma.native import crc32c, ffi, lib
from rdma.slab_memory import SlabMemory
from rdma.slab_server import SlabServer
from rdma.slab_token import random_token
from tests.rdma.rawsock import recv_exact

PAGE = 4096


@pytest.fixture
def served():
    srv = SlabServer("127.0.0.1", 0, threads=2)
    regions = {}
    tokens = {}
    for sid, size in ((1, 1 << 20), (2, 4 << 20)):
        regions[sid] = SlabMemory(size)
        tokens[sid] = random_token()
        srv.add_slab(sid, regions[sid], tokens[sid])
    yield srv, regions, tokens
    srv.stop()
    for r in regions.values():
        r.release()


def pages(n, start=0):
    return np.arange(start, start + n, dtype=np.uint64) * PAGE, np.full(n, PAGE, dtype=np.uint32)


def test_write_then_read_roundtrip_with_checksums(served):
    srv, regions, tokens = served
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    offs, lens = pages(1024)
    with Endpoint("127.0.0.1", srv.port) as ep:
        wcrc = ep.write(2, tokens[2], offs, lens, data, crc=True)
        out = np.zeros_like(data)
        rcrc = ep.read(2, tokens[2], offs, lens, out, crc=True)
    assert np.array_equal(out, data)
    assert np.array_equal(wcrc, rcrc)
    # the bytes really sit in the donor's region
    assert np.array_equal(regions[2].view()[: len(data)], data)
    st = srv.slab_stats(2)
    assert st.bytes_written == len(data) and st.bytes_read == len(data) and st.last_access_ns > 0


def test_large_pipelined_batch_scattered(served):
    srv, regions, tokens = served
    rng = np.random.default_rng(2)
    order = rng.permutation(1024)
    offs = order.astype(np.uint64) * PAGE
    lens = np.full(1024, PAGE, dtype=np.uint32)
    data = rng.integers(0, 256, 1024 * PAGE, dtype=np.uint8)
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(2, tokens[2], offs, lens, data)
        out = np.zeros_like(data)
        ep.read(2, tokens[2], offs, lens, out)
    assert np.array_equal(out, data)
    view = regions[2].view()
    for k in (0, 17, 1023):
        assert np.array_equal(view[order[k] * PAGE:(order[k] + 1) * PAGE], data[k * PAGE:(k + 1) * PAGE])


@pytest.mark.parametrize("case, code", [
    ("token", wire.E_TOKEN), ("bounds", wire.E_BOUNDS), ("straddle", wire.E_BOUNDS), ("noslab", wire.E_NOSLAB)])
def test_bad_requests_get_error_codes(served, case, code):
    srv, regions, tokens = served
    before = regions[1].view().copy()
    slab, tok, off, n = 1, tokens[1], 0, PAGE
    if case == "token":
        tok = bytes(16)
    elif case == "bounds":
        off = 1 << 20
    elif case == "straddle":
        off = (1 << 20) - 100
    elif case == "noslab":
        slab = 77
    with Endpoint("127.0.0.1", srv.port) as ep:
        with pytest.raises(RemoteMemoryError) as ei:
            ep.write(slab, tok, [off], [n], np.full(n, 7, np.uint8))
        assert ei.value.code == code
        with pytest.raises(RemoteMemoryError) as ei:
            ep.read(slab, tok, [off], [n], np.zeros(n, np.uint8))
        assert ei.value.code == code
        # the connection stays usable after an error status
        ep.write(1, tokens[1], [0], [4], b"abcd")
        out = np.zeros(4, np.uint8)
        ep.read(1, tokens[1], [0], [4], out)
        assert out.tobytes() == b"abcd"
    assert np.array_equal(regions[1].view()[4:], before[4:])


def test_write_with_corrupted_checksum_is_refused(served):
    srv, regions, tokens = served
    payload = b"x" * 64
    req = wire.Request(wire.OP_WRITE, 5, 1, tokens[1], (wire.Segment(0, 64, 12345),), payload, wire.F_CRC)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(wire.encode_request(req))
        status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
    assert status == wire.OK and hdr.status == wire.E_CRC and hdr.req_id == 5
    assert regions[1].view()[:64].tobytes() != payload


def test_garbage_and_truncated_frames_do_not_hurt_valid_clients(served):
    """Random, truncated and hostile bytes on many connections while a valid client keeps checking data."""
    srv, regions, tokens = served
    rng = np.random.default_rng(3)
    ref = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    offs, lens = pages(256)
    stop = threading.Event()
    errors: list[str] = []

    rounds = [0]

    def valid_client():
        try:
            with Endpoint("127.0.0.1", srv.port) as ep:
                ep.write(1, tokens[1], offs, lens, ref, crc=True)
                out = np.empty_like(ref)
                while not stop.is_set():
                    ep.read(1, tokens[1], offs, lens, out, crc=True)
                    rounds[0] += 1
                    if not np.array_equal(out, ref):
                        errors.append("data differs")
                        return
        except Exception as exc:  # reported by the assertion below
            errors.append(repr(exc))

    t = threading.Thread(target=valid_client)
    t.start()
    r = random.Random(4)
    good = wire.encode_request(wire.Request(wire.OP_READ, 9, 1, tokens[1], (wire.Segment(0, 4096),)))
    huge_claim = wire.encode_request(wire.Request(wire.OP_WRITE, 9, 1, tokens[1], (wire.Segment(0, 1 << 20),)))
    try:
        for i in range(120):
            kind = i % 5
            if kind == 0:
                blob = r.randbytes(r.randint(1, 5000))
            elif kind == 1:
                blob = good[: r.randint(1, len(good) - 1)]  # truncated, then hang up
            elif kind == 2:
                blob = struct.pack("<I", wire.MAGIC) + r.randbytes(r.randint(0, 200))
            elif kind == 3:
                blob = huge_claim + r.randbytes(100)  # claims 1 MiB, sends little
            else:
                b = bytearray(good)
                b[r.randrange(len(b))] ^= 0xFF
                blob = bytes(b) * 3
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(blob)
                if i % 2:
                    s.settimeout(0.05)
                    try:
                        s.recv(65536)
                    except (socket.timeout, ConnectionError):
                        pass
    finally:
        stop.set()
        t.join(30)
    assert not errors
    assert rounds[0] > 0
    assert srv.counters()["bad_frames"] > 0
    # the server still serves everything correctly
    with Endpoint("127.0.0.1", srv.port) as ep:
        out = np.empty_like(ref)
        ep.read(1, tokens[1], offs, lens, out, crc=True)
        assert np.array_equal(out, ref)
        ep.ping()


def test_bad_header_gets_error_response_then_close(served):
    srv, _, tokens = served
    frame = bytearray(wire.encode_request(wire.Request(wire.OP_READ, 42, 1, tokens[1], (wire.Segment(0, 16),))))
    frame[4] = 7  # version
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(bytes(frame))
        status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
        assert status == wire.OK and hdr.status == wire.E_VERSION
        s.settimeout(5)
        assert s.recv(10) == b""  # and the server hangs up: the stream cannot be trusted


def test_removed_slab_is_no_longer_served(served):
    srv, regions, tokens = served
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tokens[1], [0], [8], b"12345678")
        assert srv.remove_slab(1)
        with pytest.raises(RemoteMemoryError) as ei:
            ep.read(1, tokens[1], [0], [8], np.zeros(8, np.uint8))
        assert ei.value.code == wire.E_NOSLAB
    assert not srv.remove_slab(1)


def test_server_death_is_an_io_error_not_a_hang():
    srv = SlabServer()
    reg = SlabMemory(1 << 20)
    tok = random_token()
    srv.add_slab(0, reg, tok)
    ep = Endpoint("127.0.0.1", srv.port, timeout_ms=3000)
    ep.write(0, tok, [0], [4], b"abcd")
    srv.stop()
    with pytest.raises(RemoteMemoryError) as ei:
        ep.read(0, tok, [0], [4], np.zeros(4, np.uint8))
    assert ei.value.code in (wire.E_IO, wire.E_CLOSED)
    assert ep.broken
    with pytest.raises(RemoteMemoryError) as ei:
        ep.read(0, tok, [0], [4], np.zeros(4, np.uint8))
    assert ei.value.code == wire.E_CLOSED
    ep.close()
    reg.release()


def test_client_rejects_bad_arguments_locally(served):
    srv, _, tokens = served
    with Endpoint("127.0.0.1", srv.port) as ep:
        with pytest.raises(RemoteMemoryError) as ei:
            ep.read(1, tokens[1], [0], [wire.MAX_SEG_BYTES + 1], np.zeros(wire.MAX_SEG_BYTES + 1, np.uint8))
        assert ei.value.code == wire.E_ARG
        with pytest.raises(ValueError):
            ep.read(1, tokens[1], [0], [100], np.zeros(10, np.uint8))
        ep.ping()  # still usable


def test_unknown_provider_says_why():
    assert provider_available("tcp")
    if not provider_available("verbs"):
        with pytest.raises(ConnectionError, match="verbs"):
            Endpoint("127.0.0.1", 1, provider="verbs")


def test_region_memory_returns_to_the_os_on_release():
    proc = psutil.Process(os.getpid())
    base = proc.memory_info().rss
    reg = SlabMemory(64 << 20)
    reg.view()[:] = 1  # touch every page
    grown = proc.memory_info().rss
    assert grown - base > 60 << 20
    reg.release()
    assert reg.released
    assert proc.memory_info().rss < grown - (60 << 20)


def test_region_hugepages_and_mlock_fall_back_with_a_reason():
    reg = SlabMemory(4 << 20, huge=True, lock=True)
    try:
        assert reg.address % 4096 == 0 and reg.size >= 4 << 20
        if not reg.huge or not reg.locked:
            assert reg.reason  # the fallback is explained
        reg.view()[:] = 3
    finally:
        reg.release()


def test_tokens_are_random():
    toks = {random_token() for _ in range(64)}
    assert len(toks) == 64 and all(len(t) == 16 for t in toks)


def test_local_crc_is_computed_by_the_reader(served):
    srv, regions, tokens = served
    data = np.random.default_rng(9).integers(0, 256, 8 * PAGE, dtype=np.uint8)
    offs, lens = pages(8)
    with Endpoint("127.0.0.1", srv.port) as ep:
        before = srv.counters()["errors"]
        wcrcs = ep.write(1, tokens[1], offs, lens, data, local_crc=True)
        assert [int(c) for c in wcrcs] == [crc32c(data[i * PAGE:(i + 1) * PAGE]) for i in range(8)]
        assert srv.counters()["errors"] == before
        out = np.empty_like(data)
        crcs = ep.read(1, tokens[1], offs, lens, out, local_crc=True)
        assert [int(c) for c in crcs] == [crc32c(data[i * PAGE:(i + 1) * PAGE]) for i in range(8)]
        one = np.empty(PAGE, np.uint8)
        assert ep.read_one(1, tokens[1], 3 * PAGE, PAGE, one, local_crc=True) == crc32c(data[3 * PAGE:4 * PAGE])
        assert ep.read_one(1, tokens[1], 3 * PAGE, PAGE, one, crc=True) == crc32c(data[3 * PAGE:4 * PAGE])
        assert np.array_equal(one, data[3 * PAGE:4 * PAGE])


def test_responses_queue_correctly_when_the_reader_is_slow(served):
    """A client that sends many large reads and reads nothing for a while: the server
    sends what the socket takes straight from the slab and queues the rest in order."""
    srv, regions, tokens = served
    view = regions[2].view()
    view[:] = np.random.default_rng(12).integers(0, 256, len(view), dtype=np.uint8)
    reqs = []
    for i in range(24):
        off = (i * 37 % 3) * (1 << 20)
        segs = tuple(wire.Segment(off + k * PAGE, PAGE) for k in range(0, 256, 2)) + (wire.Segment(off, 1 << 19),)
        reqs.append((i, segs))
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        # All 24 requests (50 KB) in one send, so the server reads them in one go: once a response
        # does not fit in the socket it stops reading its input until the peer takes some (back
        # pressure), so requests sent one by one could leave it waiting with only the first few read
        # (seen in CI: fewer than 6 served after 10 s).
        s.sendall(b"".join(wire.encode_request(wire.Request(wire.OP_READ, i, 2, tokens[2], segs, flags=wire.F_CRC))
                           for i, segs in reqs))
        # ~1 MiB per response: by the 6th the socket (64 KiB here, at most tcp_wmem's 4 MiB there) is
        # full and the server queues what it cannot send; it stops serving at 8 MiB queued, so waiting
        # for 8 served would race the ceiling
        wait_until(lambda: srv.counters()["requests"] >= 6, 10, "the server to fill the socket")
        s.settimeout(10)
        for i, segs in reqs:
            status, hdr = wire.parse_response_header(recv_exact(s, wire.RESP_HDR.size))
            assert status == wire.OK and hdr.status == wire.OK and hdr.req_id == i
            body = recv_exact(s, hdr.body_len)
            crcs = np.frombuffer(body[: 4 * len(segs)], dtype="<u4")
            data = body[4 * len(segs):]
            pos = 0
            for k, seg in enumerate(segs):
                want = view[seg.offset:seg.offset + seg.length].tobytes()
                assert data[pos:pos + seg.length] == want
                assert int(crcs[k]) == crc32c(want)
                pos += seg.length


def test_connection_flood_is_capped_and_served_clients_carry_on():
    srv = SlabServer(max_connections=4)
    reg = SlabMemory(1 << 20)
    tok = random_token()
    srv.add_slab(0, reg, tok)
    try:
        eps = [Endpoint("127.0.0.1", srv.port) for _ in range(4)]
        for ep in eps:
            ep.ping()  # these four are in
        extra = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        for s in extra:
            s.settimeout(5)
            assert s.recv(1) == b""  # closed at once
            s.close()
        assert srv.counters()["refused"] == 3
        eps[0].write(0, tok, [0], [3], b"abc")
        out = np.zeros(3, np.uint8)
        eps[1].read(0, tok, [0], [3], out)
        assert out.tobytes() == b"abc"
        eps[3].close()
        wait_until(lambda: srv.counters()["open_connections"] == 3, 10, "the server to see the close")
        with Endpoint("127.0.0.1", srv.port) as again:  # a freed place can be taken
            again.ping()
        for ep in eps[:3]:
            ep.close()
    finally:
        srv.stop()
        reg.release()


def test_closing_an_endpoint_under_concurrent_readers_is_safe(served):
    """close() while other threads are inside C calls on the same endpoint must not free it under them."""
    srv, regions, tokens = served
    for _ in range(5):
        ep = Endpoint("127.0.0.1", srv.port)
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader():
            out = np.empty(16 * PAGE, dtype=np.uint8)
            offs, lens = pages(16)
            while not stop.is_set():
                try:
                    ep.read(1, tokens[1], offs, lens, out)
                except RemoteMemoryError as exc:
                    if exc.code != wire.E_CLOSED:
                        errors.append(exc)
                    return

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        ep.close()  # the process would die here (SIGSEGV) if C memory were freed under the readers
        stop.set()
        for t in threads:
            t.join(10)
        assert not errors and ep._ep is None  # the last reader out closed it


def test_single_page_crcs_do_not_leak_between_threads(served):
    """read_one's CRC is per call: 4 threads reading different pages each get their own page's CRC."""
    srv, regions, tokens = served
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, 8 * PAGE, dtype=np.uint8)
    with Endpoint("127.0.0.1", srv.port) as ep:
        ep.write(1, tokens[1], *pages(8), data)
        want = [crc32c(data[i * PAGE:(i + 1) * PAGE]) for i in range(8)]
        wrong: list[tuple[int, int]] = []

        def worker(i):
            out = np.empty(PAGE, dtype=np.uint8)
            for _ in range(1500):
                got = ep.read_one(1, tokens[1], i * PAGE, PAGE, out, local_crc=True)
                if got != want[i]:
                    wrong.append((i, got))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert wrong == []


def test_buffers_handed_to_c_are_checked(served):
    srv, regions, tokens = served
    out = np.empty(4 * PAGE, dtype=np.uint8)
    with Endpoint("127.0.0.1", srv.port) as ep:
        with pytest.raises(ValueError, match="crcs"):
            ep.read(1, tokens[1], *pages(4), out, crc=True, crcs=np.zeros(1, np.uint32))  # too short
        with pytest.raises(ValueError, match="crcs"):
            ep.read(1, tokens[1], *pages(4), out, crc=True, crcs=np.zeros(4, np.int64))  # wrong dtype
        with pytest.raises(ValueError, match="16 bytes"):
            ep.read(1, tokens[1][:8], *pages(4), out)
        with pytest.raises(ValueError, match="16 bytes"):
            ep.read_one(1, b"short", 0, PAGE, out)


def test_write_many_writes_every_copy_at_once_and_reports_each_one():
    """dls_ep_write_many: the same batch to several copies in one wait (the region engine's
    write-back); a copy that refuses (a wrong token) fails alone, the others hold the bytes."""
    servers = [SlabServer("127.0.0.1", 0, threads=1) for _ in range(3)]
    regions = [SlabMemory(1 << 20) for _ in servers]
    tokens = [random_token() for _ in servers]
    for s, r, t in zip(servers, regions, tokens):
        s.add_slab(7, r, t)
    err, out = ffi.new("char[256]"), ffi.new("dls_ep **")
    eps = []
    for s in servers:
        assert lib.dls_ep_connect(b"tcp", b"127.0.0.1", s.port, 2000, out, err, 256) == 0, ffi.string(err)
        eps.append(out[0])
    try:
        n = 64
        data = np.random.default_rng(2).integers(0, 256, n * PAGE, dtype=np.uint8)
        offs = np.arange(n, dtype=np.uint64)[::-1].copy() * PAGE  # scattered: back to front
        lens = np.full(n, PAGE, dtype=np.uint32)
        keep = []

        def batch(token: bytes):
            tok = ffi.new("uint8_t[16]", token)
            keep.append(tok)
            return ffi.new("dls_batch *", {"slab": 7, "token": tok, "nseg": n,
                                            "offs": ffi.cast("uint64_t *", ffi.from_buffer(offs)),
                                            "lens": ffi.cast("uint32_t *", ffi.from_buffer(lens)),
                                            "buf": ffi.cast("uint8_t *", ffi.from_buffer(data)),
                                            "timeout_ms": 2000, "bad_seg": -1})

        bs = [batch(tokens[0]), batch(bytes(16)), batch(tokens[2])]  # the second copy's token is wrong
        rcs = ffi.new("int[3]")
        lib.dls_ep_write_many(ffi.new("dls_ep *[]", eps), ffi.new("dls_batch *[]", bs), 3, rcs)
        assert rcs[0] == 0 and rcs[2] == 0 and rcs[1] == wire.E_TOKEN, list(rcs)
        want = data.reshape(n, PAGE)[::-1].reshape(-1)  # segment i landed at offs[i]
        assert np.array_equal(regions[0].view()[: n * PAGE], want)
        assert np.array_equal(regions[2].view()[: n * PAGE], want)
        assert not regions[1].view()[: n * PAGE].any()
        # a copy whose server is gone fails with an I/O error; the live one still takes the batch
        servers[0].stop()
        rcs2 = ffi.new("int[2]")
        lib.dls_ep_write_many(ffi.new("dls_ep *[]", [eps[0], eps[2]]), ffi.new("dls_batch *[]", [bs[0], bs[2]]),
                              2, rcs2)
        assert rcs2[0] < 0 and rcs2[1] == 0, list(rcs2)
    finally:
        for e in eps:
            if e != ffi.NULL:
                lib.dls_ep_close(e)
        for s in servers[1:]:
            s.stop()
        for r in regions:
            r.release()


def _donors_with_slabs(nservers: int, nslab: int):
    """Slab servers with slabs 0..nslab-1 of 1 MiB each, a token each, and a connection to each."""
    servers = [SlabServer("127.0.0.1", 0, threads=1) for _ in range(nservers)]
    regions = [[SlabMemory(1 << 20) for _ in range(nslab)] for _ in servers]
    tokens = [[random_token() for _ in range(nslab)] for _ in servers]
    for s, rs, ts in zip(servers, regions, tokens):
        for k, (r, t) in enumerate(zip(rs, ts)):
            s.add_slab(k, r, t)
    err, out = ffi.new("char[256]"), ffi.new("dls_ep **")
    eps = []
    for s in servers:
        assert lib.dls_ep_connect(b"tcp", b"127.0.0.1", s.port, 2000, out, err, 256) == 0, ffi.string(err)
        eps.append(out[0])
    return servers, regions, tokens, eps


def _close(servers, regions, eps) -> None:
    for e in eps:
        lib.dls_ep_close(e)
    for s in servers:
        s.stop()  # one a test stopped already: a no-op
    for rs in regions:
        for r in rs:
            r.release()


def test_write_many_random_mixes_land_in_call_order_per_connection():
    """Random mixes of batches over 3 donors (several a connection, slabs shared, pages overlapping,
    some tokens wrong): each batch's status is its own, and every slab ends as the batches that
    landed leave it when applied in call order (a connection's batches are sent in order)."""
    nslab, npages = 3, 32
    servers, regions, tokens, eps = _donors_with_slabs(3, nslab)
    rng = np.random.default_rng(11)
    try:
        want = [[np.zeros(npages * PAGE, np.uint8) for _ in range(nslab)] for _ in servers]
        for _ in range(25):
            keep, plan = [], []
            for _ in range(int(rng.integers(1, 20))):
                sv, k = int(rng.integers(3)), int(rng.integers(nslab))
                n = int(rng.integers(1, 12))
                pages = rng.choice(npages, n, replace=False)  # any order: segments need not be sorted
                offs = pages.astype(np.uint64) * PAGE
                lens = np.full(n, PAGE, np.uint32)
                data = rng.integers(0, 256, n * PAGE, dtype=np.uint8)
                good = rng.random() > 0.15
                tok = ffi.new("uint8_t[16]", tokens[sv][k] if good else bytes(16))
                keep += [offs, lens, data, tok]
                b = ffi.new("dls_batch *", {"slab": k, "token": tok, "nseg": n,
                                             "offs": ffi.cast("uint64_t *", ffi.from_buffer(offs)),
                                             "lens": ffi.cast("uint32_t *", ffi.from_buffer(lens)),
                                             "buf": ffi.cast("uint8_t *", ffi.from_buffer(data)),
                                             "timeout_ms": 2000, "bad_seg": -1})
                keep.append(b)
                plan.append((sv, k, pages, data, good, b))
            rcs = ffi.new(f"int[{len(plan)}]")
            lib.dls_ep_write_many(ffi.new("dls_ep *[]", [eps[sv] for sv, *_ in plan]),
                                  ffi.new("dls_batch *[]", [b for *_, b in plan]), len(plan), rcs)
            for i, (sv, k, pages, data, good, _) in enumerate(plan):
                assert rcs[i] == (0 if good else wire.E_TOKEN), (i, sv, k, good, list(rcs))
                if good:
                    for j, pg in enumerate(pages):
                        want[sv][k][pg * PAGE: (pg + 1) * PAGE] = data[j * PAGE: (j + 1) * PAGE]
            for sv in range(3):
                for k in range(nslab):
                    assert np.array_equal(regions[sv][k].view()[: npages * PAGE], want[sv][k]), (sv, k)
    finally:
        _close(servers, regions, eps)


def test_write_many_pipelines_several_slabs_on_one_connection_and_fails_them_apart():
    """dls_ep_write_many with an endpoint named more than once (the region engine writes a batch of
    scattered units back to every extent's copies at once, and an extent's copies share donors):
    each batch lands in its own slab, a batch the server refuses fails alone, and a connection that
    breaks fails every batch it carried while the other donor's batches land."""
    nslab, n = 5, 48
    servers, regions, tokens, eps = _donors_with_slabs(2, nslab)
    keep = []
    try:
        rng = np.random.default_rng(5)
        data = [rng.integers(0, 256, n * PAGE, dtype=np.uint8) for _ in range(nslab)]  # one per slab
        offs = np.sort(rng.choice(256, n, replace=False)).astype(np.uint64) * PAGE  # scattered pages
        lens = np.full(n, PAGE, dtype=np.uint32)

        def batch(slab: int, token: bytes):
            tok = ffi.new("uint8_t[16]", token)
            keep.append(tok)
            return ffi.new("dls_batch *", {"slab": slab, "token": tok, "nseg": n,
                                            "offs": ffi.cast("uint64_t *", ffi.from_buffer(offs)),
                                            "lens": ffi.cast("uint32_t *", ffi.from_buffer(lens)),
                                            "buf": ffi.cast("uint8_t *", ffi.from_buffer(data[slab])),
                                            "timeout_ms": 2000, "bad_seg": -1})

        def landed(server: int, slab: int) -> bool:
            view = regions[server][slab].view()
            return all(np.array_equal(view[int(o): int(o) + PAGE], data[slab][i * PAGE: (i + 1) * PAGE])
                       for i, o in enumerate(offs))

        # interleaved: slab k to server 0, then to server 1; slab 2's token on server 1 is wrong
        order = [(k, sv) for k in range(nslab) for sv in range(2)]
        bs = [batch(k, bytes(16) if (k, sv) == (2, 1) else tokens[sv][k]) for k, sv in order]
        rcs = ffi.new(f"int[{len(order)}]")
        lib.dls_ep_write_many(ffi.new("dls_ep *[]", [eps[sv] for _, sv in order]),
                              ffi.new("dls_batch *[]", bs), len(order), rcs)
        for i, (k, sv) in enumerate(order):
            if (k, sv) == (2, 1):
                assert rcs[i] == wire.E_TOKEN, (k, sv, list(rcs))
                assert not regions[1][2].view().any()
            else:
                assert rcs[i] == 0, (k, sv, list(rcs))
                assert landed(sv, k), (k, sv)
        # server 0 gone: its three batches fail, server 1's land
        for rs in regions:
            for r in rs:
                r.view()[:] = 0
        servers[0].stop()
        order = [(0, 0), (1, 1), (3, 0), (4, 1), (4, 0)]
        bs = [batch(k, tokens[sv][k]) for k, sv in order]
        rcs = ffi.new(f"int[{len(order)}]")
        lib.dls_ep_write_many(ffi.new("dls_ep *[]", [eps[sv] for _, sv in order]),
                              ffi.new("dls_batch *[]", bs), len(order), rcs)
        for i, (k, sv) in enumerate(order):
            if sv == 0:
                assert rcs[i] < 0, (k, sv, list(rcs))
            else:
                assert rcs[i] == 0 and landed(sv, k), (k, sv, list(rcs))
    finally:
        _close(servers, regions, eps)


def test_the_old_names_in_native_mem_are_the_split_modules_own():
    """rdma.native_mem was split by concept; a caller that imports from it gets the same objects."""
    from rdma import clock, endpoint, errors, native_mem, slab_memory, slab_server, slab_token

    assert native_mem.Region is slab_memory.SlabMemory is native_mem.SlabMemory
    assert native_mem.SlabServer is slab_server.SlabServer and native_mem.Endpoint is endpoint.Endpoint
    assert native_mem.RemoteMemoryError is errors.RemoteMemoryError and native_mem.random_token is slab_token.random_token
    assert native_mem.monotonic_ns is clock.monotonic_ns and native_mem.REGION_HUGE == slab_memory.HUGE
    assert set(native_mem.__all__) <= set(dir(native_mem))
