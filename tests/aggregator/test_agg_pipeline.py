"""The push pipeline: chunk sizes from the link rate, the push window, and stage records."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from aggregator import Client, link
from aggregator.placement import CHUNK_TIME_S, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_for_link
from nodesvc.bus.procs import wait_until
from tests.aggregator.aggtest import addr, run_ranks


def _closed_units(srv, job: str, n: int) -> list[dict]:
    """The server's stage records of ``job`` once at least ``n`` are closed.  A unit's record closes
    when the server's send of its result completes, which can come after the ranks have the result:
    wait for the server's side rather than race it."""
    wait_until(lambda: len(srv.stages.records(job)) >= n, timeout=30, what=f"the server to close {n} units of {job}")
    return srv.stages.records(job)


def test_chunks_take_about_8_ms_of_a_connections_share_of_the_link():
    # 500 Mbit/s, 4 servers and 4 ranks: each connection gets 15.6 MB/s, 8 ms of it is 125 kB
    c = chunk_for_link(500e6 / 8, 4, 4)
    assert c % 4096 == 0 and abs(c - 500e6 / 8 / 4 * CHUNK_TIME_S) < 4096
    assert chunk_for_link(500e6 / 8, 1, 8) == chunk_for_link(500e6 / 8, 8, 1)  # the busier end sets it
    assert chunk_for_link(100e9 / 8, 4, 4) == MAX_CHUNK_BYTES
    assert chunk_for_link(10e6 / 8, 4, 4) == MIN_CHUNK_BYTES
    with pytest.raises(ValueError):
        chunk_for_link(0, 1, 1)


def test_the_client_sizes_its_chunks_from_the_link_rate(monkeypatch):
    monkeypatch.setenv("DLSHARE_AGG_LINK_GBIT", "0.5")
    c = Client(["127.0.0.1:1", "127.0.0.1:2"], "j", 0, 4)
    try:
        assert c.chunk_bytes == chunk_for_link(500e6 / 8, 2, 4)
    finally:
        c.close()
    c = Client(["127.0.0.1:1"], "j", 0, 2, chunk_bytes=8192, link_gbit=1.0)  # an explicit size wins
    try:
        assert c.chunk_bytes == 8192
    finally:
        c.close()
    monkeypatch.setenv("DLSHARE_AGG_LINK_GBIT", "fast")
    with pytest.raises(ValueError, match="DLSHARE_AGG_LINK_GBIT"):
        Client(["127.0.0.1:1"], "j", 0, 2)


