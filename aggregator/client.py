"""``aggregator.Client``: all-reduce numpy arrays and torch tensors through aggregation servers.

A tensor is cut into equal chunks (at most 4 MiB by default, as many as the
servers need for an even share) and chunk ``c`` of key ``k`` goes to the
server aggregator/placement.py picks, so several servers share the key space
evenly.  Each server has its own sender thread, so pushes to all servers
proceed at once; results are received straight into the caller's buffer
(reductions are in place, like ``torch.distributed.all_reduce``).

Failover (``failover=True``, the default): when a server dies, the chunks it
held are pushed again, from copies kept for the purpose, to the servers the
consistent-hash ring names for them; every other chunk stays where it was.
The round in flight finishes there without double counting (each rank
contributes each chunk once to each server), and training goes on without an
error.  A rank keeps the copies of a round until one of its later rounds
completes, which covers ranks that step in lockstep as DDP does.  The dead
server is probed in the background; when it is back, every rank uses it again
from a round the server picks once all ranks have reconnected
(aggregator/membership.py).  With ``failover=False`` a lost server fails the
rounds in flight on it, as a server error does.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from aggregator import kernel
from aggregator.inflight import AggregationError, Allreduce, CopyPool, Unit
from aggregator.link import ALL, DOWN, JOINING, NEW, ServerLink
from aggregator.placement import HashRing, NoServer, Placement, chunk_for_link, split
from aggregator.protocol import SECRET_ENV, DType, Header, MsgType, Op as ReduceOp
from aggregator.stages import summarise_op

__all__ = ["Client", "AggregationError", "HashRing", "as_bytes", "make_layout"]

log = logging.getLogger("dlshare.agg.client")

_WIRE = {"fp16": DType.F16, "bf16": DType.BF16}
DEFAULT_CHUNK_BYTES = 4 << 20  # when neither chunk_bytes nor the link's rate is given
LINK_ENV = "DLSHARE_AGG_LINK_GBIT"  # the hosts' link rate, when the launcher knows it: sizes the chunks
# Chunks a rank may have pushed to one server and not yet had answered (0: no limit).  See ServerLink.
DEFAULT_WINDOW_CHUNKS = 4


def as_bytes(x: Any) -> tuple[np.ndarray, DType]:
    """A writable uint8 view of a contiguous fp32/fp16/bf16 numpy array or CPU torch tensor."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"allreduce needs a CPU tensor, got one on {x.device}")
        if not x.is_contiguous():
            raise ValueError("allreduce needs a contiguous tensor (call .contiguous() first)")
        kinds = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}
        if x.dtype not in kinds:
            raise TypeError(f"allreduce supports float32, float16 and bfloat16 tensors, not {x.dtype}")
        dt = kinds[x.dtype]
        arr = x.detach().view(torch.uint8).numpy() if x.numel() else np.zeros(0, np.uint8)
        return arr.reshape(-1), dt
    if isinstance(x, np.ndarray):
        kinds = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16}
        if x.dtype not in kinds:
            raise TypeError(f"allreduce supports float32 and float16 arrays (bf16 as torch tensors), not {x.dtype}")
        if not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError("allreduce needs a C-contiguous, writable array")
        return x.reshape(-1).view(np.uint8), kinds[x.dtype]
    raise TypeError(f"allreduce takes a numpy array or torch tensor, not {type(x).__name__}")


