"""The aggregation state machine, driven with plain events and a fake clock (no sockets)."""

from __future__ import annotations

import json

from aggregator.core import (ALL, AggregationCore, ChunkArrived, Close, ConnectionLost, Drain, Reduce, Register,
                             FreeBuffers, Send, Tick)
from aggregator.protocol import HEADER_SIZE, DType, Hello, MsgType, Op, data_header, parse_header
from tests.core_conventions import assert_core_convention


class Conn:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def msgs(decisions, conn=None):
    """Decoded control messages: [(conn, header, body)]."""
    out = []
    for d in decisions:
        if isinstance(d, Send) and (conn is None or d.conn is conn):
            h = parse_header(d.data[:HEADER_SIZE])
            out.append((d.conn, h, json.loads(d.data[HEADER_SIZE:])))
    return out


def push(core, conn, rank, world, rnd, key=0, chunk=0, nbytes=16, numel=4, dtype=DType.F32, op=Op.MEAN,
         handle=1, now=0.0, nchunks=1):
    h = data_header(MsgType.PUSH, dtype, op, handle, rank, world, rnd, key, chunk, nchunks, nbytes, numel)
    return core.handle(ChunkArrived(f"push-{conn}-{rnd}-{key}-{chunk}", now, conn, h, f"buf-{conn}-{rnd}-{key}-{chunk}"))


def job(core, name, world, now=0.0):
    conns = [Conn(f"{name}.{r}") for r in range(world)]
    for r, c in enumerate(conns):
        d = core.handle(Register(f"hello-{c}", now, c, Hello(name, r, world)))
        assert msgs(d, c)[0][1].mtype == MsgType.WELCOME
    return conns, core.jobs[name].handle


def test_round_completes_in_rank_order_whatever_the_arrival_order():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 3)
    assert push(core, conns[2], 2, 3, 0, handle=hd) == []
    assert push(core, conns[0], 0, 3, 0, handle=hd) == []
    (red,) = push(core, conns[1], 1, 3, 0, handle=hd)
    assert isinstance(red, Reduce)
    assert red.bufs == ("buf-j.0-0-0-0", "buf-j.1-0-0-0", "buf-j.2-0-0-0")
    assert red.divisor == 3.0 and red.conns == tuple(conns) and red.result.mtype == MsgType.RESULT
    assert core.pending_units() == 0


def test_sum_has_divisor_one_and_units_are_independent():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 2)
    push(core, conns[0], 0, 2, 0, key=1, op=Op.SUM, handle=hd)
    push(core, conns[0], 0, 2, 0, key=2, op=Op.SUM, handle=hd)
    (red,) = push(core, conns[1], 1, 2, 0, key=2, op=Op.SUM, handle=hd)
    assert red.divisor == 1.0 and red.result.key == 2 and core.pending_units() == 1


def test_shape_or_dtype_mismatch_fails_the_round_on_every_rank():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 2)
    push(core, conns[0], 0, 2, 4, numel=4, handle=hd)
    d = push(core, conns[1], 1, 2, 4, numel=8, nbytes=16, handle=hd)
    errs = msgs(d)
    assert {c for c, _, _ in errs} == set(conns)
    assert all(b["code"] == "mismatch" and h.round == 4 and h.key == ALL for _, h, b in errs)
    assert "rank 1 pushed float32 mean with 8 elements" in errs[0][2]["message"]
    assert "rank 0 pushed float32 mean with 4 elements" in errs[0][2]["message"]
    released = [b for x in d if isinstance(x, FreeBuffers) for b in x.bufs]
    assert set(released) == {"buf-j.0-4-0-0", "buf-j.1-4-0-0"}
    d = push(core, conns[0], 0, 2, 4, key=1, dtype=DType.F16, nbytes=8, handle=hd)  # late push to a failed round
    assert msgs(d)[0][2]["code"] == "mismatch"
    assert isinstance(d[0], FreeBuffers)


def test_world_mismatch_is_refused_with_a_clear_error():
    core = AggregationCore("s", 5.0)
    job(core, "j", 2)
    c = Conn("x")
    d = core.handle(Register("hello-x", 0.0, c, Hello("j", 1, 4)))
    (_, h, body), = msgs(d)
    assert body["code"] == "world_mismatch" and "world size 2" in body["message"]
    assert any(isinstance(x, Close) and x.conn is c for x in d)


def test_push_fields_must_match_the_connection():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 2)
    d = push(core, conns[0], 1, 2, 0, handle=hd)
    assert msgs(d)[0][2]["code"] == "bad_message"
    d = push(core, Conn("stranger"), 0, 2, 0, handle=hd)
    assert "PUSH before HELLO" in msgs(d)[0][2]["message"]
    push(core, conns[0], 0, 2, 1, handle=hd)
    d = push(core, conns[0], 0, 2, 1, handle=hd)
    assert msgs(d)[0][2]["code"] == "duplicate"


