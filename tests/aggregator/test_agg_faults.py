"""Faults with real processes: kill -9 of a worker mid-round, and of the server."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aggregator import AggregationError, Client
from nodesvc.bus.procs import free_port, stop_proc, wait_port, wait_until
from tests.aggregator.aggtest import addr, run_ranks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _kill(proc: subprocess.Popen) -> None:
    stop_proc(proc, signal.SIGKILL)


def test_kill_worker_mid_round_fails_its_job_fast_and_leaves_others_alone(agg_servers):
    (srv,) = agg_servers(1, round_timeout_s=20.0)  # a long timeout: the failure must come from the loss
    worker = subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), "--agg", addr(srv), "--job", "victim",
                               "--rank", "1", "--world", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    stop = threading.Event()
    bystander_rounds: list[int] = []
    bystander_err: list[BaseException] = []

    def bystander() -> None:
        try:
            cs = [Client([addr(srv)], "bystander", r, 2) for r in range(2)]
            i = 0
            while not stop.is_set():
                xs = [np.full(5000, float(i + r), np.float32) for r in range(2)]
                fs = [cs[r].allreduce_async(xs[r]) for r in range(2)]
                for f, x in zip(fs, xs):
                    f.result(timeout=10)
                    assert np.all(x == np.float32(i + 0.5))
                bystander_rounds.append(i)
                i += 1
            for c in cs:
                c.close()
        except BaseException as exc:  # reported by the main thread
            bystander_err.append(exc)

    t = threading.Thread(target=bystander)
    try:
        with Client([addr(srv)], "victim", 0, 2) as c0:
            x = np.zeros(1000, np.float32)
            c0.allreduce(x)
            assert np.all(x == 0.5)
            assert worker.stdout.readline().strip() == b"ready"
            t.start()
            fut = c0.allreduce_async(np.zeros(1000, np.float32))  # round 1: rank 1 never pushes it
            wait_until(lambda: srv.stats()["jobs"]["victim"]["pending"], timeout=10,
                       what="rank 0's round 1 to wait on the server")
            assert not fut.done()
            n_before = len(bystander_rounds)
            worker.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            exc = fut.exception(timeout=10)
            elapsed = time.monotonic() - t0
            assert isinstance(exc, AggregationError) and exc.code == "peer_lost"
            assert "rank 1 of job victim disconnected during round 1" in str(exc)
            assert elapsed < 5.0
            wait_until(lambda: len(bystander_rounds) > n_before or bystander_err, timeout=20,
                       what="the other job to finish a round after the kill")
        stop.set()
        t.join(timeout=20)
        assert not bystander_err, bystander_err
        assert len(bystander_rounds) > n_before  # the other job kept going through the failure
    finally:
        stop.set()
        _kill(worker)


def test_kill_server_then_restart_the_job_goes_on(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "aggregator.cli", "--listen", f"127.0.0.1:{port}", "--broker", "",
           "--round-timeout-s", "5", "--max-cores", "2"]

    def start() -> subprocess.Popen:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_port(port, proc=p)
        return p

    server = start()
    clients = [Client([f"127.0.0.1:{port}"], "phoenix", r, 2, connect_timeout_s=0.5) for r in range(2)]
    try:
        def round_all(value_of):
            def work(r):
                x = np.full(200_000, value_of(r), np.float32)
                clients[r].allreduce(x)
                return x
            return run_ranks(2, work)

        for x in round_all(lambda r: float(r)):  # round 0
            assert np.all(x == 0.5)
        fut = clients[0].allreduce_async(np.ones(200_000, np.float32))  # round 1, rank 0 only
        time.sleep(0.3)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        exc = fut.exception(timeout=10)
        assert isinstance(exc, AggregationError) and exc.code == "server_lost"
        assert f"127.0.0.1:{port}" in str(exc)
        with pytest.raises(AggregationError, match="cannot reach") as ei:  # rank 1's round 1, server down
            clients[1].allreduce(np.ones(10, np.float32))
        assert ei.value.code == "unreachable"
        server = start()
        for x in round_all(lambda r: 2.0 * r):  # round 2 on the new server
            assert np.all(x == 1.0)
        for x in round_all(lambda r: 4.0 * r):  # and round 3
            assert np.all(x == 2.0)
    finally:
        for c in clients:
            c.close()
        _kill(server)


def test_sigterm_stops_the_server_cleanly():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--listen", f"127.0.0.1:{port}", "--broker", ""],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=p)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
    finally:
        _kill(p)


def test_a_peer_that_stops_reading_cannot_block_the_server_forever():
    """The server's sockets carry a send timeout: the C send path gives up on a peer that never reads."""
    import socket
    import time as _time

    from aggregator.conns import guard_peer as _guard_peer
    from aggregator.sockio import send_all

    lst = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(lst.getsockname())  # connected, and never reads
    srv, _ = lst.accept()
    _guard_peer(srv, 0.5)
    payload = bytes(1 << 20)
    t0 = _time.monotonic()
    with pytest.raises(OSError):
        for _ in range(10_000):  # fills both socket buffers, then the send must time out
            send_all(srv, b"H" * 48, payload)
    assert _time.monotonic() - t0 < 10
    assert srv.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    for s in (srv, peer, lst):
        s.close()
