"""Server and client over real loopback sockets: numerics, many jobs, errors, sharding, drain."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from aggregator import AggregationError, Client
from aggregator.core import Tick
from aggregator.protocol import HEADER_SIZE, MsgType, parse_body, parse_header
from nodesvc.bus.procs import wait_until
from tests.aggregator.aggtest import addr, run_ranks
from tests.fake_clock import ManualClock


def _data(world: int, n: int, seed: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(world)]


def _ref_mean(xs: list[np.ndarray]) -> np.ndarray:
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)  # rank order
    return (acc / np.float32(len(xs))).astype(xs[0].dtype)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_numpy_mean_and_sum_match_rank_order_reference(agg_servers, world):
    (srv,) = agg_servers(1, max_cores=2)
    n = 100_003  # several 64 KiB chunks and a ragged tail
    xs = _data(world, n, world)
    expect_mean = _ref_mean(xs)
    expect_sum = xs[0].copy()
    for x in xs[1:]:
        expect_sum += x

    def work(rank):
        with Client([addr(srv)], "job", rank, world, chunk_bytes=64 << 10) as c:
            a = xs[rank].copy()
            assert c.allreduce(a) is a
            b = xs[rank].copy()
            c.allreduce(b, op="sum")
            return a, b

    for a, b in run_ranks(world, work):
        np.testing.assert_array_equal(a, expect_mean)
        np.testing.assert_array_equal(b, expect_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_tensors_every_dtype(agg_servers, dtype):
    (srv,) = agg_servers(1)
    world = 3
    ts = [torch.randn(5000, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
    acc = ts[0].float()
    for t in ts[1:]:
        acc = acc + t.float()
    expect = (acc / world).to(dtype)

    def work(rank):
        with Client([addr(srv)], "tj", rank, world, chunk_bytes=4096) as c:
            t = ts[rank].clone()
            c.allreduce(t)
            return t

    for t in run_ranks(world, work):
        assert t.dtype == dtype
        assert torch.equal(t.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expect.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_many_concurrent_jobs_have_no_cross_talk(agg_servers):
    (srv,) = agg_servers(1, max_cores=2)
    jobs, world, rounds = 6, 2, 4
    data = {j: [_data(world, 20_000 + 977 * j, 100 * j + r) for r in range(rounds)] for j in range(jobs)}

    def work(i):
        j, rank = divmod(i, world)
        out = []
        with Client([addr(srv)], f"job{j}", rank, world, chunk_bytes=32 << 10) as c:
            for r in range(rounds):
                a = data[j][r][rank].copy()
                c.allreduce(a)
                out.append((j, r, a))
        return out

    for res in run_ranks(jobs * world, work, timeout=60):
        for j, r, a in res:
            np.testing.assert_array_equal(a, _ref_mean(data[j][r]))
    st = srv.stats()
    assert st["bytes_in"] == sum(x.nbytes for j in data for r in data[j] for x in r)


def test_shape_mismatch_is_a_clear_error_and_the_job_goes_on(agg_servers):
    (srv,) = agg_servers(1)

    def work(rank):
        with Client([addr(srv)], "mm", rank, 2, chunk_bytes=1 << 20) as c:
            bad = np.ones(1000 + 8 * rank, np.float32)
            with pytest.raises(AggregationError) as ei:
                c.allreduce(bad)
            good = np.full(10, float(rank), np.float32)
            c.allreduce(good)
            return ei.value, good

    for err, good in run_ranks(2, work):
        assert err.code == "mismatch" and "1008 elements" in str(err) and "1000 elements" in str(err)
        np.testing.assert_array_equal(good, np.full(10, 0.5, np.float32))


def test_dtype_mismatch_is_reported(agg_servers):
    (srv,) = agg_servers(1)

    def work(rank):
        with Client([addr(srv)], "dm", rank, 2) as c:
            x = np.ones(64, np.float32 if rank == 0 else np.float16)
            with pytest.raises(AggregationError, match="float16") as ei:
                c.allreduce(x)
            return ei.value.code

    assert run_ranks(2, work) == ["mismatch", "mismatch"]


def test_world_size_mismatch_is_refused(agg_servers):
    (srv,) = agg_servers(1)
    c0 = Client([addr(srv)], "wm", 0, 2)
    c0.links[addr(srv)].ensure()
    c1 = Client([addr(srv)], "wm", 1, 3, connect_timeout_s=2)
    with pytest.raises(AggregationError, match="world size 2") as ei:
        c1.allreduce(np.ones(4, np.float32))
    assert ei.value.code == "world_mismatch"
    c0.close()
    c1.close()


def test_client_rejects_unsupported_inputs(agg_servers):
    (srv,) = agg_servers(1)
    with Client([addr(srv)], "bad", 0, 1) as c:
        with pytest.raises(TypeError, match="int64"):
            c.allreduce(np.ones(4, np.int64))
        with pytest.raises(ValueError, match="contiguous"):
            c.allreduce(torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="op must be"):
            c.allreduce(np.ones(4, np.float32), op="max")
        with pytest.raises(TypeError):
            c.allreduce([1.0, 2.0])


def _raw(srv, data: bytes) -> tuple:
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(data)
        hb = b""
        while len(hb) < HEADER_SIZE:
            part = s.recv(HEADER_SIZE - len(hb))
            if not part:
                return None, None
            hb += part
        h = parse_header(hb)
        body = b""
        while len(body) < h.nbytes:
            body += s.recv(h.nbytes - len(body))
        return h, parse_body(body)


def test_malformed_messages_get_errors_and_the_server_lives_on(agg_servers):
    (srv,) = agg_servers(1)
    h, body = _raw(srv, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40)
    assert h.mtype == MsgType.ERROR and body["code"] == "bad_message" and "magic" in body["message"]
    from aggregator.protocol import control

    h, body = _raw(srv, control(MsgType.HELLO, {"job": "../etc", "rank": 0, "world": 1}))
    assert body["code"] == "bad_message" and "job id" in body["message"]
    h, body = _raw(srv, control(MsgType.RESULT, {}))  # a data type with a control body
    assert h.mtype == MsgType.ERROR
    with Client([addr(srv)], "alive", 0, 1) as c:
        x = np.arange(8, dtype=np.float32)
        c.allreduce(x, op="sum")
        np.testing.assert_array_equal(x, np.arange(8, dtype=np.float32))


def test_keys_are_sharded_over_servers(agg_servers):
    servers = agg_servers(3)
    addrs = [addr(s) for s in servers]
    xs = _data(2, 400_000, 5)

    def work(rank):
        with Client(addrs, "shard", rank, 2, chunk_bytes=16 << 10) as c:
            a = xs[rank].copy()
            c.allreduce(a)
            return a

    for a in run_ranks(2, work):
        np.testing.assert_array_equal(a, _ref_mean(xs))
    loads = [s.bytes_in for s in servers]
    assert sum(loads) == 2 * xs[0].nbytes and min(loads) > 0.15 * sum(loads)


def test_drain_moves_future_rounds_to_the_other_servers(agg_servers):
    a, b = agg_servers(2)
    addrs = [addr(a), addr(b)]
    rounds = 6
    xs = {r: _data(2, 50_000, 40 + r) for r in range(rounds)}
    clients = [Client(addrs, "dr", rank, 2, chunk_bytes=8 << 10) for rank in range(2)]
    try:
        def one(r):
            def work(rank):
                x = xs[r][rank].copy()
                clients[rank].allreduce(x)
                return x
            for x in run_ranks(2, work):
                np.testing.assert_array_equal(x, _ref_mean(xs[r]))

        one(0)
        one(1)
        assert a.bytes_in > 0 and b.bytes_in > 0
        a.drain()
        before = a.core.jobs["dr"].bytes_in
        for r in range(2, rounds):
            one(r)
        # nothing new was reduced on the drained server (pushes sent before the notice arrived were redirected)
        assert a.core.jobs["dr"].bytes_in == before
        assert b.core.jobs["dr"].rounds_done > 0
        assert a.core.drained()
        assert all(link.drain_from == 2 for c in clients for s, link in c.links.items() if s == addrs[0])
    finally:
        for c in clients:
            c.close()


def test_round_timeout_when_a_rank_never_pushes(agg_servers):
    """A 30 s round timeout, on the server's clock moved by hand: the test takes milliseconds."""
    clock = ManualClock()
    (srv,) = agg_servers(1, round_timeout_s=30.0, clock=clock)
    with Client([addr(srv)], "slow", 0, 2) as c0, Client([addr(srv)], "slow", 1, 2) as c1:
        c1.links[addr(srv)].ensure()  # rank 1 is connected but never pushes

        def expire_the_round() -> None:
            wait_until(lambda: "slow" in srv.core.jobs and srv.core.jobs["slow"].units, timeout=60)
            clock.advance(29.9)
            srv._handle(Tick("test-tick", clock()))  # not due yet: the round stays
            assert srv.core.jobs["slow"].units
            clock.advance(0.1)

        t = threading.Thread(target=expire_the_round)
        t.start()
        with pytest.raises(AggregationError, match=r"ranks \[1\] never pushed") as ei:
            c0.allreduce(np.ones(16, np.float32))
        t.join(timeout=60)
        assert ei.value.code == "timeout" and "30 s" in str(ei.value)