def test_lost_worker_fails_its_jobs_rounds_and_leaves_other_jobs_alone():
    core = AggregationCore("s", 5.0)
    a, ha = job(core, "a", 2)
    b, hb = job(core, "b", 2)
    push(core, a[0], 0, 2, 3, handle=ha)
    push(core, b[0], 0, 2, 3, handle=hb)
    d = core.handle(ConnectionLost("lost", 1.0, a[1]))
    errs = msgs(d)
    assert [(c, body["code"]) for c, _, body in errs] == [(a[0], "peer_lost")]
    assert "rank 1 of job a disconnected during round 3" in errs[0][2]["message"]
    assert core.jobs["b"].units and not core.jobs["a"].units
    (red,) = push(core, b[1], 1, 2, 3, handle=hb)
    assert isinstance(red, Reduce)


def test_round_timeout_names_the_missing_ranks():
    core = AggregationCore("s", 2.0)
    conns, hd = job(core, "j", 3)
    push(core, conns[0], 0, 3, 5, now=10.0, handle=hd)
    push(core, conns[2], 2, 3, 5, now=10.5, handle=hd)
    assert core.handle(Tick("t1", 11.9)) == []
    d = core.handle(Tick("t2", 12.0))
    errs = msgs(d)
    assert len(errs) == 3 and all(b["code"] == "timeout" for _, _, b in errs)
    assert "ranks [1] never pushed" in errs[0][2]["message"]
    assert core.pending_units() == 0


def test_reconnecting_rank_replaces_its_old_connection():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 2)
    push(core, conns[0], 0, 2, 0, handle=hd)
    new = Conn("j.1b")
    d = core.handle(Register("hello-again", 0.0, new, Hello("j", 1, 2)))
    assert any(isinstance(x, Close) and x.conn is conns[1] for x in d)
    assert [b["code"] for _, _, b in msgs(d, conns[0])] == ["peer_lost"]
    push(core, conns[0], 0, 2, 1, handle=hd)
    (red,) = push(core, new, 1, 2, 1, handle=hd)
    assert isinstance(red, Reduce)


def test_drain_finishes_started_rounds_and_redirects_new_ones():
    core = AggregationCore("s", 5.0)
    conns, hd = job(core, "j", 2)
    push(core, conns[0], 0, 2, 7, handle=hd)  # round 7 started here
    d = core.handle(Drain("drain", 0.0))
    notes = msgs(d)
    assert len(notes) == 2 and all(h.mtype == MsgType.REDIRECT and b["from_round"] == 8 for _, h, b in notes)
    # rank 1 pushes round 7 (started) and round 6 (below from_round): both stay here
    assert isinstance(push(core, conns[1], 1, 2, 7, handle=hd)[0], Reduce)
    assert push(core, conns[1], 1, 2, 6, handle=hd) == []
    # round 8 is new: redirected, buffer released, nothing kept
    d = push(core, conns[0], 0, 2, 8, key=3, chunk=1, nchunks=2, handle=hd)
    assert isinstance(d[0], FreeBuffers)
    (_, h, body), = msgs(d)
    assert h.mtype == MsgType.REDIRECT and (h.round, h.key, h.chunk) == (8, 3, 1)
    assert not core.drained()
    push(core, conns[0], 0, 2, 6, handle=hd)
    assert core.drained()


def test_new_job_on_a_draining_server_is_redirected_from_round_zero():
    core = AggregationCore("s", 5.0)
    core.handle(Drain("drain", 0.0))
    c = Conn("n")
    d = core.handle(Register("hello-n", 0.0, c, Hello("new", 0, 1)))
    kinds = [h.mtype for _, h, _ in msgs(d)]
    assert kinds == [MsgType.WELCOME, MsgType.REDIRECT] and msgs(d)[1][2]["from_round"] == 0


def test_last_rank_leaving_forgets_the_job():
    core = AggregationCore("s", 5.0)
    conns, _ = job(core, "j", 2)
    core.handle(ConnectionLost("bye0", 0.0, conns[0], orderly=True))
    core.handle(ConnectionLost("bye1", 0.0, conns[1], orderly=True))
    assert "j" not in core.jobs
    job(core, "j", 4)  # a new incarnation may use another world size
    assert core.jobs["j"].world == 4


