"""The aggregation state machine: events in, decisions out, no sockets, threads or clocks.

:class:`AggregationCore` holds the jobs a server serves.  A job has ranks
(connections), and reductions in flight, each an :class:`AggregationRound`
unit identified by (round, key, chunk).  Buffers are opaque objects to the core:
it hands them back in decisions and never reads them.

The shell (aggregator/server.py) feeds :meth:`AggregationCore.handle` with
events and carries out the decisions it gets.  Events start with ``stimulus_id``
and ``now``; each decision carries the ``stimulus_id`` of the event behind it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

from aggregator.membership import DrainAck, DrainProgress, JoinBarrier
from aggregator.protocol import DType, Header, Hello, MsgType, Op, control, error

ALL = 0xFFFFFFFF  # key/chunk value of an error that covers a whole round
FAILED_ROUNDS_KEPT = 256  # failed rounds remembered per job, to answer late pushes at once

DEFAULT_MAX_JOB_BYTES = 4 << 30  # per job: bounds what ranks that push unmatched rounds can pin

ConnId = Hashable


# --- events ---------------------------------------------------------------------------------
# Every event starts with ``stimulus_id`` (unique per server: the shell numbers them) and ``now``
# (seconds on the shell's monotonic clock); every decision carries the ``stimulus_id`` of the event
# that produced it, so a server's run can be replayed and a decision traced to its cause.


@dataclass(frozen=True)
class Register:
    stimulus_id: str
    now: float
    conn: ConnId
    hello: Hello
    peer: str = ""  # the connection's address (IP): what the per-peer job cap counts


@dataclass(frozen=True)
class ChunkArrived:
    stimulus_id: str
    now: float
    conn: ConnId
    header: Header
    buf: Any


@dataclass(frozen=True)
class ConnectionLost:
    stimulus_id: str
    now: float
    conn: ConnId
    orderly: bool = False


@dataclass(frozen=True)
class Tick:
    """Time passed: rounds older than the round timeout fail."""

    stimulus_id: str
    now: float


@dataclass(frozen=True)
class Drain:
    stimulus_id: str
    now: float


Event = Register | ChunkArrived | ConnectionLost | Tick | Drain | DrainAck  # DrainAck: aggregator.membership's


# --- decisions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send a control message (header and JSON payload, already encoded)."""

    conn: ConnId
    data: bytes
    stimulus_id: str


@dataclass(frozen=True)
class Close:
    conn: ConnId
    stimulus_id: str


@dataclass(frozen=True)
class FreeBuffers:
    """Buffers the core no longer needs (a failed or refused reduction)."""

    bufs: tuple
    stimulus_id: str


@dataclass(frozen=True)
class Reduce:
    """Sum ``bufs`` (rank order) into ``bufs[0]``, divide by ``divisor``, send it to ``conns``."""

    job: str
    dtype: DType
    bufs: tuple
    divisor: float
    result: Header
    conns: tuple
    nbytes: int
    stimulus_id: str


Decision = Send | Close | FreeBuffers | Reduce


# --- state ----------------------------------------------------------------------------------


@dataclass
class AggregationRound:
    """One (round, key, chunk) reduction waiting for its ranks' chunks."""

    first: Header
    bufs: list
    created: float
    arrived: int = 0

    def missing(self) -> list[int]:
        return [r for r, b in enumerate(self.bufs) if b is None]


@dataclass
class AggregationJob:
    """One job's state on this server: its ranks' connections and its reductions in flight."""

    name: str
    handle: int
    world: int
    conns: dict[int, ConnId] = field(default_factory=dict)
    units: dict[tuple[int, int, int], AggregationRound] = field(default_factory=dict)
    failed: OrderedDict = field(default_factory=OrderedDict)  # round -> (code, message)
    max_round: int = -1
    drain_from: int | None = None
    layout: dict[int, tuple[int, int]] | None = None  # key -> (elements, dtype code), when registered
    bytes_in: int = 0
    rounds_done: int = 0
    held_bytes: int = 0  # chunks received and not yet reduced or dropped
    secret: bytes | None = field(default=None, repr=False)  # SHA-256 of the secret its first HELLO set