def test_a_connection_that_never_says_hello_is_closed_at_the_hello_deadline(agg_servers):
    clock = ManualClock()
    (srv,) = agg_servers(1, hello_timeout_s=10.0, clock=clock)
    with socket.create_connection(tuple(srv.address), timeout=60) as s:
        wait_until(lambda: len(srv._unwelcome) == 1, timeout=60)
        clock.advance(9.9)
        s.settimeout(0.3)  # the sweep runs every 0.1 s: nothing may come before the deadline
        with pytest.raises(socket.timeout):
            s.recv(1)
        clock.advance(0.1)
        s.settimeout(60)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        h = parse_header(got[:HEADER_SIZE])
        assert h.mtype == MsgType.ERROR
        assert parse_body(got[HEADER_SIZE:HEADER_SIZE + h.nbytes])["code"] == "hello_timeout"


def test_a_server_speaking_garbage_gives_an_error_not_a_hang():
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    stop = False

    def serve_garbage():
        while not stop:
            try:
                s, _ = lst.accept()
            except OSError:
                return
            s.recv(1024)
            s.sendall(b"\xde\xad" * 24)
            s.close()

    import threading

    t = threading.Thread(target=serve_garbage, daemon=True)
    t.start()
    try:
        with Client([f"127.0.0.1:{port}"], "g", 0, 1, connect_timeout_s=1, timeout_s=5) as c:
            for _ in range(2):  # the client stays usable: each call fails with a clear error
                with pytest.raises(AggregationError, match="handshake .* bad magic") as ei:
                    c.allreduce(np.ones(4, np.float32))
                assert ei.value.code == "unreachable"
    finally:
        stop = True
        lst.close()


