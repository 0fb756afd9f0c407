"""``aggregator.Client``: all-reduce numpy arrays and torch tensors through aggregation servers.

A tensor is split into chunks (4 MiB by default); chunk ``(key, c)`` goes to
the server its consistent hash picks, so several servers share the key space.
Chunks are pipelined: all are sent before any result is awaited, and results
are received straight into the caller's buffer (reductions are in place, like
``torch.distributed.all_reduce``).

Faults: a lost server fails the rounds in flight on it with
:class:`AggregationError` and is reconnected on next use, so a job goes on
from its next round after a server restart.  A server's ERROR (a peer died,
a timeout, a shape/dtype mismatch) fails that round with the server's text.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aggregator.core import ALL
from aggregator.protocol import (HEADER_SIZE, DType, MsgType, Op, ProtocolError, data_header, hello,
                                 parse_body, parse_header)
from aggregator.sockio import SOCK_BUF, recv_exact, send_all
from nodesvc.bus.procs import split_hostport

log = logging.getLogger("dlshare.agg.client")

DEFAULT_CHUNK_BYTES = 4 << 20
VNODES = 64  # virtual nodes per server on the hash ring: spreads keys evenly over few servers


class AggregationError(RuntimeError):
    """A round that could not complete; the message says why (from the server when it knows)."""

    def __init__(self, message: str, code: str = "error", round: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.round = round


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class HashRing:
    """Consistent hashing of (job, key, chunk) onto servers; skips servers draining for a round."""

    def __init__(self, servers: list[str]) -> None:
        if not servers:
            raise ValueError("need at least one aggregation server")
        self.servers = list(dict.fromkeys(servers))
        pts = sorted((_h64(f"{s}#{i}"), s) for s in self.servers for i in range(VNODES))
        self._hashes = [p[0] for p in pts]
        self._owners = [p[1] for p in pts]

    def route(self, item: str, skip: set[str] = frozenset()) -> str:
        if len(skip) >= len(self.servers):
            raise AggregationError(f"every aggregation server ({', '.join(self.servers)}) is draining", "draining")
        i = bisect.bisect(self._hashes, _h64(item)) % len(self._hashes)
        while self._owners[i] in skip:
            i = (i + 1) % len(self._hashes)
        return self._owners[i]


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


@dataclass
class _Op:
    target: Any
    data: np.ndarray  # uint8 view of target
    dtype: DType
    op: Op
    round: int
    key: int
    nchunks: int
    numel: int
    future: Future
    started: float
    left: int = 0
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: AggregationError) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        self.future.set_exception(exc)

    def chunk_done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left or self.done:
                return
            self.done = True
        self.future.set_result(self.target)


def _recv_timed(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the server closed the connection at HELLO")
        got += k
    return buf


class _ServerLink:
    """One TCP connection to one server, re-established on demand."""

    def __init__(self, client: "Client", addr: str) -> None:
        self.client = client
        self.addr = addr
        self.sock: socket.socket | None = None
        self.handle = 0
        self.drain_from: int | None = None
        self.pending: dict[tuple[int, int, int], tuple[_Op, int, int]] = {}  # unit -> (op, offset, nbytes)
        self.lock = threading.Lock()
        self.gen = 0

    def ensure(self) -> socket.socket:
        if self.sock is not None:
            return self.sock
        host, port = split_hostport(self.addr, 7700)
        deadline = time.monotonic() + self.client.connect_timeout_s
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=self.client.connect_timeout_s)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise AggregationError(f"cannot reach aggregation server {self.addr}: {exc}", "unreachable")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        try:
            h, body = self._handshake(sock)
        except (OSError, ConnectionError, ProtocolError) as exc:
            sock.close()
            raise AggregationError(f"handshake with aggregation server {self.addr} failed: {exc}",
                                   "unreachable") from None
        c = self.client
        if h.mtype == MsgType.ERROR:
            sock.close()
            raise AggregationError(f"server {self.addr} refused job {c.job} rank {c.rank}: {body.get('message')}",
                                   str(body.get("code", "error")))
        if h.mtype != MsgType.WELCOME:
            sock.close()
            raise AggregationError(f"server {self.addr} answered HELLO with {h.mtype.name}", "bad_message")
        sock.settimeout(None)
        try:
            self.handle = int(body["job_handle"])
        except (KeyError, TypeError, ValueError):
            sock.close()
            raise AggregationError(f"server {self.addr} sent a WELCOME without a job handle", "bad_message") from None
        self.sock = sock
        self.gen += 1
        threading.Thread(target=self._reader, args=(sock, self.gen), name=f"agg-client-{self.addr}",
                         daemon=True).start()
        return sock

    def _handshake(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        c = self.client
        sock.sendall(hello(c.job, c.rank, c.world, c.layout))
        # plain socket calls here: the socket still has its connect timeout (non-blocking underneath)
        h = parse_header(_recv_timed(sock, HEADER_SIZE))
        return h, parse_body(_recv_timed(sock, h.nbytes))

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        if n and not recv_exact(sock, memoryview(buf)):
            raise ConnectionError("server closed the connection")
        return buf

    def send_chunk(self, op: _Op, chunk: int, offset: int, nbytes: int) -> None:
        sock = self.ensure()
        c = self.client
        h = data_header(MsgType.PUSH, op.dtype, op.op, self.handle, c.rank, c.world, op.round, op.key, chunk,
                        op.nchunks, nbytes, op.numel)
        with self.lock:
            self.pending[(op.round, op.key, chunk)] = (op, offset, nbytes)
        try:
            send_all(sock, h.pack(), memoryview(op.data)[offset:offset + nbytes])
        except OSError as exc:
            self._lost(sock, f"lost connection to aggregation server {self.addr} while pushing round {op.round}: "
                             f"{exc}")
            raise AggregationError(f"lost connection to aggregation server {self.addr}: {exc}", "server_lost",
                                   op.round) from None

    def _lost(self, sock: socket.socket, why: str, reader: bool = False) -> None:
        """Forget ``sock`` and fail what was in flight on it.  Only its reader thread closes the
        descriptor (others shut it down, which wakes the reader), so a descriptor number is never
        reused while a thread may still read from it."""
        with self.lock:
            if self.sock is sock:
                self.sock = None
            pend, self.pending = self.pending, {}
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if reader:
            sock.close()
        for op, _, _ in pend.values():
            op.fail(AggregationError(why, "server_lost", op.round))

    def _reader(self, sock: socket.socket, gen: int) -> None:
        hb = bytearray(HEADER_SIZE)
        hv = memoryview(hb)
        why = f"aggregation server {self.addr} closed the connection"
        try:
            while True:
                if not recv_exact(sock, hv):
                    break
                h = parse_header(hb)
                if h.mtype == MsgType.RESULT:
                    with self.lock:
                        ent = self.pending.pop(h.unit, None)
                    if ent is None or ent[2] != h.nbytes or ent[0].done:
                        self._read(sock, h.nbytes)  # a result nobody waits for any more
                        continue
                    op, off, n = ent
                    if not recv_exact(sock, memoryview(op.data)[off:off + n]):
                        raise ConnectionError("server closed the connection mid-result")
                    op.chunk_done()
                elif h.mtype == MsgType.ERROR:
                    body = parse_body(self._read(sock, h.nbytes))
                    self._error(h, str(body.get("code", "error")), str(body.get("message", "")))
                elif h.mtype == MsgType.REDIRECT:
                    body = parse_body(self._read(sock, h.nbytes))
                    self.drain_from = int(body["from_round"])
                    if h.key != ALL:
                        with self.lock:
                            ent = self.pending.pop(h.unit, None)
                        if ent is not None:
                            self.client._resend(ent[0], h.chunk, ent[1], ent[2])
                else:
                    self._read(sock, h.nbytes)
        except (OSError, ConnectionError, ProtocolError, ValueError, KeyError) as exc:
            why = f"lost connection to aggregation server {self.addr}: {exc}"
        self._lost(sock, why + " (round in flight failed; the next round reconnects)", reader=True)

    def _error(self, h, code: str, message: str) -> None:
        with self.lock:
            if h.key == ALL:
                hit = [u for u in self.pending if u[0] == h.round]
            else:
                hit = [h.unit] if h.unit in self.pending else []
            ents = [self.pending.pop(u) for u in hit]
        exc = AggregationError(f"round {h.round} failed: {message}", code, h.round)
        for op, _, _ in ents:
            op.fail(exc)
        self.client._fail_round(h.round, exc)

    def close(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            from aggregator.protocol import Header

            sock.sendall(Header(MsgType.BYE).pack())
        except OSError:
            pass
        self._lost(sock, "client closed")


class Client:
    """All-reduce through aggregation servers.

    ``servers``: ``"host:port"`` strings (or one string).  ``job``: the job id
    shared by all ranks; ``rank`` in ``0..world-1``.  ``timeout_s`` bounds a
    round on this side (the server fails a round after its own
    ``round_timeout_s``).  Every rank must call ``allreduce`` in the same order
    with tensors of the same shape and dtype.  ``layout`` (optional,
    ``{key: tensor}`` or ``{key: (elements, "float32")}``) registers the job's
    keys: a rank registering a different layout is refused, and a tensor that
    does not fit its key is refused before anything is sent.  Without it, each
    key is checked across ranks within its round (what DDP's changing buckets need).
    """

    def __init__(self, servers: list[str] | str, job: str, rank: int, world: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, layout: dict[int, Any] | None = None) -> None:
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world size {world}")
        if chunk_bytes <= 0 or chunk_bytes % 4:
            raise ValueError("chunk_bytes must be a positive multiple of 4")
        self.job, self.rank, self.world = job, rank, world
        self.layout = None if layout is None else make_layout(layout)
        self._layout = None if self.layout is None else {k: (n, dt) for k, n, dt in self.layout}
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.ring = HashRing(list(servers))
        self.links = {s: _ServerLink(self, s) for s in self.ring.servers}
        self._round = itertools.count()
        self._ops: dict[int, _Op] = {}
        self._ops_lock = threading.Lock()
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="agg-client-send", daemon=True)
        self._sender.start()
        self._watch = threading.Thread(target=self._watchdog, name="agg-client-watchdog", daemon=True)
        self._watch.start()

    # --- public ---

    def allreduce(self, x: Any, op: str = "mean", key: int = 0, round: int | None = None) -> Any:
        """Reduce ``x`` in place across the job's ranks and return it."""
        fut = self.allreduce_async(x, op, key, round)
        return fut.result(timeout=self.timeout_s + 5.0)

    def allreduce_async(self, x: Any, op: str = "mean", key: int = 0, round: int | None = None) -> Future:
        """Start reducing ``x`` in place; the Future resolves to ``x``."""
        if self._closed:
            raise AggregationError("client is closed", "closed")
        try:
            o = Op[op.upper()]
        except KeyError:
            raise ValueError(f"op must be 'sum' or 'mean', not {op!r}") from None
        data, dtype = as_bytes(x)
        if self._layout is not None:
            want = self._layout.get(key)
            have = (data.nbytes // dtype.itemsize, int(dtype))
            if want != have:
                exp = "not in the layout" if want is None else f"{want[0]} {DType(want[1]).label} elements"
                raise ValueError(f"key {key} has {have[0]} {dtype.label} elements; the job's layout says {exp}")
        rnd = next(self._round) if round is None else int(round)
        fut: Future = Future()
        nbytes = data.nbytes
        if nbytes == 0:
            fut.set_result(x)
            return fut
        nchunks = -(-nbytes // self.chunk_bytes)
        opr = _Op(x, data, dtype, o, rnd, key, nchunks, nbytes // dtype.itemsize, fut, time.monotonic(),
                  left=nchunks)
        with self._ops_lock:
            self._ops[id(opr)] = opr
        fut.add_done_callback(lambda _f, k=id(opr): self._forget(k))
        self._sendq.put(opr)
        return fut

    def close(self) -> None:
        self._closed = True
        self._sendq.put(None)
        self._sender.join(timeout=5)
        for link in self.links.values():
            link.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- internals ---

    def _forget(self, k: int) -> None:
        with self._ops_lock:
            self._ops.pop(k, None)

    def _route(self, opr: _Op, chunk: int) -> _ServerLink:
        skip = {s for s, link in self.links.items() if link.drain_from is not None and opr.round >= link.drain_from}
        return self.links[self.ring.route(f"{self.job}/{opr.key}/{chunk}", skip)]

    def _send_loop(self) -> None:
        while True:
            item = self._sendq.get()
            if item is None:
                return
            if isinstance(item, tuple):  # a redirected chunk
                opr, chunk, off, n = item
                self._push(opr, chunk, off, n)
                continue
            opr = item
            for chunk in range(opr.nchunks):
                if opr.done:
                    break
                off = chunk * self.chunk_bytes
                if not self._push(opr, chunk, off, min(self.chunk_bytes, opr.data.nbytes - off)):
                    break

    def _push(self, opr: _Op, chunk: int, off: int, n: int) -> bool:
        try:
            self._route(opr, chunk).send_chunk(opr, chunk, off, n)
            return True
        except AggregationError as exc:
            opr.fail(exc)
            return False
        except Exception as exc:  # the sender thread must live on; the caller gets the error
            log.exception("push of round %d key %d chunk %d failed", opr.round, opr.key, chunk)
            opr.fail(AggregationError(f"push of round {opr.round} failed: {exc!r}", "error", opr.round))
            return False

    def _resend(self, opr: _Op, chunk: int, off: int, n: int) -> None:
        self._sendq.put((opr, chunk, off, n))

    def _fail_round(self, rnd: int, exc: AggregationError) -> None:
        with self._ops_lock:
            ops = [o for o in self._ops.values() if o.round == rnd]
        for o in ops:
            o.fail(exc)

    def _watchdog(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            now = time.monotonic()
            with self._ops_lock:
                late = [o for o in self._ops.values() if now - o.started > self.timeout_s]
            for o in late:
                o.fail(AggregationError(f"round {o.round} key {o.key} of job {self.job} got no result within "
                                        f"{self.timeout_s:g} s", "timeout", o.round))