def secret_digest(secret: str | None) -> bytes | None:
    return None if secret is None else hashlib.sha256(secret.encode()).digest()


def same_secret(have: bytes | None, given: bytes | None) -> bool:
    """Constant-time comparison of two digests; two absent secrets match (an open job)."""
    if have is None or given is None:
        return have is None and given is None
    return hmac.compare_digest(have, given)


def _describe(h: Header) -> str:
    dt = DType(h.dtype).label
    return f"{dt} {Op(h.op).name.lower()} with {h.numel} elements in {h.nchunks} chunks ({h.nbytes}-byte chunk)"


def _layout_diff(have: dict[int, tuple[int, int]], new: tuple) -> str:
    theirs = {k: (n, dt) for k, n, dt in new}
    for k in sorted(set(have) | set(theirs)):
        a, b = have.get(k), theirs.get(k)
        if a != b:
            fmt = lambda v: "absent" if v is None else f"{v[0]} {DType(v[1]).label} elements"  # noqa: E731
            return f"key {k}: job has {fmt(a)}, this rank {fmt(b)}"
    return ""


class AggregationCore:
    """All jobs of one server.  Not thread-safe: the shell serialises calls."""

    def __init__(self, server_id: str, round_timeout_s: float, max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
                 min_chunk_charge: int = 4096, unit_charge_per_rank: int = 8, require_secret: bool = False,
                 max_jobs_per_peer: int = 0) -> None:
        """``max_job_bytes`` bounds what one job may pin.  Each pushed chunk is charged at least
        ``min_chunk_charge`` bytes and each open unit ``unit_charge_per_rank * world`` more, for its
        bookkeeping: otherwise a job with a large world pushing tiny chunks would pin gigabytes of
        Python objects while its payload count stayed near zero.

        A job's first HELLO sets its secret (or none, unless ``require_secret``); every later HELLO of
        the job must present the same one, or it is refused and the job is left as it was.

        ``max_jobs_per_peer``: the most jobs one peer address may hold a connection in at once (0:
        no limit); a HELLO that would hold one more is refused with ``too_many_jobs``."""
        self.require_secret = require_secret
        self.max_jobs_per_peer = max_jobs_per_peer
        self.conn_peer: dict[ConnId, str] = {}
        self.peer_jobs: dict[str, dict[str, int]] = {}  # peer -> job -> its connections there
        self.server_id = server_id
        self.min_chunk_charge = min_chunk_charge
        self.unit_charge_per_rank = unit_charge_per_rank
        self.round_timeout_s = round_timeout_s
        self.max_job_bytes = max_job_bytes
        self.jobs: dict[str, AggregationJob] = {}
        self.conn_job: dict[ConnId, tuple[str, int]] = {}
        self.draining = False
        self._next_handle = 1
        self.joins = JoinBarrier(round_timeout_s)  # failover: which rounds each job sends here
        self.drain_progress = DrainProgress()

    # public view for telemetry
    def summary(self) -> dict[str, Any]:
        return {
            name: {"world": j.world, "ranks": sorted(j.conns), "pending": len(j.units), "held_bytes": j.held_bytes,
                   "rounds_done": j.rounds_done, "bytes_in": j.bytes_in, "draining_from": j.drain_from,
                   "joined_from": self.joins.joined_from(name), "joining": self.joins.waiting(name)}
            for name, j in self.jobs.items()
        }

    def drain_ranks_left(self) -> dict[str, list[int]]:
        """While draining: the ranks of each job that may still send work here."""
        return self.drain_progress.ranks_left({n: (j.world, set(j.conns)) for n, j in self.jobs.items()})

    def moved(self) -> bool:
        """Draining, nothing in flight, and every rank has said it has nothing left here."""
        return self.drained() and not self.drain_ranks_left()

    def pending_units(self) -> int:
        return sum(len(j.units) for j in self.jobs.values())

    def handle(self, ev: Event) -> list[Decision]:
        if isinstance(ev, ChunkArrived):
            return self._chunk(ev)
        if isinstance(ev, Register):
            return self._register(ev)
        if isinstance(ev, ConnectionLost):
            return self._lost(ev)
        if isinstance(ev, Tick):
            return self._tick(ev)
        if isinstance(ev, Drain):
            return self._drain(ev)
        if isinstance(ev, DrainAck):
            who = self.conn_job.get(ev.conn)
            if who is not None and self.draining:
                self.drain_progress.ack(*who)
            return []
        raise TypeError(f"unknown event {type(ev).__name__}")

    # --- registration ---

    def _register(self, ev: Register) -> list[Decision]:
        h, sid = ev.hello, ev.stimulus_id
        out: list[Decision] = []
        if ev.conn in self.conn_job:
            msg = "this connection already said HELLO"
            return [Send(ev.conn, error("bad_message", msg), sid), Close(ev.conn, sid)]
        job = self.jobs.get(h.job)
        digest = secret_digest(h.secret)
        if digest is None and self.require_secret:
            msg = (f"server {self.server_id} requires a job secret: every rank of job {h.job} must present "
                   f"the same one (set DLSHARE_AGG_SECRET or pass secret= to the client)")
            return [Send(ev.conn, error("auth_required", msg), sid), Close(ev.conn, sid)]
        if job is not None and not same_secret(job.secret, digest):
            # Checked before anything else about the job, so a stranger learns nothing more and
            # the running job keeps its ranks and its rounds.
            msg = (f"job {h.job} is registered on server {self.server_id} with another secret (or none): "
                   f"HELLO for rank {h.rank} refused")
            return [Send(ev.conn, error("auth_failed", msg), sid), Close(ev.conn, sid)]
        if job is not None and job.world != h.world:
            msg = f"job {h.job} has world size {job.world} on server {self.server_id}; rank {h.rank} says {h.world}"
            return [Send(ev.conn, error("world_mismatch", msg), sid), Close(ev.conn, sid)]
        if job is not None and h.layout is not None and job.layout is not None:
            diff = _layout_diff(job.layout, h.layout)
            if diff:
                msg = f"rank {h.rank} registered a layout that differs from job {h.job}'s: {diff}"
                return [Send(ev.conn, error("layout_mismatch", msg), sid), Close(ev.conn, sid)]
        held = self.peer_jobs.get(ev.peer, {})
        if self.max_jobs_per_peer and h.job not in held and len(held) >= self.max_jobs_per_peer:
            msg = (f"{ev.peer or 'this peer'} holds connections in {len(held)} jobs on server {self.server_id}, "
                   f"the limit per address (agg.max_jobs_per_peer)")
            return [Send(ev.conn, error("too_many_jobs", msg), sid), Close(ev.conn, sid)]
        if job is None:
            job = AggregationJob(h.job, self._next_handle, h.world, secret=digest)
            self._next_handle += 1
            if self.draining:
                job.drain_from = 0
            self.jobs[h.job] = job
        old = job.conns.get(h.rank)
        if old is not None:
            # A restarted worker replaces its old connection; the old one's rounds cannot finish.
            out += self._lost(ConnectionLost(sid, ev.now, old))
            out.append(Close(old, sid))
            if h.job not in self.jobs:  # the job went away with its last rank
                self.jobs[h.job] = job
        if h.layout is not None and job.layout is None:
            job.layout = {k: (n, dt) for k, n, dt in h.layout}
        job.conns[h.rank] = ev.conn
        self.conn_job[ev.conn] = (h.job, h.rank)
        self.conn_peer[ev.conn] = ev.peer
        jobs = self.peer_jobs.setdefault(ev.peer, {})
        jobs[h.job] = jobs.get(h.job, 0) + 1
        body: dict[str, Any] = {"server": self.server_id, "job_handle": job.handle}
        out.append(Send(ev.conn, control(MsgType.WELCOME, body, job=job.handle, rank=h.rank, world=h.world), sid))
        if h.next_round is not None:
            for rank, conn, start in self.joins.hello(h.job, job.world, h.rank, ev.conn, h.next_round, ev.now):
                out.append(Send(conn, control(MsgType.JOINED, {"from_round": start}, job=job.handle, rank=rank,
                                              world=job.world), sid))
        if job.drain_from is not None:
            out.append(Send(ev.conn, self._redirect(job, ALL, ALL), sid))
        return out

    # --- data ---

    def _chunk(self, ev: ChunkArrived) -> list[Decision]:
        h, sid = ev.header, ev.stimulus_id
        who = self.conn_job.get(ev.conn)
        if who is None:
            return [FreeBuffers((ev.buf,), sid),
                    Send(ev.conn, error("bad_message", "PUSH before HELLO", h.round, h.key, h.chunk), sid)]
        job = self.jobs[who[0]]
        rank = who[1]
        if h.job != job.handle or h.rank != rank or h.world != job.world:
            msg = (f"PUSH names job handle {h.job} rank {h.rank} world {h.world}; this connection is "
                   f"job {job.name} (handle {job.handle}) rank {rank} world {job.world}")
            return [FreeBuffers((ev.buf,), sid), Send(ev.conn, error("bad_message", msg, h.round, h.key, h.chunk), sid)]
        if h.round in job.failed:
            code, msg = job.failed[h.round]
            return [FreeBuffers((ev.buf,), sid), Send(ev.conn, error(code, msg, h.round, ALL, ALL, job.handle), sid)]
        if job.layout is not None:
            want = job.layout.get(h.key)
            if want != (h.numel, h.dtype):
                exp = "no such key" if want is None else f"{want[0]} {DType(want[1]).label} elements"
                msg = (f"layout mismatch in job {job.name} round {h.round}: rank {rank} pushed key {h.key} "
                       f"as {h.numel} {DType(h.dtype).label} elements; the registered layout has {exp}")
                return [FreeBuffers((ev.buf,), sid)] + self._fail_round(job, h.round, "mismatch", msg, sid)
        unit_id = h.unit
        unit = job.units.get(unit_id)
        charge = self._chunk_charge(h) + (self._unit_charge(job) if unit is None else 0)
        if job.held_bytes + charge > self.max_job_bytes:
            msg = (f"job {job.name} holds {job.held_bytes} bytes of unfinished reductions on server "
                   f"{self.server_id}; another {charge} would pass its limit of {self.max_job_bytes} "
                   f"(agg.max_job_bytes): are its ranks pushing different rounds?")
            return [FreeBuffers((ev.buf,), sid)] + self._fail_round(job, h.round, "over_limit", msg, sid)
        if unit is None:
            if job.drain_from is not None and h.round >= job.drain_from:
                return [FreeBuffers((ev.buf,), sid), Send(ev.conn, self._redirect(job, h.key, h.chunk, h.round), sid)]
            unit = AggregationRound(h, [None] * job.world, ev.now)
            job.units[unit_id] = unit
            job.max_round = max(job.max_round, h.round)
        else:
            f = unit.first
            if (f.dtype, f.op, f.nchunks, f.nbytes, f.numel) != (h.dtype, h.op, h.nchunks, h.nbytes, h.numel):
                msg = (f"mismatch in job {job.name} round {h.round} key {h.key} chunk {h.chunk}: rank {rank} "
                       f"pushed {_describe(h)}, rank {f.rank} pushed {_describe(f)}")
                return [FreeBuffers((ev.buf,), sid)] + self._fail_round(job, h.round, "mismatch", msg, sid)
            if unit.bufs[rank] is not None:
                msg = f"rank {rank} pushed round {h.round} key {h.key} chunk {h.chunk} of job {job.name} twice"
                return [FreeBuffers((ev.buf,), sid), Send(ev.conn, error("duplicate", msg, h.round, h.key, h.chunk), sid)]
        unit.bufs[rank] = ev.buf
        unit.arrived += 1
        job.bytes_in += h.nbytes
        job.held_bytes += charge
        if unit.arrived < job.world:
            return []
        del job.units[unit_id]
        job.held_bytes -= self._chunk_charge(h) * job.world + self._unit_charge(job)
        job.rounds_done += 1
        conns = tuple(job.conns.get(r) for r in range(job.world))
        f = unit.first
        result = f.with_(mtype=MsgType.RESULT, rank=0)
        divisor = float(job.world) if f.op == Op.MEAN else 1.0
        return [Reduce(job.name, DType(f.dtype), tuple(unit.bufs), divisor, result, conns, f.nbytes, sid)]

    def _chunk_charge(self, h: Header) -> int:
        return max(h.nbytes, self.min_chunk_charge)

    def _unit_charge(self, job: AggregationJob) -> int:
        return self.unit_charge_per_rank * job.world

    # --- faults ---

    def _fail_round(self, job: AggregationJob, rnd: int, code: str, msg: str, sid: str,
                    skip: ConnId | None = None) -> list[Decision]:
        out: list[Decision] = []
        job.failed[rnd] = (code, msg)
        while len(job.failed) > FAILED_ROUNDS_KEPT:
            job.failed.popitem(last=False)
        for uid in [u for u in job.units if u[0] == rnd]:
            unit = job.units.pop(uid)
            bufs = tuple(b for b in unit.bufs if b is not None)
            job.held_bytes -= self._chunk_charge(unit.first) * len(bufs) + self._unit_charge(job)
            if bufs:
                out.append(FreeBuffers(bufs, sid))
        for conn in job.conns.values():
            if conn != skip:
                out.append(Send(conn, error(code, msg, rnd, ALL, ALL, job.handle), sid))
        return out

    def _lost(self, ev: ConnectionLost) -> list[Decision]:
        who = self.conn_job.pop(ev.conn, None)
        if who is None:
            return []
        name, rank = who
        peer = self.conn_peer.pop(ev.conn, "")
        jobs = self.peer_jobs.get(peer, {})
        if jobs.get(name, 0) > 1:
            jobs[name] -= 1
        else:
            jobs.pop(name, None)
            if not jobs:
                self.peer_jobs.pop(peer, None)
        job = self.jobs[name]
        if job.conns.get(rank) == ev.conn:
            del job.conns[rank]
        self.joins.lost(name, rank, ev.conn)
        out: list[Decision] = []
        how = "closed its connection" if ev.orderly else "disconnected"
        for rnd in sorted({u[0] for u in job.units}):
            msg = f"rank {rank} of job {name} {how} during round {rnd} (server {self.server_id})"
            out += self._fail_round(job, rnd, "peer_lost", msg, ev.stimulus_id, skip=ev.conn)
        if not job.conns:
            del self.jobs[name]
            self.joins.forget(name)
            self.drain_progress.forget(name)
        return out

    def _tick(self, ev: Tick) -> list[Decision]:
        out: list[Decision] = []
        for job in list(self.jobs.values()):
            late = {}
            for uid, unit in job.units.items():
                if ev.now - unit.created >= self.round_timeout_s:
                    late.setdefault(uid[0], (uid, unit))
            for rnd, (uid, unit) in sorted(late.items()):
                msg = (f"round {rnd} of job {job.name} timed out after {self.round_timeout_s:g} s on server "
                       f"{self.server_id}: ranks {unit.missing()} never pushed key {uid[1]} chunk {uid[2]}")
                out += self._fail_round(job, rnd, "timeout", msg, ev.stimulus_id)
        for gone in self.joins.expired(ev.now):
            msg = (f"job {gone.job} could not join server {self.server_id}: ranks {list(gone.missing)} did not "
                   f"connect within {self.round_timeout_s:g} s of the first (the job keeps using its other servers)")
            for _rank, conn in gone.conns:
                out += [Send(conn, error("join_timeout", msg, 0, ALL, ALL), ev.stimulus_id), Close(conn, ev.stimulus_id)]
        return out

    # --- draining ---

    def _redirect(self, job: AggregationJob, key: int, chunk: int, rnd: int | None = None) -> bytes:
        body = {"from_round": job.drain_from, "server": self.server_id}
        return control(MsgType.REDIRECT, body, job=job.handle, round=job.drain_from if rnd is None else rnd,
                       key=key, chunk=chunk)

    def _drain(self, ev: Drain) -> list[Decision]:
        """Stop taking new rounds: each job's rounds from the next one on go to the other servers.

        Reductions already started here (any rank pushed) finish here; a round
        nobody has pushed yet is redirected, so every rank of a job sends a
        given chunk to the same server whether or not it has heard of the drain.
        """
        self.draining = True
        out: list[Decision] = []
        for job in self.jobs.values():
            if job.drain_from is None:
                job.drain_from = job.max_round + 1
            for conn in job.conns.values():
                out.append(Send(conn, self._redirect(job, ALL, ALL), ev.stimulus_id))
        return out

    def drained(self) -> bool:
        return self.draining and self.pending_units() == 0