def test_a_rank_ahead_pushes_no_more_than_its_window_before_answers_come(agg_servers, monkeypatch):
    """Rank 0 starts alone; rank 1 joins only once rank 0 has filled its window.  On the server,
    each push of rank 0 beyond the window arrives after the sum that freed its place: the sum of
    chunk c is done before rank 0's result for c is sent, which comes before rank 0 pushes
    chunk c + window.  Without the window rank 0 would push all its chunks before rank 1 starts."""
    monkeypatch.setattr(link, "STALL_S", 60.0)  # no safety valve within this test
    (srv,) = agg_servers(1, trace=True)
    window, chunk, nchunks = 2, 16 << 10, 12
    xs = [np.full(nchunks * chunk // 4, r + 1.0, np.float32) for r in range(2)]
    clients = [Client([addr(srv)], "win", r, 2, chunk_bytes=chunk, window_chunks=window) for r in range(2)]
    try:
        # both ranks join the server (a first round), then rank 0 runs ahead alone
        run_ranks(2, lambda r: clients[r].allreduce(np.ones(4, np.float32), round=0))
        before = srv.stats()["jobs"]["win"]["bytes_in"]
        f0 = clients[0].allreduce_async(xs[0], op="sum", round=1)
        wait_until(lambda: srv.stats()["jobs"]["win"]["bytes_in"] - before >= window * chunk,
                   what="rank 0 filled its window")
        f1 = clients[1].allreduce_async(xs[1], op="sum", round=1)
        f0.result(timeout=30)
        f1.result(timeout=30)
    finally:
        for c in clients:
            c.close()
    np.testing.assert_array_equal(xs[0], np.full_like(xs[0], 3.0))
    units = sorted((u for u in _closed_units(srv, "win", nchunks + 1) if u["round"] == 1),
                   key=lambda u: u["arrived"]["0"][0])
    assert len(units) == nchunks
    for earlier, later in zip(units, units[window:]):
        assert later["arrived"]["0"][0] > earlier["sum"][1], (earlier, later)


def test_ranks_that_push_keys_in_different_orders_still_finish(agg_servers, monkeypatch):
    """A client that breaks the same-order contract cannot deadlock its window: after STALL_S
    without an answer the window opens."""
    monkeypatch.setattr(link, "STALL_S", 0.05)
    (srv,) = agg_servers(1)
    chunk = 16 << 10

    def work(rank):
        with Client([addr(srv)], "order", rank, 2, chunk_bytes=chunk, window_chunks=1) as c:
            a = np.full(4 * chunk // 4, 1.0 + rank, np.float32)
            b = np.full(4 * chunk // 4, 10.0 + rank, np.float32)
            keys = [(1, a), (2, b)] if rank == 0 else [(2, b), (1, a)]
            futs = [c.allreduce_async(x, op="sum", key=k, round=0) for k, x in keys]
            for f in futs:
                f.result(timeout=30)
            return a, b

    for a, b in run_ranks(2, work):
        np.testing.assert_array_equal(a, np.full_like(a, 3.0))
        np.testing.assert_array_equal(b, np.full_like(b, 21.0))


def test_stage_records_follow_a_reduction_through_client_and_server(agg_servers):
    (srv,) = agg_servers(1, trace=True)
    chunk = 16 << 10

    def work(rank):
        with Client([addr(srv)], "trace", rank, 2, chunk_bytes=chunk, trace=True) as c:
            x = np.ones(5 * chunk // 4, np.float32)
            c.allreduce(x, key=7, round=3)
            return c.stage_records()

    for recs in run_ranks(2, work):
        (r,) = recs
        assert (r["round"], r["key"], r["bytes"], r["chunks"]) == (3, 7, 5 * chunk, 5)
        assert r["ready"] <= r["push_first"] <= r["push_first_done"] <= r["push_last"]
        assert r["push_first"] <= r["pull_first"] <= r["pull_last"] <= r["done"]
        assert list(r["servers"]) == [addr(srv)]
    units = _closed_units(srv, "trace", 5)
    assert sorted(u["chunk"] for u in units) == list(range(5))
    for u in units:
        assert sorted(u["arrived"]) == ["0", "1"]
        assert max(a[1] for a in u["arrived"].values()) <= u["sum"][0] <= u["sum"][1]
        assert sorted(rank for rank, _ in u["sent"]) == [0, 1]
        assert all(t >= u["sum"][1] for _, t in u["sent"])


def test_failed_rounds_give_their_window_places_back(agg_servers, monkeypatch):
    """A round that fails on the server (here: a shape mismatch) answers with an error, not
    results; its pushes must not keep the window shut for the rounds after it."""
    monkeypatch.setattr(link, "STALL_S", 60.0)
    (srv,) = agg_servers(1)
    chunk = 16 << 10
    done = threading.Barrier(2)

    def work(rank):
        with Client([addr(srv)], "fail", rank, 2, chunk_bytes=chunk, window_chunks=2) as c:
            bad = np.ones((4 + rank) * chunk // 4, np.float32)
            with pytest.raises(Exception, match="mismatch"):
                c.allreduce(bad, round=0)
            done.wait(timeout=30)
            good = np.ones(6 * chunk // 4, np.float32)
            c.allreduce(good, op="sum", round=1)
            return good, len(c.links[addr(srv)].inflight)

    for good, inflight in run_ranks(2, work):
        np.testing.assert_array_equal(good, np.full_like(good, 2.0))
        assert inflight == 0


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("nserv", [1, 2])
def test_a_compressed_wire_gives_the_bits_of_narrowing_first(agg_servers, wire, nserv):
    """Narrowing each chunk before its push and widening each result as it arrives gives exactly
    what narrowing the whole tensor with torch, reducing it in 16 bits and widening it gives."""
    import torch

    servers = agg_servers(nserv)
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[wire]
    world, n = 3, 50_001
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) * torch.logspace(-30, 4, n) for _ in range(world)]

    def work(rank):
        with Client([addr(s) for s in servers], f"wire{nserv}", rank, world, chunk_bytes=16 << 10) as c:
            a = xs[rank].clone()
            c.allreduce(a, round=0, wire=wire)
            b = xs[rank].to(tdt)
            c.allreduce(b, round=1)
            return a, b.float()

    for a, b in run_ranks(world, work):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_compressed_wire_needs_float32():
    import torch

    c = Client(["127.0.0.1:1"], "w", 0, 2)
    try:
        with pytest.raises(TypeError, match="float32"):
            c.allreduce_async(torch.zeros(4, dtype=torch.float16), wire="bf16")
        with pytest.raises(ValueError, match="wire"):
            c.allreduce_async(torch.zeros(4), wire="int8")
    finally:
        c.close()
