"""The aggregation server shell: TCP connections, the elastic pool, timers, MQTT telemetry.

No thread belongs to a connection (aggregator/conns.py).  One poller thread
accepts connections and watches idle ones with epoll; a connection that becomes
readable is read by a pooled worker thread until it has been quiet for
``READ_LINGER_S`` (so a round's chunks stream without a hand-off each), then goes
back to epoll.  Headers and payloads are received straight into pooled buffers
in C (aggregator/sockio.py), one GIL release per message, each within a frame
deadline.  Sends are queued per connection and flushed by a borrowed worker, so
a slow peer never blocks a pool thread.  All state changes go through
:class:`~aggregator.core.AggregationCore` under one lock; the decisions it
returns are carried out here.

Ceilings (README, "Aggregation security"): a connection must complete HELLO within
``hello_timeout_s`` and every frame within ``frame_timeout_s``; connections are capped in
total and per peer address; payload bytes being received are capped in total and per
peer address.

``serve(cfg, stop_event, ready_event)`` runs a server from a config dict (the
``agg`` section) until ``stop_event`` is set; ``python -m aggregator.cli``
(``dlshare agg``) wraps it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from aggregator import kernel
from aggregator.conns import Conn, PeerCounts, RecvBudget, Workers, guard_peer
from aggregator.core import (AggregationCore, ChunkArrived, Close, ConnectionLost, Drain, Reduce, Register,
                             FreeBuffers, Send, Tick)
from aggregator.interleave import RoundOrder
from aggregator.membership import DrainAck
from aggregator.pool import BufferPool, ElasticPool
from aggregator.protocol import (HEADER_SIZE, MsgType, ProtocolError, error, parse_header,
                                 parse_hello)
from aggregator.scheduling import PoolController
from aggregator.settings import ServerSettings, resolve
from aggregator.stages import ServerStages
from aggregator.telemetry import run_telemetry
from aggregator.sockio import IDLE, SOCK_BUF, recv_frame
from nodesvc.bus.ids import stimulus_id

log = logging.getLogger("dlshare.agg")

# A worker keeps reading a connection this long after its last message before handing it back to
# epoll: a round's chunks arrive back to back, and a hand-off per chunk would cost two thread
# wake-ups each.  Between rounds (the compute phase) the connection holds no thread.
READ_LINGER_S = 0.2
CLOSE_DELAY_S = 0.5  # a shut-down descriptor is closed this much later, once no thread can still use it

class _Gone(Exception):
    """The reader ends this connection (after queueing an error, if any)."""

    def __init__(self, orderly: bool = False) -> None:
        self.orderly = orderly


_ARM = select.EPOLLIN | select.EPOLLONESHOT


class AggregationServer:
    def __init__(self, settings: ServerSettings = ServerSettings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``settings``: see :class:`ServerSettings`.  ``clock``: the time of the policy (the core's
        events, hence round and join timeouts, and the hello deadline), which a test may drive by
        hand; the I/O's own pacing (accept back-off, close delay, interleaving) keeps real time."""
        self.settings = st = settings
        self.clock = clock
        self.server_id = st.server_id
        self.send_timeout_s = max(1.0, st.round_timeout_s)
        self.core = AggregationCore(st.server_id, st.round_timeout_s, st.max_job_bytes, require_secret=st.require_secret,
                                    max_jobs_per_peer=st.max_jobs_per_peer)
        self.pool = ElasticPool(PoolController(st.min_cores, st.max_cores, shrink_after_s=st.shrink_after_s),
                                name=st.server_id)
        self.buffers = BufferPool()
        self.stages = ServerStages() if st.trace else None
        self._lock = threading.Lock()
        self._turns = threading.Condition(self._lock)
        self.order = RoundOrder() if st.interleave else None
        self.recv_buffer_bytes = st.recv_buffer_bytes
        self.hello_timeout_s, self.frame_timeout_s = st.hello_timeout_s, st.frame_timeout_s
        self._frame_ms = max(1, int(st.frame_timeout_s * 1000))
        self._linger_ms = int(READ_LINGER_S * 1000)
        self.peers = PeerCounts(st.max_connections, st.max_connections_per_peer)
        self.budget = RecvBudget(st.max_receiving_bytes, st.max_receiving_bytes_per_peer)
        # at most one reader and one sender task per connection: the cap never starves a connection
        self.workers = Workers(st.server_id, 2 * st.max_connections + 2)
        self._tick_s = st.tick_s
        self._stop = threading.Event()
        self._conns: dict[int, Conn] = {}  # by descriptor
        self._unwelcome: set[Conn] = set()  # not yet registered: the hello deadline applies
        self._closing: list[tuple[float, Conn]] = []
        self._closing_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.listener = socket.create_server((st.host, st.port), backlog=128)
        self.listener.setblocking(False)
        self.address = self.listener.getsockname()[:2]
        self._ep = select.epoll()
        self._ep.register(self.listener.fileno(), select.EPOLLIN)
        self._paused_until = 0.0  # accept paused (out of descriptors) until then
        self.refused = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.monotonic()
        self.metrics_port: int | None = None  # where serve() put the Prometheus endpoint

    # --- life cycle ---

    def start(self) -> "AggregationServer":
        self.pool.start()
        for fn, name in ((self._poll_loop, "poll"), (self._tick_loop, "tick")):
            t = threading.Thread(target=fn, name=f"{self.server_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("aggregation server %s listening on %s:%d (pool %d..%d threads, kernel %s)", self.server_id,
                 *self.address, self.pool.controller.min, self.pool.controller.max,
                 "avx2+f16c" if kernel.uses_simd() else "scalar")
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        try:
            self.listener.close()
        except OSError:
            pass
        for c in list(self._conns.values()):
            c.close()
        self.workers.stop()
        self.pool.stop()

    def drain(self) -> None:
        """Move every job's future rounds to the other servers (clients re-route)."""
        self._handle(Drain(stimulus_id("agg"), self.clock()))

    # --- core plumbing ---

    def _handle(self, ev) -> None:
        with self._lock:
            decisions = self.core.handle(ev)
        for d in decisions:
            if isinstance(d, Reduce):
                self.pool.submit(d.job, lambda d=d: self._reduce(d), d.nbytes * len(d.bufs))
            elif isinstance(d, Send):
                d.conn.send(d.data)
            elif isinstance(d, FreeBuffers):
                for b in d.bufs:
                    self.buffers.release(b)
            elif isinstance(d, Close):
                d.conn.close_after_flush()

    def _reduce(self, d: Reduce) -> None:
        dst = d.bufs[0]
        t0 = time.time() if self.stages is not None else 0.0
        kernel.reduce_sum(d.dtype, dst, d.bufs, d.divisor)
        for b in d.bufs[1:]:
            self.buffers.release(b)
        targets = [(r, c) for r, c in enumerate(d.conns) if c is not None and c.alive]
        stages, unit = self.stages, d.result.unit
        if stages is not None:
            stages.summed(d.job, unit, t0, time.time(), len(targets))
        if not targets:
            self.buffers.release(dst)
            return
        remaining = [len(targets)]
        lock = threading.Lock()

        def done(rank: int) -> None:
            if stages is not None:
                stages.sent(d.job, unit, rank)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.buffers.release(dst)

        header = d.result.pack()
        payload = memoryview(dst)
        for r, c in targets:
            self.bytes_out += d.nbytes
            c.send(header, payload, lambda r=r: done(r))

    # --- the poller: accepts, idle connections, deadlines ---

    def _poll_loop(self) -> None:
        lfd = self.listener.fileno()
        while not self._stop.is_set():
            try:
                events = self._ep.poll(0.1)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == lfd:
                    self._accept_some()
                    continue
                conn = self._conns.get(fd)
                if conn is not None:
                    self.workers.submit(lambda c=conn: self._read(c))
            now = time.monotonic()
            if self._paused_until and now >= self._paused_until:
                self._paused_until = 0.0
                self._ep.register(lfd, select.EPOLLIN)
            policy_now = self.clock()
            for conn in [c for c in list(self._unwelcome) if policy_now >= c.hello_deadline]:
                self._unwelcome.discard(conn)
                if not conn.registered:
                    self._kick(conn, "hello_timeout", f"no HELLO accepted within {self.hello_timeout_s:g} s "
                               f"(agg.hello_timeout_s)")
            self._close_due(now)
        self._ep.close()

    def _accept_some(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the listener stays readable, so stop watching it for a while
                    # instead of spinning; the backlog waits in the kernel meanwhile.
                    log.warning("aggregation server %s cannot accept: %s; pausing accepts 0.5 s", self.server_id, exc)
                    self._ep.unregister(self.listener.fileno())
                    self._paused_until = time.monotonic() + 0.5
                    return
                if self._stop.is_set():
                    return
                continue  # ECONNABORTED and the like: that peer is gone
            why = self.peers.admit(addr[0])
            if why is not None:
                self.refused += 1
                try:
                    sock.send(error("too_many_connections", f"connection refused: {why}"), socket.MSG_DONTWAIT)
                except OSError:
                    pass
                sock.close()
                continue
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.recv_buffer_bytes)
            guard_peer(sock, self.send_timeout_s)
            conn = Conn(sock, addr[0], addr[1], self.workers, self.clock() + self.hello_timeout_s)
            self._conns[conn.fd] = conn
            self._unwelcome.add(conn)
            self._ep.register(conn.fd, _ARM)

    def _kick(self, conn: Conn, code: str, msg: str) -> None:
        """End a connection from outside its reader: the shutdown wakes the reader, which cleans up."""
        log.info("closing %s: %s", conn.peer, msg)
        conn.send(error(code, msg))
        conn.close_after_flush()

    def _close_due(self, now: float) -> None:
        with self._closing_lock:
            due = [c for t, c in self._closing if t <= now]
            self._closing = [(t, c) for t, c in self._closing if t > now]
        for conn in due:
            try:
                conn.sock.close()
            except OSError:
                pass

    # --- reading (a borrowed worker thread) ---

    def _read(self, conn: Conn) -> None:
        hbuf = bytearray(HEADER_SIZE)
        hview = memoryview(hbuf)
        wait_ms = 0  # epoll said readable
        try:
            while not self._stop.is_set():
                got = recv_frame(conn.sock, hview, wait_ms, self._frame_ms)
                if got == IDLE:
                    if not conn.alive:
                        raise _Gone()
                    try:
                        self._ep.modify(conn.fd, _ARM)  # quiet: back to epoll, this thread goes
                    except (OSError, ValueError):
                        raise _Gone() from None
                    return
                if not got:
                    raise _Gone()
                self._message(conn, hbuf)
                wait_ms = self._linger_ms
            raise _Gone()
        except _Gone as g:
            self._end(conn, g.orderly)
        except TimeoutError as exc:
            log.info("closing %s: %s", conn.peer, exc)
            conn.send(error("frame_timeout", f"{exc} (agg.frame_timeout_s)"))
            self._end(conn, False)
        except (ConnectionError, OSError) as exc:
            log.debug("connection %s lost: %s", conn.peer, exc)
            self._end(conn, False)
        except Exception:
            log.exception("closing %s after an unexpected error", conn.peer)
            self._end(conn, False)

    def _message(self, conn: Conn, hbuf: bytearray) -> None:
        try:
            h = parse_header(hbuf)
        except ProtocolError as exc:
            log.warning("closing %s: %s", conn.peer, exc)
            conn.send(error("bad_message", str(exc)))
            raise _Gone() from None
        if h.mtype != MsgType.HELLO and not conn.registered:
            # Nothing but HELLO before HELLO: a stranger's payload is never read.
            conn.send(error("bad_message", f"{h.mtype.name} before HELLO"))
            raise _Gone()
        if h.mtype == MsgType.PUSH:
            self._push(conn, h)
            return
        payload = bytearray(h.nbytes)
        if h.nbytes and not recv_frame(conn.sock, memoryview(payload), -1, self._frame_ms):
            raise ConnectionError("peer closed the connection mid-message")
        if h.mtype == MsgType.HELLO:
            try:
                hello = parse_hello(payload)
            except ProtocolError as exc:
                conn.send(error("bad_message", str(exc)))
                raise _Gone() from None
            self._handle(Register(stimulus_id("agg"), self.clock(), conn, hello, conn.ip))
            with self._lock:
                conn.registered = conn in self.core.conn_job
            if conn.registered:
                self._unwelcome.discard(conn)
        elif h.mtype == MsgType.BYE:
            raise _Gone(orderly=True)
        elif h.mtype == MsgType.DRAINED:
            self._handle(DrainAck(stimulus_id("agg"), self.clock(), conn))
        else:
            conn.send(error("bad_message", f"a server does not accept {h.mtype.name} messages"))
            raise _Gone()

    def _push(self, conn: Conn, h) -> None:
        t_hdr = time.time() if self.stages is not None else 0.0
        job = self._take_turn(conn, h)
        try:
            if not self.budget.acquire(conn.ip, h.nbytes, self.frame_timeout_s):
                msg = (f"no room to receive a {h.nbytes}-byte chunk within {self.frame_timeout_s:g} s: "
                       f"{self.budget.used} bytes are being received (agg.max_receiving_bytes"
                       f"{'_per_peer' if self.budget.used + h.nbytes <= self.budget.total else ''})")
                conn.send(error("busy", msg, h.round, h.key, h.chunk))
                raise _Gone()
            try:
                buf = self.buffers.acquire(h.nbytes)
                try:
                    got = recv_frame(conn.sock, memoryview(buf), -1, self._frame_ms)
                except BaseException:
                    self.buffers.release(buf)
                    raise
            finally:
                self.budget.release(conn.ip, h.nbytes)
        finally:
            if job is not None:
                with self._turns:
                    self.order.end(job, conn, time.monotonic())
                    self._turns.notify_all()
        if not got:
            self.buffers.release(buf)
            raise ConnectionError("peer closed the connection mid-message")
        self.bytes_in += h.nbytes
        if self.stages is not None:
            who = self.core.conn_job.get(conn)
            if who is not None:
                self.stages.arrived(who[0], h.unit, h.rank, t_hdr, time.time())
        self._handle(ChunkArrived(stimulus_id("agg"), self.clock(), conn, h, buf))

    def _end(self, conn: Conn, orderly: bool) -> None:
        if conn.ended:
            return
        conn.ended = True
        try:
            self._ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        with self._lock:
            who = self.core.conn_job.get(conn)
        self._handle(ConnectionLost(stimulus_id("agg"), self.clock(), conn, orderly))
        if who is not None and self.order is not None:
            with self._lock:
                if who[0] not in self.core.jobs:
                    self.order.forget(who[0])
        conn.close_after_flush()  # the sender flushes what is queued (an error), shuts the socket down
        self._unwelcome.discard(conn)
        self._conns.pop(conn.fd, None)
        self.peers.leave(conn.ip)
        # the descriptor itself is closed a little later, once no thread can still be using it
        with self._closing_lock:
            self._closing.append((time.monotonic() + CLOSE_DELAY_S, conn))

    def _take_turn(self, conn: Conn, h) -> str | None:
        """Hold this push while another job's earlier round is being received (``interleave``)."""
        if self.order is None:
            return None
        with self._turns:
            who = self.core.conn_job.get(conn)
            if who is None:
                return None
            self.order.note(who[0], h.round, time.monotonic())
            # Waits only while the job ahead is actually receiving: it ends when that round's pushes
            # pause for idle_s (the other job's compute phase, a slow rank), so nothing waits long.
            while not self._stop.is_set() and self.order.ahead(who[0], h.round, time.monotonic()):
                self._turns.wait(self.order.idle_s)
            self.order.begin(who[0], conn, time.monotonic())
        return who[0]

    def _tick_loop(self) -> None:
        last_obs = 0.0
        while not self._stop.wait(self._tick_s):
            self._handle(Tick(stimulus_id("agg"), self.clock()))
            now = time.monotonic()
            if now - last_obs >= 0.25:
                self.pool.observe(now)
                last_obs = now

    # --- telemetry ---

    def stats(self) -> dict[str, Any]:
        s = self.pool.last_sample
        now = time.monotonic()
        held = self.pool.held_core_seconds(now)  # the same instant as uptime_s, so their ratio is exact
        with self._lock:
            jobs = self.core.summary()
            draining = self.core.draining
            drain = {"pending_units": self.core.pending_units(), "ranks_left": self.core.drain_ranks_left(),
                     "moved": self.core.moved()} if draining else None
        return {
            "server": self.server_id,
            "address": f"{self.address[0]}:{self.address[1]}",
            "pool": {"size": self.pool.size, "min": self.pool.controller.min, "max": self.pool.controller.max,
                     "busy_fraction": round(s.busy_fraction, 4) if s else 0.0,
                     "demand_cores": round(s.demand_cores, 4) if s else 0.0,
                     "busy_seconds": round(self.pool.busy_seconds, 4), "queued": len(self.pool.queue),
                     "held_core_seconds": held,
                     "cores_avg": round(held / max(1e-9, now - self.started), 4)},
            "jobs": jobs,
            "uptime_s": now - self.started,
            "connections": len(self._conns),
            "refused_connections": self.refused,
            "io_threads": self.workers.live,
            "receiving_bytes": self.budget.used,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "draining": draining,
            "drain": drain,
            "kernel": "avx2+f16c" if kernel.uses_simd() else "scalar",
        }


