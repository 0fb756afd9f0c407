"""One client's connection to one aggregation server: join, send, receive, and loss.

A link is ``new`` until its first connection attempt, ``joining`` from its
HELLO until the server's JOINED (aggregator/membership.py explains the
barrier), ``up`` while joined, and ``down`` after a failure, when the client
probes it again with back-off.  Each connection has a reader thread and a
sender thread with its own queue, so a slow server never holds up the chunks
bound for the others.  Every field is guarded by the client's condition
variable (``client.cond``); the threads call back into the client for
anything that crosses links (a loss, a result, a redirect).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Protocol

from aggregator import kernel
from aggregator.inflight import AggregationError, CopyPool, Unit
from aggregator.protocol import (HEADER_SIZE, Header, MsgType, ProtocolError, data_header, hello, parse_body,
                                 parse_header, parse_round_body)
from aggregator.sockio import SOCK_BUF, recv_exact, send_all
from nodesvc.bus.procs import split_hostport

log = logging.getLogger("dlshare.agg.client")

NEW, DOWN, JOINING, UP = "new", "down", "joining", "up"
ALL = 0xFFFFFFFF  # key/chunk of a message that covers a whole round (as aggregator.core.ALL)
PROBE_MIN_S, PROBE_MAX_S = 0.25, 2.0  # back-off between attempts to reach a server that is down
STALL_S = 0.5  # a push window with no answer for this long opens anyway (ServerLink._wait_window)


def _recv_timed(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the server closed the connection at HELLO")
        got += k
    return buf


def _read(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n and not recv_exact(sock, memoryview(buf)):
        raise ConnectionError("server closed the connection")
    return buf


class LinkOwner(Protocol):
    """What a link reads of the client that owns it, and the five ways it calls back into it
    (:class:`aggregator.client.Client` is one)."""

    # who this rank is, and what it says at HELLO
    job: str
    rank: int
    world: int
    secret: str | None
    layout: Any  # the job's key layout, or None
    next_round: int
    # settings
    connect_timeout_s: float
    timeout_s: float
    window_chunks: int
    # shared state, guarded by ``cond`` (over ``lock``)
    lock: Any
    cond: threading.Condition
    closed: bool
    window_from: int
    copies: CopyPool

    def link_lost(self, link: "ServerLink", sock: Any, why: str, reader: bool = False) -> None: ...
    def keep_copy(self, link: "ServerLink", u: Unit) -> None: ...
    def unit_answered(self, link: "ServerLink", u: Unit) -> None: ...
    def server_error(self, link: "ServerLink", h: Header, code: str, message: str) -> None: ...
    def redirected(self, link: "ServerLink", h: Header, from_round: int) -> None: ...


class ServerLink:
    def __init__(self, client: LinkOwner, addr: str) -> None:
        """``client``: what owns this link (:class:`LinkOwner`; the client)."""
        self.client = client
        self.addr = addr
        self.state = NEW
        self.sock: socket.socket | None = None
        self.handle = 0
        self.hello_round: int | None = None  # while joining: rounds from here wait for the answer
        self.joined_from: int | None = None
        self.drain_from: int | None = None
        self.drain_acked = False
        self.units: dict[tuple[int, int, int], Unit] = {}  # sent or queued here, kept for failover
        self.queue: queue.SimpleQueue | None = None
        self.why = ""  # the last failure, for error messages
        self.why_code = "unreachable"
        self.next_probe = 0.0
        self.backoff = PROBE_MIN_S
        self.connecting = False
        self.sender: threading.Thread | None = None
        self.bytes_sent = 0  # chunk payload bytes pushed here, over all connections
        # The push window: units pushed on the current connection and not yet answered.
        self.inflight: set[tuple[int, int, int]] = set()
        self.last_answer = 0.0  # monotonic time of the last answer on the current connection
        self.credit = threading.Condition(client.lock)

    def __repr__(self) -> str:
        return f"<link {self.addr} {self.state}>"

    def usable(self, rnd: int) -> bool:
        return (self.state == UP and self.joined_from is not None and rnd >= self.joined_from
                and (self.drain_from is None or rnd < self.drain_from))

    # --- joining (runs in its own short-lived thread, or the caller's for ensure()) ---

    def ensure(self) -> socket.socket | None:
        """Connect and say HELLO now unless connected; returns the socket (tests and tools)."""
        with self.client.cond:
            if self.sock is not None:
                return self.sock
            if self.connecting:
                busy = True
            else:
                busy, self.connecting = False, True
        if not busy:
            self.join(self.client.connect_timeout_s)
        return self.sock

    def join(self, retry_s: float) -> None:
        """One attempt (retrying the TCP connect for ``retry_s``) to connect and say HELLO."""
        c = self.client
        try:
            sock = self._connect(retry_s)
        except OSError as exc:
            self._failed(f"cannot reach aggregation server {self.addr}: {exc}", "unreachable")
            return
        with c.cond:
            if c.closed:
                sock.close()
                self.connecting = False
                return
            # From here this rank starts no round >= next_round until the server answers.
            self.state, self.hello_round = JOINING, c.next_round
            nxt = c.next_round
        try:
            h, body = self._handshake(sock, nxt)
            if h.mtype == MsgType.ERROR:
                raise AggregationError(f"server {self.addr} refused job {c.job} rank {c.rank}: "
                                       f"{body.get('message')}", str(body.get("code", "error")))
            if h.mtype != MsgType.WELCOME:
                raise AggregationError(f"server {self.addr} answered HELLO with {h.mtype.name}", "bad_message")
            try:
                handle = int(body["job_handle"])
            except (KeyError, TypeError, ValueError):
                raise AggregationError(f"server {self.addr} sent a WELCOME without a job handle",
                                       "bad_message") from None
        except AggregationError as exc:
            sock.close()
            self._failed(str(exc), exc.code)
            return
        except (OSError, ConnectionError, ProtocolError) as exc:
            sock.close()
            self._failed(f"handshake with aggregation server {self.addr} failed: {exc}", "unreachable")
            return
        sock.settimeout(None)
        q: queue.SimpleQueue = queue.SimpleQueue()
        with c.cond:
            self.sock, self.handle, self.queue = sock, handle, q
            self.drain_from, self.drain_acked, self.connecting = None, False, False
            c.cond.notify_all()
        self.sender = threading.Thread(target=self._send_loop, args=(sock, q), name=f"agg-send-{self.addr}",
                                       daemon=True)
        self.sender.start()
        threading.Thread(target=self._read_loop, args=(sock,), name=f"agg-recv-{self.addr}", daemon=True).start()

    def _failed(self, why: str, code: str) -> None:
        c = self.client
        with c.cond:
            self.state, self.hello_round, self.joined_from, self.connecting = DOWN, None, None, False
            self.why, self.why_code = why, code
            self.next_probe = time.monotonic() + self.backoff
            self.backoff = min(PROBE_MAX_S, self.backoff * 2)
            c.cond.notify_all()
        log.debug("%s", why)

    def _connect(self, retry_s: float) -> socket.socket:
        host, port = split_hostport(self.addr, 7700)
        deadline = time.monotonic() + retry_s
        delay = 0.05
        while True:
            try:
                return socket.create_connection((host, port), timeout=max(1.0, min(retry_s, 5.0)))
            except OSError:
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _handshake(self, sock: socket.socket, next_round: int):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        # A server host that dies without a reset is found by keepalive and by the unacknowledged-data timeout.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.client.timeout_s * 1000))
        c = self.client
        sock.sendall(hello(c.job, c.rank, c.world, c.layout, next_round, c.secret))
        # plain socket calls here: the socket still has its connect timeout (non-blocking underneath)
        h = parse_header(_recv_timed(sock, HEADER_SIZE))
        return h, parse_body(_recv_timed(sock, h.nbytes))

    # --- sending ---

    def put(self, unit: Unit) -> None:
        """Queue ``unit`` here (caller holds the client's lock and checked :meth:`usable`)."""
        self.units[unit.uid] = unit
        unit.server = self.addr
        assert self.queue is not None
        self.queue.put(unit)

    def answered(self, uids: list | None, rnd: int | None = None) -> None:
        """(lock held) The server answered these pushes (``None``: every push of round ``rnd``)."""
        if uids is None:
            self.inflight = {u for u in self.inflight if u[0] != rnd}
        else:
            self.inflight.difference_update(uids)
        self.last_answer = time.monotonic()
        if len(self.inflight) <= self._refill_at():
            self.credit.notify()

    def _refill_at(self) -> int:
        """A full window waits until half of it is answered, so its sender wakes once per half window."""
        w = self.client.window_chunks
        return w - max(1, w // 2)

    def _wait_window(self, sock: socket.socket) -> None:
        """(lock held) Wait until fewer than the window's chunks are unanswered on ``sock``.

        Without a window each connection runs as far ahead as its socket buffers let it, and TCP
        shares a server's link unevenly between the ranks pushing to it: the fastest rank's chunks
        wait at the server for the slowest rank's, and the round ends when the slowest connection
        does, with the others idle (measured: ranks 250 ms apart at one server, the 4 MiB of a
        socket buffer at a quarter of a 500 Mbit/s link).  With at most ``window_chunks`` chunks
        unanswered, a rank ahead at one server waits for its answers, and its link carries its
        chunks for the other servers meanwhile, so every connection to a server moves in step.
        A full window refills once half of it is answered: one wake-up of the sender per half window.

        Ranks push to a server in the same order (the client's contract), so the chunk every
        rank has pushed is answered and the window always reopens.  Chunks pushed again after a
        server was lost or redirected go out in orders that differ between ranks, so the rounds in
        flight then push without a window (``client.window_from``).  As a safety valve for any
        other order that differs (a client that breaks the contract), a window with no answer for
        ``STALL_S`` opens anyway."""
        c = self.client
        w = c.window_chunks
        if not w or len(self.inflight) < w:
            return
        low = self._refill_at()
        while self.sock is sock and not c.closed and time.monotonic() - self.last_answer < STALL_S:
            units = self.units
            # units answered or given up since (an op that failed, a result nobody reads) free their place
            self.inflight = {uid for uid in self.inflight
                             if (u := units.get(uid)) is not None and not u.done and u.needed()}
            if len(self.inflight) <= low:
                return
            self.credit.wait(STALL_S)

    def put_control(self, data: bytes) -> None:
        if self.queue is not None:
            self.queue.put(data)

    def _send_loop(self, sock: socket.socket, q: queue.SimpleQueue) -> None:
        c = self.client
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, bytes):
                payload = None
                hdr = item
            else:
                u: Unit = item
                with c.cond:
                    if self.sock is not sock or self.units.get(u.uid) is not u:
                        continue
                    windowed = u.op.round >= c.window_from
                    if windowed:
                        if not self.inflight:
                            self.last_answer = time.monotonic()  # the window's stall clock starts with its first push
                        self._wait_window(sock)
                        if self.sock is not sock or self.units.get(u.uid) is not u:
                            continue
                    if not u.needed():
                        del self.units[u.uid]
                        continue
                    if windowed:
                        self.inflight.add(u.uid)
                c.keep_copy(self, u)
                o = u.op
                if o.wire is not None and u.copy is None:
                    continue  # its narrowed copy was not taken: the unit left this link meanwhile
                hdr = data_header(MsgType.PUSH, o.wire_dtype, o.op, self.handle, c.rank, c.world, o.round, o.key,
                                  u.chunk, o.nchunks, u.nbytes, u.numel).pack()
                payload = u.payload()
                if u.times is not None:
                    u.times[0] = time.time()
            try:
                send_all(sock, hdr, payload)
                if payload is not None:
                    self.bytes_sent += len(payload)
                    if u.times is not None:
                        u.times[1] = time.time()
            except OSError as exc:
                c.link_lost(self, sock, f"lost connection to aggregation server {self.addr}: {exc}")
                return

    # --- receiving ---

    def _read_loop(self, sock: socket.socket) -> None:
        c = self.client
        hb = bytearray(HEADER_SIZE)
        hv = memoryview(hb)
        why = f"aggregation server {self.addr} closed the connection"
        try:
            while True:
                if not recv_exact(sock, hv):
                    break
                h = parse_header(hb)
                if h.mtype == MsgType.RESULT:
                    self._result(sock, h)
                elif h.mtype == MsgType.ERROR:
                    body = parse_body(_read(sock, h.nbytes))
                    code, msg = str(body.get("code", "error")), str(body.get("message", ""))
                    if code == "join_timeout":
                        why = msg
                        with c.cond:
                            self.why_code = code
                    else:
                        c.server_error(self, h, code, msg)
                elif h.mtype == MsgType.JOINED:
                    start = parse_round_body(_read(sock, h.nbytes))
                    with c.cond:
                        if self.sock is sock and self.state == JOINING:
                            self.state, self.joined_from, self.hello_round = UP, start, None
                            self.backoff = PROBE_MIN_S
                            c.cond.notify_all()
                elif h.mtype == MsgType.REDIRECT:
                    c.redirected(self, h, parse_round_body(_read(sock, h.nbytes)))
                else:
                    _read(sock, h.nbytes)
        except (OSError, ConnectionError, ProtocolError, ValueError, KeyError) as exc:
            why = f"lost connection to aggregation server {self.addr}: {exc}"
        c.link_lost(self, sock, why, reader=True)

    def _result(self, sock: socket.socket, h: Header) -> None:
        c = self.client
        with c.cond:
            u = self.units.get(h.unit) if self.sock is sock else None
            use = u is not None and not u.done and u.nbytes == h.nbytes and not u.contrib and not u.op.done
            if self.sock is sock:
                self.answered([h.unit])
        if not use:
            _read(sock, h.nbytes)  # a result nobody here waits for: a contribution, or a failed round
            if u is not None and u.nbytes == h.nbytes:
                c.unit_answered(self, u)
            return
        assert u is not None
        if u.times is not None:
            u.times[2] = time.time()
        wire = u.op.wire
        if wire is None:
            if not recv_exact(sock, u.local()):
                raise ConnectionError("server closed the connection mid-result")
        else:  # a compressed result: in 16 bits, widened into the caller's tensor at once
            stage = c.copies.empty(h.nbytes)
            try:
                if not recv_exact(sock, memoryview(stage)):
                    raise ConnectionError("server closed the connection mid-result")
                kernel.convert(u.op.dtype, u.local(), wire, stage)
            finally:
                c.copies.give(stage)
        if u.times is not None:
            u.times[3] = time.time()
        c.unit_answered(self, u)
        u.op.chunk_done()

    def close(self) -> None:
        """Say BYE after what is queued, then stop (called once, by Client.close)."""
        with self.client.cond:
            sock, q, sender = self.sock, self.queue, self.sender
        if sock is None or q is None:
            return
        q.put(Header(MsgType.BYE).pack())
        q.put(None)
        if sender is not None:
            sender.join(timeout=5)
        self.client.link_lost(self, sock, "client closed")