def make_layout(spec: dict[int, Any]):
    """The layout a job registers: ``{key: tensor or array}`` or ``{key: (elements, "float32")}``."""
    names = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16}
    out = []
    for key, v in spec.items():
        if isinstance(v, tuple):
            numel, name = v
            if name not in names:
                raise ValueError(f"layout key {key}: dtype must be one of {', '.join(names)}, not {name!r}")
            out.append((int(key), int(numel), int(names[name])))
        else:
            data, dt = as_bytes(v)
            out.append((int(key), data.nbytes // dt.itemsize, int(dt)))
    return tuple(sorted(out))


class Client:
    """All-reduce through aggregation servers.

    ``servers``: ``"host:port"`` strings (or one comma-separated string), the
    same list on every rank.  ``job``: the job id shared by all ranks; ``rank``
    in ``0..world-1``.  ``timeout_s`` bounds a round on this side (the server
    fails a round after its own ``round_timeout_s``).  Every rank must call
    ``allreduce`` in the same order with tensors of the same shape and dtype.
    ``layout`` (optional, ``{key: tensor}`` or ``{key: (elements, "float32")}``)
    registers the job's keys: a rank registering a different layout is refused,
    and a tensor that does not fit its key is refused before anything is sent.
    Without it, each key is checked across ranks within its round (what DDP's
    changing buckets need).  ``failover`` keeps a copy of what each round
    pushed so that a dead server's chunks can be retried elsewhere (module
    docstring); it costs one memory copy of the pushed bytes.  ``secret``: the job's shared
    secret, the same on every rank (default: the ``DLSHARE_AGG_SECRET`` environment variable); the
    first HELLO of a job registers it on each server and every later HELLO must present it.
    ``trace`` records the stage times of every reduction (aggregator/stages.py): :meth:`stage_records`.

    Pipelining: a key is cut into chunks of ``chunk_bytes``; by default they are sized from
    ``link_gbit``, the rate of the hosts' links (or the ``DLSHARE_AGG_LINK_GBIT`` environment
    variable), so that a chunk takes about 8 ms on its connection (aggregator/placement.py), and
    are 4 MiB when the rate is unknown; every rank must use the same size.  At most
    ``window_chunks`` chunks per server are pushed and not yet answered (aggregator/link.py).
    """

    def __init__(self, servers: list[str] | str, job: str, rank: int, world: int,
                 chunk_bytes: int | None = None, timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, layout: dict[int, Any] | None = None,
                 failover: bool = True, secret: str | None = None, trace: bool = False,
                 window_chunks: int = DEFAULT_WINDOW_CHUNKS, link_gbit: float | None = None) -> None:
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world size {world}")
        if link_gbit is None and os.environ.get(LINK_ENV):
            try:
                link_gbit = float(os.environ[LINK_ENV])
            except ValueError:
                raise ValueError(f"{LINK_ENV} must be a number of Gbit/s, not {os.environ[LINK_ENV]!r}") from None
        if link_gbit is not None and not link_gbit > 0:
            raise ValueError(f"link_gbit must be positive, not {link_gbit!r}")
        self.link_gbit = link_gbit
        if chunk_bytes is None:
            nserv = len(set(servers))
            chunk_bytes = (DEFAULT_CHUNK_BYTES if link_gbit is None
                           else chunk_for_link(link_gbit * 1e9 / 8, nserv, world))
        if chunk_bytes <= 0 or chunk_bytes % 4:
            raise ValueError("chunk_bytes must be a positive multiple of 4")
        if window_chunks < 0:
            raise ValueError("window_chunks must be >= 0 (0: no window)")
        self.window_chunks = window_chunks
        self.job, self.rank, self.world = job, rank, world
        self.secret = secret if secret is not None else (os.environ.get(SECRET_ENV) or None)
        self.layout = None if layout is None else make_layout(layout)
        self._layout = None if self.layout is None else {k: (n, dt) for k, n, dt in self.layout}
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.failover = failover
        self.placement = Placement(servers, job)
        self.ring = self.placement.ring
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.links = {s: ServerLink(self, s) for s in self.placement.servers}
        self.next_round = 0  # every round below this one may have been started by this rank
        # Rounds below this one push without a window: they were in flight when a server was lost or
        # redirected, and their retried chunks go out in an order that differs between ranks.  Ranks
        # that step in lockstep are at most a round apart, and a rank may dispatch one more round
        # before it notices the loss, so the two rounds after its next one are covered too.
        self.window_from = 0
        self.closed = False
        self.retries = 0  # chunks pushed again after their server was lost (for tests and telemetry)
        self.copies = CopyPool()
        self._stages: collections.deque | None = collections.deque(maxlen=4096) if trace else None
        self._round = itertools.count()
        self._ops: dict[int, Allreduce] = {}
        self._ops_lock = threading.Lock()
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="agg-client-dispatch", daemon=True)
        self._dispatcher.start()
        self._maint = threading.Thread(target=self._maintain, name="agg-client-maintain", daemon=True)
        self._maint.start()

    # --- public ---

    def allreduce(self, x: Any, op: str = "mean", key: int = 0, round: int | None = None,
                  wire: str | None = None) -> Any:
        """Reduce ``x`` in place across the job's ranks and return it (``wire``: see :meth:`allreduce_async`)."""
        fut = self.allreduce_async(x, op, key, round, wire)
        return fut.result(timeout=self.timeout_s + 5.0)

    def allreduce_async(self, x: Any, op: str = "mean", key: int = 0, round: int | None = None,
                        wire: str | None = None) -> Future:
        """Start reducing ``x`` in place; the Future resolves to ``x``.

        ``wire`` (``"fp16"`` or ``"bf16"``, for a float32 ``x``): send 16-bit floats and receive the
        result in 16 bits, halving the bytes on the wire.  Each chunk is narrowed just before its push
        and its result widened into ``x`` as it arrives (round to nearest even, as torch's ``.to()``);
        the server adds the 16-bit inputs in fp32 and rounds once."""
        if self.closed:
            raise AggregationError("client is closed", "closed")
        try:
            o = ReduceOp[op.upper()]
        except KeyError:
            raise ValueError(f"op must be 'sum' or 'mean', not {op!r}") from None
        data, dtype = as_bytes(x)
        wdt = None
        if wire is not None:
            if wire not in _WIRE:
                raise ValueError(f"wire must be one of {', '.join(_WIRE)}, not {wire!r}")
            if dtype != DType.F32:
                raise TypeError(f"a {wire} wire needs a float32 tensor, not {dtype.label}")
            wdt = _WIRE[wire]
        sent = wdt or dtype
        if self._layout is not None:
            want = self._layout.get(key)
            have = (data.nbytes // dtype.itemsize, int(sent))
            if want != have:
                exp = "not in the layout" if want is None else f"{want[0]} {DType(want[1]).label} elements"
                raise ValueError(f"key {key} has {have[0]} {sent.label} elements; the job's layout says {exp}")
        rnd = next(self._round) if round is None else int(round)
        fut: Future = Future()
        if data.nbytes == 0:
            fut.set_result(x)
            return fut
        opr = Allreduce(x, data, dtype, o, rnd, key, data.nbytes // dtype.itemsize, fut, time.monotonic(), wire=wdt)
        if self._stages is not None:
            opr.ready_t = time.time()
        with self._ops_lock:
            self._ops[id(opr)] = opr
        fut.add_done_callback(lambda _f, o=opr: self._finished(o))
        self._sendq.put(opr)
        return fut

    def stats(self) -> dict[str, Any]:
        """Per server: link state, the round it joined from, payload bytes pushed; and the retries."""
        with self.cond:
            return {"retries": self.retries, "next_round": self.next_round,
                    "servers": {a: {"state": link.state, "joined_from": link.joined_from,
                                    "draining_from": link.drain_from, "bytes_sent": link.bytes_sent,
                                    "why": link.why} for a, link in self.links.items()}}

    def stage_records(self) -> list[dict[str, Any]]:
        """With ``trace=True``: one record per completed reduction (aggregator.stages.summarise_op)."""
        return [] if self._stages is None else list(self._stages)

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self._sendq.put(None)
        self._wake.set()
        self._dispatcher.join(timeout=5)
        for link in self.links.values():
            link.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- dispatch: cut an op into units and route them ---

    def _dispatch_loop(self) -> None:
        while True:
            opr = self._sendq.get()
            if opr is None:
                return
            try:
                self._dispatch(opr)
            except Exception as exc:  # the dispatcher must live on; the caller gets the error
                log.exception("dispatch of round %d key %d failed", opr.round, opr.key)
                opr.fail(AggregationError(f"push of round {opr.round} failed: {exc!r}", "error", opr.round))

    def _units(self, opr: Allreduce) -> list[Unit]:
        size, wsize = opr.dtype.itemsize, opr.wire_dtype.itemsize
        parts = split(opr.numel, wsize, self.chunk_bytes, len(self.links))
        opr.nchunks = opr.left = len(parts)
        units = []
        trace = self._stages is not None
        for c, (first, count) in enumerate(parts):
            units.append(Unit(opr, c, first * size, count * wsize, opr.numel, times=[0.0] * 4 if trace else None))
        if trace:
            opr.units = units
        return units

    def _dispatch(self, opr: Allreduce) -> None:
        units = self._units(opr)
        fails: list[AggregationError] = []
        with self.cond:
            if not self._wait_placeable(opr, fails):
                for u in units:
                    self.copies.give(u.copy)
            else:
                self.next_round = max(self.next_round, opr.round + 1)
                for u in units:
                    link = self._route(u)
                    assert link is not None  # _wait_placeable saw a usable server under this lock
                    link.put(u)
                self._check_drains()
        for exc in fails:
            opr.fail(exc)

    def _wait_placeable(self, opr: Allreduce, fails: list) -> bool:
        """Wait (lock held) until every server's use for ``opr.round`` is decided and one can take it."""
        deadline = None
        while True:
            if opr.done or self.closed:
                if self.closed:
                    fails.append(AggregationError("client is closed", "closed", opr.round))
                return False
            undecided = False
            for link in self.links.values():
                if link.state == NEW:
                    undecided = True
                    if not link.connecting:
                        link.connecting = True
                        threading.Thread(target=link.join, args=(self.connect_timeout_s,), daemon=True,
                                         name=f"agg-join-{link.addr}").start()
                elif link.state == JOINING and link.hello_round is not None and opr.round >= link.hello_round:
                    undecided = True
            if not undecided:
                if any(link.usable(opr.round) for link in self.links.values()):
                    return True
                now = time.monotonic()
                if deadline is None:
                    # nothing can take it: try the servers that are down now, for up to connect_timeout_s
                    deadline = now + self.connect_timeout_s
                    for link in self.links.values():
                        if link.state == DOWN:
                            link.next_probe = 0.0
                    self._wake.set()
                elif now >= deadline:
                    fails.append(self._no_server_error(opr.round))
                    return False
            self.cond.wait(0.05)

    def _no_server_error(self, rnd: int) -> AggregationError:
        links = list(self.links.values())
        if len(links) == 1:
            return AggregationError(links[0].why or f"aggregation server {links[0].addr} is unavailable",
                                    links[0].why_code, rnd)
        why = "; ".join(f"{link.addr}: {link.why or link.state}" for link in links)
        code = next((link.why_code for link in links if link.why_code != "unreachable"), "unreachable")
        return AggregationError(f"no aggregation server can take round {rnd} of job {self.job}: {why}", code, rnd)

    def _route(self, u: Unit, avoid: ServerLink | None = None) -> ServerLink | None:
        rnd = u.op.round
        skip = {a for a, link in self.links.items() if link is avoid or not link.usable(rnd)}
        try:
            return self.links[self.placement.server_for(u.op.key, u.chunk, skip)]
        except NoServer:
            return None

    # --- events from the links (called without the lock held) ---

    def link_lost(self, link: ServerLink, sock, why: str, reader: bool = False) -> None:
        """``sock`` of ``link`` failed: retry what it held on the other servers, then probe it."""
        fails: list[tuple[Allreduce, str]] = []
        with self.cond:
            if link.sock is sock:
                link.sock, q, link.queue = None, link.queue, None
                units = list(link.units.values())
                link.units.clear()
                link.inflight = set()
                link.credit.notify_all()
                self.window_from = max(self.window_from, self.next_round + 2)
                if q is not None:
                    q.put(None)
                closing = self.closed
                link.state, link.joined_from, link.hello_round = DOWN, None, None
                link.drain_from, link.connecting = None, False
                link.why, link.next_probe = why, time.monotonic() + link.backoff
                if link.why_code != "join_timeout":
                    link.why_code = "server_lost"
                for u in units:
                    ours = not u.done and not u.contrib and not u.op.done
                    failed = u.op.done and not u.op.ok and not u.contrib  # our op gave up: nobody needs it
                    if closing or failed or (u.contrib and u.done):
                        if ours:
                            fails.append((u.op, "client closed"))
                        self.copies.give(u.copy)
                        continue
                    # what is left: our reductions still in flight, and chunks whose result we have
                    # (kept since) that peers may still be waiting for: both go to the next server
                    # a unit never sent has no copy yet: its bytes are still the caller's, untouched
                    retry = self.failover and (u.copy is not None or not u.done)
                    target = self._route(u, avoid=link) if retry else None
                    if target is None:
                        if ours:
                            fails.append((u.op, why if not self.failover else
                                          f"{why} (and no other aggregation server is up to retry on)"))
                        self.copies.give(u.copy)
                        continue
                    u.done, u.contrib = False, not ours
                    self.retries += 1
                    target.put(u)
                self.cond.notify_all()
        try:
            sock.shutdown(2)  # socket.SHUT_RDWR; wakes the reader
        except OSError:
            pass
        if reader:
            sock.close()  # only the reader closes, so a descriptor is never reused under a thread reading it
        if fails and not self.closed:
            log.warning("%s: %d chunk(s) could not be retried", why, len(fails))
        for opr, msg in fails:
            opr.fail(AggregationError(msg, "closed" if msg == "client closed" else "server_lost", opr.round))
        self._wake.set()

    def keep_copy(self, link: ServerLink, u: Unit) -> None:
        """(a link's sender, just before pushing ``u``) Keep the bytes for a retry elsewhere.

        Taken here rather than at dispatch, so the copies run in each server's sender thread,
        overlapped with the sends; the bytes cannot change before this push, as the result that
        overwrites them needs it.  A job with one server has nowhere to retry, so it keeps none
        (on loopback the copy was a fifth of the bytes a step moves).  A compressed chunk is
        narrowed into its copy, which is what goes on the wire, whether or not it is kept."""
        narrow = u.op.wire is not None
        if u.copy is not None or u.contrib:
            return
        if not narrow and (not self.failover or len(self.links) == 1):
            return
        if narrow:
            buf = self.copies.empty(u.nbytes)
            kernel.convert(u.op.wire, buf, u.op.dtype, u.local())
        else:
            buf = self.copies.take(u.local())
        with self.cond:
            if u.copy is None and link.units.get(u.uid) is u:
                u.copy, buf = buf, None
        self.copies.give(buf)

    def unit_answered(self, link: ServerLink, u: Unit) -> None:
        with self.cond:
            u.done = True
            if not self.failover or u.contrib or len(self.links) == 1:
                if link.units.get(u.uid) is u:
                    del link.units[u.uid]
                    self.copies.give(u.copy)
                    u.copy = None

    def server_error(self, link: ServerLink, h: Header, code: str, message: str) -> None:
        exc = AggregationError(f"round {h.round} failed: {message}", code, h.round)
        with self.cond:
            if h.key == ALL:
                hit = [uid for uid in link.units if uid[0] == h.round]
            else:
                hit = [h.unit] if h.unit in link.units else []
            units = [link.units.pop(uid) for uid in hit]
            for u in units:
                self.copies.give(u.copy)
            link.answered([u.uid for u in units] if h.key != ALL else None, h.round)
        for u in units:
            u.op.fail(exc)
        if h.key == ALL:
            with self._ops_lock:
                ops = [o for o in self._ops.values() if o.round == h.round]
            for o in ops:
                o.fail(exc)

    def redirected(self, link: ServerLink, h: Header, from_round: int) -> None:
        """A draining server: rounds from ``from_round`` go elsewhere; a refused chunk is re-routed."""
        fail = None
        with self.cond:
            link.drain_from, link.drain_acked = from_round, False
            self.window_from = max(self.window_from, self.next_round + 2)
            if h.key != ALL:
                link.answered([h.unit])
                u = link.units.pop(h.unit, None)
                if u is not None and u.needed():
                    target = self._route(u, avoid=link)
                    if target is None:
                        fail = u
                    else:
                        target.put(u)
            self._check_drains()
            self.cond.notify_all()
        if fail is not None:
            fail.op.fail(self._no_server_error(h.round))

    def _check_drains(self) -> None:
        """(lock held) Tell each draining server once nothing of ours below its drain round is left there."""
        for link in self.links.values():
            f = link.drain_from
            if f is None or link.drain_acked or link.queue is None:
                continue
            # next_round > f: this rank has started a round past the drain, so (rounds only grow) it
            # starts nothing more below it
            if self.next_round > f and not any(u.uid[0] < f and not u.done for u in link.units.values()):
                link.drain_acked = True
                link.put_control(Header(MsgType.DRAINED).pack())

    # --- completion, retention, probing, timeouts ---

    def _finished(self, opr: Allreduce) -> None:
        with self._ops_lock:
            self._ops.pop(id(opr), None)
        if self._stages is not None and opr.ok and opr.units is not None:
            self._stages.append(summarise_op(opr.round, opr.key, opr.data.nbytes, opr.ready_t, time.time(),
                                             [(u.server, list(u.times)) for u in opr.units]))
            opr.units = None
        with self.cond:
            for link in self.links.values():
                for uid, u in list(link.units.items()):
                    # a completed round frees the copies of the rounds before it; a failed op frees its own
                    if (u.op is opr and not opr.ok) or (opr.ok and uid[0] < opr.round and u.done):
                        del link.units[uid]
                        self.copies.give(u.copy)
                        u.copy = None
            self._check_drains()

    def _maintain(self) -> None:
        last_watch = 0.0
        while not self.closed:
            self._wake.wait(0.1)
            self._wake.clear()
            now = time.monotonic()
            with self.cond:
                due = [link for link in self.links.values()
                       if link.state == DOWN and not link.connecting and link.next_probe <= now]
                for link in due:
                    link.connecting = True
            for link in due:
                threading.Thread(target=link.join, args=(0.0,), daemon=True, name=f"agg-probe-{link.addr}").start()
            if now - last_watch >= 0.25:
                last_watch = now
                with self._ops_lock:
                    late = [o for o in self._ops.values() if now - o.started > self.timeout_s]
                for o in late:
                    o.fail(AggregationError(f"round {o.round} key {o.key} of job {self.job} got no result within "
                                            f"{self.timeout_s:g} s", "timeout", o.round))
