"""Server failover with real server processes: kill -9 one mid-round, the job goes on, and uses it again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.aggregator.agg_proc import ROOT, ServerProc
from aggregator import Client
from nodesvc.bus.procs import free_port, wait_until

HERE = Path(__file__).resolve().parent
ROUND_TIMEOUT_S = 20.0  # long, so that a retry that waited for the timeout would show


def _values(rnd: int, rank: int, n: int) -> np.ndarray:
    # small integers: every sum is exact in fp32, so any double count or loss shows
    return ((np.arange(n, dtype=np.int64) * (rank + 1) + rnd) % 97).astype(np.float32)


def _expected(rnd: int, world: int, n: int) -> np.ndarray:
    return sum(_values(rnd, r, n) for r in range(world))


@pytest.fixture
def servers(tmp_path):
    made = [ServerProc(tmp_path, f"fo{i}", round_timeout_s=ROUND_TIMEOUT_S).start() for i in range(3)]
    yield made
    for s in made:
        s.stop()


def test_kill9_a_server_mid_round_the_round_completes_and_the_server_is_used_again(servers):
    world, n = 3, 1_000_000  # 4 MB a rank: 64 KiB chunks, about 21 on each server
    addrs = [s.addr for s in servers]
    victim = servers[1]
    clients = [Client(addrs, "fo", r, world, chunk_bytes=64 << 10, timeout_s=60) for r in range(world)]
    pool = ThreadPoolExecutor(world)
    try:
        def round_all(rnd: int, before_wait=None) -> float:
            xs = [_values(rnd, r, n) for r in range(world)]
            t0 = time.monotonic()
            futs = [c.allreduce_async(x, op="sum", round=rnd) for c, x in zip(clients, xs)]
            if before_wait:
                before_wait()
            for f, x in zip(futs, xs):
                f.result(timeout=60)  # an AggregationError here fails the test
                np.testing.assert_array_equal(x, _expected(rnd, world, n))
            return time.monotonic() - t0

        for rnd in range(3):
            round_all(rnd)
        assert all(c.stats()["servers"][victim.addr]["bytes_sent"] > 0 for c in clients)

        def kill_mid_round() -> None:
            # wait until rank 0 has chunks queued or in flight on the victim, then kill it
            link = clients[0].links[victim.addr]
            wait_until(lambda: link.units, timeout=10, what="chunks on the victim", interval=0.001)
            victim.kill9()

        took = round_all(3, kill_mid_round)
        assert took < ROUND_TIMEOUT_S  # retried at once, not after a timeout
        assert sum(c.retries for c in clients) > 0
        for rnd in range(4, 7):  # the victim is down: its chunks go to the other two
            round_all(rnd)
        assert all(c.stats()["servers"][victim.addr]["state"] != "up" for c in clients)
        sent_while_down = [c.stats()["servers"][victim.addr]["bytes_sent"] for c in clients]

        victim.start()  # same port: it comes back
        rnd = 7
        deadline = time.monotonic() + 30
        while not all(c.stats()["servers"][victim.addr]["state"] == "up" for c in clients):
            round_all(rnd)  # training goes on while the ranks rejoin it
            rnd += 1
            assert time.monotonic() < deadline, [c.stats() for c in clients]
        joined = {c.stats()["servers"][victim.addr]["joined_from"] for c in clients}
        assert len(joined) == 1 and joined.pop() >= 7  # every rank agreed on the round it rejoined from
        for _ in range(3):
            round_all(rnd)
            rnd += 1
        after = [c.stats()["servers"][victim.addr]["bytes_sent"] for c in clients]
        assert all(a > b for a, b in zip(after, sent_while_down))  # used again, and the sums are right
    finally:
        pool.shutdown()
        for c in clients:
            c.close()


def test_a_round_fails_cleanly_when_no_server_is_left_to_retry_on(tmp_path):
    (only,) = [ServerProc(tmp_path, "solo", round_timeout_s=ROUND_TIMEOUT_S).start()]
    try:
        c = Client([only.addr], "solo", 0, 2, connect_timeout_s=1, timeout_s=30)
        peer = Client([only.addr], "solo", 1, 2, connect_timeout_s=1, timeout_s=30)
        peer.links[only.addr].ensure()
        fut = c.allreduce_async(np.ones(100_000, np.float32))  # the peer never pushes: it stays in flight
        wait_until(lambda: c.links[only.addr].units and c.links[only.addr].bytes_sent, timeout=10, what="pushed")
        only.kill9()
        exc = fut.exception(timeout=10)
        assert exc is not None and exc.code == "server_lost" and "no other aggregation server" in str(exc)
        c.close()
        peer.close()
    finally:
        only.stop()


def _run_ddp(tmp: Path, addrs: list[str], kill_pid: int, kill_step: int, on_start) -> list[dict]:
    """Four ranks, each training the reference job and then the faulty one (failover_worker.py)."""
    world, steps = 4, 16
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"rank{rank}.pt"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "failover_worker.py"), "--rank", str(rank), "--world", str(world),
             "--init", init, "--agg", ",".join(addrs), "--steps", str(steps), "--out", str(out),
             "--job", "ddp", "--kill-pid", str(kill_pid), "--kill-step", str(kill_step)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        on_start()
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{p.stdout.read().decode()[-4000:]}"
    return [torch.load(o) for o in outs]


@pytest.mark.slow
def test_ddp_with_a_server_killed_mid_training_ends_bit_identical_to_a_run_without_the_fault(servers, tmp_path):
    addrs = [s.addr for s in servers]
    victim = max(servers, key=lambda s: s.addr)  # the worker's victim: the last of the sorted list
    restarted = threading.Event()

    def restart_after_death() -> None:
        def watch() -> None:
            victim.proc.wait(timeout=170)  # rank 0 kills it with SIGKILL mid-step of the faulty run
            time.sleep(0.5)
            victim.start()
            restarted.set()
        threading.Thread(target=watch, daemon=True).start()

    runs = _run_ddp(tmp_path, addrs, kill_pid=victim.pid, kill_step=4, on_start=restart_after_death)
    clean, faulty = [r["clean"] for r in runs], [r["fault"] for r in runs]
    assert restarted.is_set()
    assert not any(r["killed"] or r["retries"] for r in clean)  # the reference ran with every server up
    assert faulty[0]["killed"] and all(r["retries"] > 0 for r in faulty)
    for a, b in zip(clean, faulty):
        assert a["steps"] == b["steps"] == 16
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q), f"max diff {(p - q).abs().max().item()}"
    # the restarted server was used again by every rank
    assert all(r["sent_to_victim_after"] > r["sent_to_victim_at_kill"] for r in faulty), faulty
    assert all(r["max_step_s"] < ROUND_TIMEOUT_S for r in faulty)


def test_chunks_pushed_again_after_a_kill9_are_not_held_by_the_push_window(servers, monkeypatch):
    """Each rank pushes its lost server's chunks again in its own order, interleaved with what it had
    queued for the other servers; a push window over those rounds could wait for chunks a peer
    holds behind its own full window.  The rounds in flight at the loss push without a window, so
    the round completes with no help from the window's stall valve (made longer than the test)."""
    from aggregator import link

    monkeypatch.setattr(link, "STALL_S", 120.0)
    world, n = 3, 600_000
    addrs = [s.addr for s in servers]
    victim = servers[2]
    clients = [Client(addrs, "fow", r, world, chunk_bytes=16 << 10, window_chunks=2, timeout_s=60)
               for r in range(world)]
    try:
        def round_all(rnd: int, before_wait=None) -> None:
            xs = [[_values(rnd, r, n), _values(rnd + 100, r, n // 3)] for r in range(world)]
            futs = [c.allreduce_async(x, op="sum", round=rnd, key=k) for c, x2 in zip(clients, xs)
                    for k, x in enumerate(x2)]
            if before_wait:
                before_wait()
            for f in futs:
                f.result(timeout=45)  # an AggregationError or a stuck window fails the test
            for x2 in xs:
                np.testing.assert_array_equal(x2[0], _expected(rnd, world, n))
                np.testing.assert_array_equal(x2[1], _expected(rnd + 100, world, n // 3))

        round_all(0)

        def kill_mid_round() -> None:
            link0 = clients[0].links[victim.addr]
            wait_until(lambda: link0.inflight, timeout=10, what="pushes in flight on the victim", interval=0.001)
            victim.kill9()

        round_all(1, kill_mid_round)
        assert sum(c.retries for c in clients) > 0
        assert all(c.window_from >= 3 for c in clients)  # round 1 (and the next) went on without windows
        for rnd in range(2, 6):  # later rounds use the window again, on the two servers left
            round_all(rnd)
    finally:
        for c in clients:
            c.close()
