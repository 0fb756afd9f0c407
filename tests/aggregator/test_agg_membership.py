"""The join barrier and the drain hand-off, through the core with plain events and a fake clock."""

from __future__ import annotations

import json

import pytest

from aggregator.core import AggregationCore, Close, ConnectionLost, Drain, Register, Send, Tick
from aggregator.membership import DrainAck, JoinBarrier
from aggregator.protocol import HEADER_SIZE, Hello, MsgType, ProtocolError, hello, parse_header, parse_hello


class Conn:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def sent(decisions, mtype):
    """{conn: body} of the control messages of type ``mtype``."""
    out = {}
    for d in decisions:
        if isinstance(d, Send):
            h = parse_header(d.data[:HEADER_SIZE])
            if h.mtype == mtype:
                out[d.conn] = json.loads(d.data[HEADER_SIZE:])
    return out


def join(core, job, rank, world, nxt, now=0.0, conn=None):
    conn = conn or Conn(f"{job}.{rank}")
    return conn, core.handle(Register("0", now, conn, Hello(job, rank, world, None, nxt)))


def test_joined_goes_out_once_every_rank_said_hello_and_names_the_largest_next_round():
    core = AggregationCore("s", 5.0)
    c0, d0 = join(core, "j", 0, 3, 7)
    c1, d1 = join(core, "j", 1, 3, 9)
    assert sent(d0 + d1, MsgType.WELCOME).keys() == {c0, c1}
    assert sent(d0 + d1, MsgType.JOINED) == {}  # rank 2 has not said hello: nobody may use this server yet
    assert core.summary()["j"]["joining"] == [0, 1]
    c2, d2 = join(core, "j", 2, 3, 8)
    joined = sent(d2, MsgType.JOINED)
    assert joined == {c0: {"from_round": 9}, c1: {"from_round": 9}, c2: {"from_round": 9}}
    assert core.summary()["j"]["joined_from"] == 9
    # a rank that reconnects to the running job joins from no earlier than it asks
    _, d = join(core, "j", 1, 3, 12, conn=Conn("j.1b"))
    assert list(sent(d, MsgType.JOINED).values()) == [{"from_round": 12}]


def test_a_hello_without_next_round_gets_no_joined_as_before():
    core = AggregationCore("s", 5.0)
    _, d = join(core, "j", 0, 1, None)
    assert sent(d, MsgType.WELCOME) and not sent(d, MsgType.JOINED)


def test_a_barrier_that_does_not_fill_is_abandoned_after_the_timeout_with_an_error_and_a_close():
    core = AggregationCore("s", 5.0)
    c0, _ = join(core, "j", 0, 3, 0, now=10.0)
    c2, _ = join(core, "j", 2, 3, 0, now=11.0)
    assert core.handle(Tick("1", 14.9)) == []
    d = core.handle(Tick("2", 15.0))
    errs = sent(d, MsgType.ERROR)
    assert errs.keys() == {c0, c2}
    assert errs[c0]["code"] == "join_timeout" and "ranks [1] did not connect within 5 s" in errs[c0]["message"]
    assert {x.conn for x in d if isinstance(x, Close)} == {c0, c2}
    # the connections then close; a fresh barrier starts from nothing
    core.handle(ConnectionLost("3", 15.1, c0))
    core.handle(ConnectionLost("4", 15.1, c2))
    assert "j" not in core.jobs
    c0, _ = join(core, "j", 0, 3, 4, now=20.0)
    assert core.summary()["j"]["joining"] == [0] and core.summary()["j"]["joined_from"] is None


def test_a_rank_that_leaves_the_barrier_is_waited_for_again():
    core = AggregationCore("s", 5.0)
    c0, _ = join(core, "j", 0, 2, 3)
    c1, _ = join(core, "j", 1, 2, 0, conn=Conn("j.1"))
    core.handle(ConnectionLost("1", 0.0, c0))  # after the join: the job stays joined
    assert core.summary()["j"]["joined_from"] == 3
    core2 = AggregationCore("s2", 5.0)
    a, _ = join(core2, "k", 0, 2, 3)
    core2.handle(ConnectionLost("1", 0.0, a))  # before the join: the waiting rank is gone
    assert "k" not in core2.jobs
    b, _ = join(core2, "k", 1, 2, 5)
    a2, d = join(core2, "k", 0, 2, 6, conn=Conn("k.0b"))
    assert sent(d, MsgType.JOINED) == {b: {"from_round": 6}, a2: {"from_round": 6}}


def test_barrier_alone_forgets_a_job_and_reports_missing_ranks():
    jb = JoinBarrier(2.0)
    assert jb.hello("j", 3, 1, "c1", 4, 0.0) == []
    (gone,) = jb.expired(2.5)
    assert gone.job == "j" and gone.missing == (0, 2) and gone.conns == ((1, "c1"),)
    assert jb.expired(3.0) == [] and jb.waiting("j") == []


def test_drain_is_moved_once_every_rank_acknowledged_and_nothing_is_in_flight():
    core = AggregationCore("s", 5.0)
    conns = [join(core, "j", r, 2, 0)[0] for r in range(2)]
    assert not core.moved()
    d = core.handle(Drain("1", 0.0))
    assert sent(d, MsgType.REDIRECT).keys() == set(conns)
    assert core.drained() and not core.moved() and core.drain_ranks_left() == {"j": [0, 1]}
    core.handle(DrainAck("a", 0.1, conns[0]))
    assert core.drain_ranks_left() == {"j": [1]} and not core.moved()
    core.handle(ConnectionLost("2", 0.2, conns[1]))  # a rank that left has nothing left here
    assert core.moved()


def test_an_ack_before_any_drain_is_ignored():
    core = AggregationCore("s", 5.0)
    (c,) = [join(core, "j", 0, 1, 0)[0]]
    core.handle(DrainAck("a", 0.0, c))
    core.handle(Drain("1", 0.0))
    assert core.drain_ranks_left() == {"j": [0]}


def test_hello_next_round_round_trips_and_bad_values_are_refused():
    msg = hello("j", 0, 2, None, 41)
    assert parse_hello(msg[HEADER_SIZE:]).next_round == 41
    assert parse_hello(hello("j", 0, 2)[HEADER_SIZE:]).next_round is None
    for bad in ('"7"', "-1", "true", "1.5", str(1 << 62)):
        with pytest.raises(ProtocolError, match="next_round"):
            parse_hello(('{"job":"j","rank":0,"world":2,"next_round":%s}' % bad).encode())