def test_registered_layouts_give_clear_errors(agg_servers):
    (srv,) = agg_servers(1)
    lay = {0: np.zeros(100, np.float32), 1: (50, "float16")}
    with Client([addr(srv)], "lay", 0, 2, layout=lay) as c0, Client([addr(srv)], "lay", 1, 2, layout=lay) as c1:
        with pytest.raises(ValueError, match="key 0 has 99 float32 elements; the job's layout says 100"):
            c0.allreduce(np.zeros(99, np.float32), key=0)
        with pytest.raises(ValueError, match="not in the layout"):
            c0.allreduce(np.zeros(4, np.float32), key=5)
        xs = [np.full(100, float(r), np.float32) for r in range(2)]
        fs = [c.allreduce_async(x, key=0, round=0) for c, x in zip((c0, c1), xs)]
        for f in fs:
            np.testing.assert_array_equal(f.result(10), np.full(100, 0.5, np.float32))
        other = {0: (100, "float32"), 1: (51, "float16")}
        with Client([addr(srv)], "lay", 1, 2, layout=other, connect_timeout_s=2) as bad:
            with pytest.raises(AggregationError, match="key 1: job has 50 float16 elements, this rank 51") as ei:
                bad.allreduce(np.zeros(100, np.float32), key=0)
            assert ei.value.code == "layout_mismatch"
    with pytest.raises(ValueError, match="dtype must be one of"):
        Client([addr(srv)], "lay2", 0, 1, layout={0: (4, "int8")})


def test_server_survives_a_flood_of_random_and_half_valid_messages(agg_servers):
    import random

    from aggregator.protocol import HEADER, MAGIC, hello

    (srv,) = agg_servers(1)
    rng = random.Random(1234)
    for i in range(120):
        with socket.create_connection(srv.address, timeout=2) as s:
            kind = i % 3
            if kind == 0:  # noise
                s.sendall(rng.randbytes(rng.randint(1, 300)))
            else:  # a valid HELLO, then headers with random fields and a payload of the stated size
                s.sendall(hello("fuzz", 0, rng.choice([1, 2])))
                for _ in range(3):
                    n = rng.choice([0, 4, 8, 64, 255])
                    fields = [rng.choice([0, 1, rng.randrange(2**32)]) for _ in range(5)]
                    raw = HEADER.pack(MAGIC, 1, rng.randint(0, 9), rng.randint(0, 4), rng.randint(0, 2), fields[0],
                                      rng.randint(0, 2), rng.randint(0, 2), rng.randrange(4), rng.randrange(3),
                                      rng.randrange(3), rng.randrange(1, 4), n, rng.choice([1, 2, 16, 64, 2**41]))
                    try:
                        s.sendall(raw + rng.randbytes(n))
                    except (BrokenPipeError, ConnectionResetError):
                        break  # the server hung up on a bad message: what it should do
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
    with Client([addr(srv)], "after-fuzz", 0, 1) as c:
        x = np.arange(1000, dtype=np.float32)
        c.allreduce(x, op="sum")
        np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32))
    wait_until(lambda: "fuzz" not in srv.stats()["jobs"], timeout=10,
               what="every fuzzing connection to be cleaned up")


def test_workers_may_start_before_the_server_and_in_any_order():
    """BytePS users report hangs on start order; here a rank waits (connect_timeout_s) for the server,
    and ranks join a round whenever they arrive, with no per-tensor set-up."""
    import threading

    from aggregator import AggregationServer, ServerSettings
    from nodesvc.bus.procs import free_port

    port = free_port()
    results: dict[int, np.ndarray] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        with Client([f"127.0.0.1:{port}"], "early", r, 2, connect_timeout_s=10) as c:
            x = np.full(1000, float(r), np.float32)
            c.allreduce(x)
            results[r] = x

    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 1.2))]
    for t in threads:
        t.start()
    time.sleep(0.6)  # rank 0 is already retrying its connection
    srv = AggregationServer(ServerSettings(port=port, server_id="late")).start()
    try:
        for t in threads:
            t.join(timeout=20)
        assert set(results) == {0, 1}
        for x in results.values():
            np.testing.assert_array_equal(x, np.full(1000, 0.5, np.float32))
    finally:
        srv.stop()