def serve(cfg: dict[str, dict[str, Any]], stop_event: threading.Event,
          ready_event: threading.Event | None = None) -> AggregationServer:
    """Run an aggregation server from config until ``stop_event`` is set.

    ``cfg["agg"]``: listen, id, min_cores, max_cores (0: all CPUs), round_timeout_s, telemetry_interval_s,
    max_job_bytes, interleave, recv_buffer_bytes, require_secret, hello_timeout_s, frame_timeout_s,
    max_connections, max_connections_per_peer, max_receiving_bytes, max_receiving_bytes_per_peer, max_jobs_per_peer,
    trace_file (write every chunk's stage times there, as JSON, when the server stops);
    ``cfg["dlshare"]["broker"]``: MQTT broker URL ("" for none).
    """
    cfg = resolve(cfg)
    a = cfg["agg"]
    server = AggregationServer(ServerSettings.from_config(cfg))
    # Metrics first (their import opens files): once the server accepts, a flood of connections may
    # take every descriptor the process has, and an import then would kill the server.
    metrics = None
    mhost, _, mport = str(a["metrics_listen"]).rpartition(":")
    if int(mport) >= 0:
        from aggregator.metrics import AggregationMetrics

        metrics = AggregationMetrics(server)
        try:
            server.metrics_port = metrics.serve(mhost or "127.0.0.1", int(mport))
            log.info("metrics on http://%s:%d/metrics", mhost or "127.0.0.1", server.metrics_port)
        except OSError as exc:
            log.warning("cannot serve metrics on %s (agg.metrics_listen): %s", a["metrics_listen"], exc)
            metrics = None
    server.start()
    broker = cfg.get("dlshare", {}).get("broker", "")
    loop_thread = None
    astop: list = []
    if broker:
        def run_bus() -> None:
            async def main() -> None:
                ev = asyncio.Event()
                astop.append((asyncio.get_running_loop(), ev))
                await run_telemetry(server, broker, float(a["telemetry_interval_s"]), ev)
            asyncio.run(main())

        loop_thread = threading.Thread(target=run_bus, name="agg-mqtt", daemon=True)
        loop_thread.start()
    if ready_event is not None:
        ready_event.set()
    try:
        # Poll: a signal delivered to another thread only runs its Python handler when the main
        # thread next runs bytecode, which a plain wait() would never do.
        while not stop_event.wait(0.2):
            pass
    finally:
        if astop:
            loop, ev = astop[0]
            loop.call_soon_threadsafe(ev.set)
        if loop_thread:
            loop_thread.join(timeout=5)
        if metrics is not None:
            metrics.close()
        server.stop()
        if a["trace_file"] and server.stages is not None:
            with open(a["trace_file"], "w") as f:
                json.dump({"server": server.server_id, "units": server.stages.records()}, f)
    return server