def test_registered_layout_is_checked_at_registration_and_on_every_push():
    core = AggregationCore("s", 5.0)
    lay = ((0, 4, int(DType.F32)), (1, 8, int(DType.F16)))
    c0, c1, c2 = Conn("a"), Conn("b"), Conn("c")
    assert msgs(core.handle(Register("hello-a", 0.0, c0, Hello("j", 0, 2, lay))))[0][1].mtype == MsgType.WELCOME
    d = core.handle(Register("hello-b", 0.0, c1, Hello("j", 1, 2, ((0, 4, int(DType.F32)), (1, 9, int(DType.F16))))))
    (_, _, body), = msgs(d)
    assert body["code"] == "layout_mismatch" and "key 1: job has 8 float16 elements, this rank 9" in body["message"]
    core.handle(Register("hello-c", 0.0, c2, Hello("j", 1, 2)))  # a rank without a layout joins the registered one
    hd = core.jobs["j"].handle
    d = push(core, c0, 0, 2, 0, key=1, nbytes=16, numel=4, handle=hd)  # key 1 is float16 x 8
    (_, _, body), = msgs(d, c0)
    assert body["code"] == "mismatch" and "registered layout has 8 float16 elements" in body["message"]
    d = push(core, c2, 1, 2, 1, key=7, handle=hd)
    assert "no such key" in msgs(d, c2)[0][2]["message"]
    push(core, c0, 0, 2, 2, key=0, handle=hd)
    (red,) = push(core, c2, 1, 2, 2, key=0, handle=hd)
    assert isinstance(red, Reduce)


def test_a_job_cannot_pin_more_than_its_byte_limit():
    # exact payload accounting here; the charge floors have their own test below
    core = AggregationCore("s", 5.0, max_job_bytes=48, min_chunk_charge=0, unit_charge_per_rank=0)
    conns, hd = job(core, "j", 2)
    push(core, conns[0], 0, 2, 0, handle=hd)  # 16 bytes a chunk
    push(core, conns[0], 0, 2, 1, handle=hd)
    (red,) = push(core, conns[1], 1, 2, 0, handle=hd)  # 48 held at the peak: allowed
    assert isinstance(red, Reduce) and core.jobs["j"].held_bytes == 16
    push(core, conns[0], 0, 2, 2, handle=hd)
    push(core, conns[0], 0, 2, 3, handle=hd)
    assert core.jobs["j"].held_bytes == 48
    d = push(core, conns[0], 0, 2, 4, handle=hd)
    errs = msgs(d)
    assert {b["code"] for _, _, b in errs} == {"over_limit"} and "limit of 48" in errs[0][2]["message"]
    assert core.jobs["j"].held_bytes == 48  # round 4 held nothing; rounds 1-3 still wait
    core.handle(ConnectionLost("lost", 1.0, conns[1]))
    assert core.jobs["j"].held_bytes == 0


def test_tiny_chunks_of_a_huge_world_are_charged_for_their_bookkeeping():
    core = AggregationCore("s", 5.0, max_job_bytes=1 << 20)  # default charges: 4 KiB a chunk, 8 B a rank
    conns, hd = job(core, "big", 4096)
    accepted = 0
    for rnd in range(1000):
        d = push(core, conns[0], 0, 4096, rnd, handle=hd)  # one rank pushing 16-byte chunks
        if msgs(d):
            break
        accepted += 1
    # each open unit costs 4096 + 8 * 4096 bytes, so 1 MiB allows 28 of them, not a thousand
    assert accepted == (1 << 20) // (4096 + 8 * 4096)
    assert {b["code"] for _, _, b in msgs(d)} == {"over_limit"}
    core.handle(ConnectionLost("lost", 1.0, conns[0]))
    assert core.jobs.get("big") is None or core.jobs["big"].held_bytes == 0


def test_events_and_decisions_follow_the_one_convention():
    import aggregator.core

    assert_core_convention(aggregator.core)


def test_every_decision_carries_the_stimulus_id_of_its_event():
    core = AggregationCore("s", 2.0)
    conns, hd = job(core, "j", 2)
    d = push(core, conns[0], 0, 2, 0, handle=hd) + push(core, conns[1], 1, 2, 0, handle=hd)
    (red,) = d
    assert red.stimulus_id == f"push-{conns[1]}-0-0-0"
    push(core, conns[0], 0, 2, 1, now=1.0, handle=hd)
    d = core.handle(Tick("tick-9", 3.0))
    assert d and {x.stimulus_id for x in d} == {"tick-9"}
    push(core, conns[0], 0, 2, 2, handle=hd)
    d = core.handle(Register("hello-again", 0.0, Conn("j.1b"), Hello("j", 1, 2)))  # replaces rank 1's connection
    assert {type(x) for x in d} >= {Send, Close, FreeBuffers} and {x.stimulus_id for x in d} == {"hello-again"}
    d = core.handle(Drain("drain-1", 0.0))
    assert d and {x.stimulus_id for x in d} == {"drain-1"}


