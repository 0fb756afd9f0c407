"""First-come-first-served reads across jobs (aggregator/interleave.py), with a fake clock."""

from __future__ import annotations

import numpy as np

from aggregator import Client
from aggregator.interleave import RoundOrder
from tests.aggregator.aggtest import addr, run_ranks


def _push(o, job, rnd, now, token=None):
    """A reader that read a header and was let through: it is receiving from now on."""
    o.note(job, rnd, now)
    assert o.ahead(job, rnd, now) is None
    o.begin(job, token or job, now)


def test_the_round_that_started_first_is_read_first_and_the_other_waits_while_it_streams():
    o = RoundOrder(tie_s=0.05, idle_s=0.02)
    _push(o, "b", 7, 1.00)  # job b's round 7 starts streaming
    o.note("a", 3, 1.20)  # job a's round 3 starts 0.2 s later
    assert o.ahead("a", 3, 1.21) == "b"  # a waits
    assert o.ahead("b", 7, 1.21) is None  # b never waits for a later round
    o.end("b", "b", 1.30)
    assert o.ahead("a", 3, 1.31) == "b"  # b's next chunk may follow within idle_s
    assert o.ahead("a", 3, 1.33) is None  # b paused longer than idle_s: a goes
    o.begin("a", "a", 1.33)
    o.note("b", 8, 1.40)  # b's next round starts after a's: a goes first now
    assert o.ahead("b", 8, 1.41) == "a" and o.ahead("a", 3, 1.41) is None


def test_waiting_pushes_do_not_make_their_job_busy_so_two_jobs_never_wait_on_each_other():
    o = RoundOrder(tie_s=0.05, idle_s=0.02)
    _push(o, "x", 1, 0.0)  # x's round 1 is being received
    o.note("y", 4, 0.3)
    assert o.ahead("y", 4, 0.3) == "x"  # y's round started later: it waits
    o.note("x", 2, 0.5)  # a rank of x is a round ahead, while round 1 is still being received
    assert o.ahead("x", 2, 0.6) is None  # y only waits, it receives nothing: it holds nobody back
    assert o.ahead("x", 1, 0.6) is None  # an earlier round of x never waits
    assert o.ahead("y", 4, 0.6) is None  # x's current round (2) started after y's (4): y goes
    o.begin("y", "y", 0.6)
    assert o.ahead("x", 2, 0.61) == "y"  # and x's later round now waits for y's earlier one


def test_a_reception_that_stalls_stops_holding_others_back():
    o = RoundOrder(idle_s=0.02, stall_s=2.0)
    _push(o, "stuck", 0, 0.0)  # a peer stops sending mid-chunk
    o.note("other", 0, 0.5)
    assert o.ahead("other", 0, 1.0) == "stuck"
    assert o.ahead("other", 0, 2.1) is None


def test_rounds_that_start_together_go_in_job_name_order_on_every_server():
    for delta in (-0.03, 0.0, 0.03):  # each server sees the two starts a little differently
        o = RoundOrder(tie_s=0.05)
        o.note("job-b", 0, 5.0)
        o.begin("job-b", 1, 5.0)
        o.note("job-a", 0, 5.0 + delta)
        o.begin("job-a", 2, 5.0 + delta)
        assert o.ahead("job-b", 0, 5.1) == "job-a" and o.ahead("job-a", 0, 5.1) is None


def test_a_job_that_stops_pushing_holds_nobody_back_and_forgotten_jobs_are_gone():
    o = RoundOrder(idle_s=0.02)
    _push(o, "slow", 0, 0.0)
    o.end("slow", "slow", 0.1)
    o.note("fast", 0, 0.5)
    assert o.ahead("fast", 0, 0.5) is None  # "slow" started first but is not receiving
    o.begin("slow", "slow", 0.6)
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
