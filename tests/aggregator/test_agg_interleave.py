"""First-come-first-served reads across jobs (aggregator/interleave.py), with a fake clock."""

from __future__ import annotations

import numpy as np

from aggregator import Client
from aggregator.interleave import RoundOrder
from aggtest import addr, run_ranks


def test_the_round_that_started_first_is_read_first_and_the_other_waits_while_it_streams():
    o = RoundOrder(tie_s=0.05, idle_s=0.02)
    o.begin("b", 7, now=1.00)  # job b's round 7 starts streaming
    o.begin("a", 3, now=1.20)  # job a's round 3 starts 0.2 s later
    assert o.ahead("a", 3, 1.21) == "b"  # a waits
    assert o.ahead("b", 7, 1.21) is None  # b never waits for a later round
    o.end("b", 1.30)
    assert o.ahead("a", 3, 1.31) == "b"  # b's next chunk may follow within idle_s
    assert o.ahead("a", 3, 1.33) is None  # b paused longer than idle_s: a goes
    o.begin("b", 8, now=1.40)  # b's next round starts after a's: a goes first now
    assert o.ahead("b", 8, 1.41) == "a" and o.ahead("a", 3, 1.41) is None


def test_rounds_that_start_together_go_in_job_name_order_on_every_server():
    for delta in (-0.03, 0.0, 0.03):  # each server sees the two starts a little differently
        o = RoundOrder(tie_s=0.05)
        o.begin("job-b", 0, now=5.0)
        o.begin("job-a", 0, now=5.0 + delta)
        assert o.ahead("job-b", 0, 5.1) == "job-a" and o.ahead("job-a", 0, 5.1) is None


def test_a_job_that_stops_pushing_holds_nobody_back_and_forgotten_jobs_are_gone():
    o = RoundOrder(idle_s=0.02)
    o.begin("slow", 0, now=0.0)
    o.end("slow", 0.1)
    o.begin("fast", 0, now=0.5)
    assert o.ahead("fast", 0, 0.5) is None  # "slow" started first but is not receiving
    o.begin("slow", 0, now=0.6)
    assert o.ahead("fast", 0, 0.6) == "slow"
    o.forget("slow")
    assert o.ahead("fast", 0, 0.6) is None


def test_many_jobs_with_overlapping_rounds_all_finish_on_an_interleaving_server(agg_servers):
    (srv,) = agg_servers(1, interleave=True, recv_buffer_bytes=64 << 10)
    assert srv.order is not None
    jobs, world, rounds = 3, 2, 4

    def work(i):
        j, rank = divmod(i, world)
        out = []
        with Client([addr(srv)], f"il{j}", rank, world, chunk_bytes=256 << 10) as c:
            for r in range(rounds):
                x = np.full(600_000, float(rank + r + j), np.float32)
                c.allreduce(x, op="sum")
                out.append(float(x[0]))
        return j, out

    for j, out in run_ranks(jobs * world, work, timeout=120):
        assert out == [float(2 * (r + j) + 1) for r in range(rounds)]