def test_a_hello_with_a_wrong_secret_is_refused_and_leaves_the_job_as_it_was():
    """The first HELLO sets the job's secret; a later one with another (or none) gets auth_failed and
    a Close for itself only: rank 0 keeps its connection and the round in flight completes."""
    core = AggregationCore("s", 5.0)
    a, b = Conn("a"), Conn("b")
    for r, c in enumerate((a, b)):
        d = core.handle(Register(f"h{r}", 0.0, c, Hello("j", r, 2, secret="right-secret")))
        assert msgs(d, c)[0][1].mtype == MsgType.WELCOME
    hd = core.jobs["j"].handle
    assert push(core, a, 0, 2, 0, handle=hd) == []
    for k, wrong in enumerate(("wrong-secret", None)):
        x = Conn(f"x{k}")
        d = core.handle(Register(f"x{k}", 0.1, x, Hello("j", 0, 2, secret=wrong)))
        assert [m[2]["code"] for m in msgs(d)] == ["auth_failed"] and {m[0] for m in msgs(d)} == {x}
        assert [c.conn for c in d if isinstance(c, Close)] == [x]
    assert core.jobs["j"].conns == {0: a, 1: b}
    (red,) = push(core, b, 1, 2, 0, handle=hd)
    assert isinstance(red, Reduce) and red.conns == (a, b)


def test_a_job_without_a_secret_stays_open_unless_the_server_requires_one():
    core = AggregationCore("s", 5.0)
    assert msgs(core.handle(Register("h", 0.0, Conn("a"), Hello("j", 0, 2))))[0][1].mtype == MsgType.WELCOME
    d = core.handle(Register("h2", 0.0, Conn("b"), Hello("j", 1, 2, secret="late-secret")))
    assert msgs(d)[0][2]["code"] == "auth_failed"  # an open job cannot be captured by a later secret either
    strict = AggregationCore("s", 5.0, require_secret=True)
    d = strict.handle(Register("h", 0.0, Conn("a"), Hello("j", 0, 2)))
    assert msgs(d)[0][2]["code"] == "auth_required" and "j" not in strict.jobs
    d = strict.handle(Register("h", 0.0, Conn("a"), Hello("j", 0, 2, secret="s" * 8)))
    assert msgs(d)[0][1].mtype == MsgType.WELCOME


def test_one_peer_holds_at_most_max_jobs_per_peer():
    """Promise: a peer address may hold connections in at most max_jobs_per_peer jobs; one more is
    refused with too_many_jobs (and closed), more ranks of a job it holds are not, other peers are
    not, and leaving a job makes room again."""
    core = AggregationCore("s", 5.0, max_jobs_per_peer=2)
    a = [Conn(f"a{i}") for i in range(5)]
    for i, name in enumerate(("j1", "j2")):
        assert msgs(core.handle(Register(f"h{i}", 0.0, a[i], Hello(name, 0, 2), "10.0.0.1")))[0][1].mtype == MsgType.WELCOME
    d = core.handle(Register("h2", 0.0, a[2], Hello("j3", 0, 1), "10.0.0.1"))
    (_, _, body), = msgs(d)
    assert body["code"] == "too_many_jobs" and "agg.max_jobs_per_peer" in body["message"]
    assert any(isinstance(x, Close) and x.conn is a[2] for x in d) and "j3" not in core.jobs
    assert msgs(core.handle(Register("h3", 0.0, a[3], Hello("j1", 1, 2), "10.0.0.1")))[0][1].mtype == MsgType.WELCOME
    assert msgs(core.handle(Register("h4", 0.0, Conn("b"), Hello("j3", 0, 1), "10.0.0.2")))[0][1].mtype == MsgType.WELCOME
    core.handle(ConnectionLost("bye", 0.0, a[1], orderly=True))  # j2 left
    assert msgs(core.handle(Register("h5", 0.0, a[4], Hello("j4", 0, 1), "10.0.0.1")))[0][1].mtype == MsgType.WELCOME
    assert core.peer_jobs["10.0.0.1"] == {"j1": 2, "j4": 1}


def test_the_scheduler_core_follows_the_same_convention():
    import scheduler.events

    assert_core_convention(scheduler.events)


def test_the_convention_check_fails_on_an_event_without_its_now(tmp_path):
    """The check can fail: an event whose second field is not ``now``, or a frozen class in neither set."""
    import types
    from dataclasses import dataclass

    import pytest

    mod = types.ModuleType("fake_core")

    @dataclass(frozen=True)
    class Ping:
        stimulus_id: str
        when: float

    @dataclass(frozen=True)
    class Pong:
        stimulus_id: str

    for cls in (Ping, Pong):
        cls.__module__ = "fake_core"
        setattr(mod, cls.__name__, cls)
    mod.Event, mod.Decision = Ping | Pong, Pong
    with pytest.raises(AssertionError, match="Ping starts with"):
        assert_core_convention(mod)
