"""The aggregation server shell: TCP connections, the elastic pool, timers, MQTT telemetry.

Each connection has a reader thread that receives headers and payloads straight
into pooled buffers, and a sender thread with a queue, so a slow peer never
blocks a pool thread.  Both move whole messages in C (aggregator/sockio.py), one
GIL release per message.  All
state changes go through :class:`~aggregator.core.AggregationCore` under one
lock; the decisions it returns are carried out here.

``serve(cfg, stop_event, ready_event)`` runs a server from a config dict (the
``agg`` section) until ``stop_event`` is set; ``python -m aggregator.cli``
(``dlshare agg``) wraps it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import logging
import queue
import socket
import struct
import threading
import time
from typing import Any

from aggregator import kernel
from aggregator.core import (DEFAULT_MAX_JOB_BYTES, AggregationCore, ChunkArrived, Close, ConnectionLost, Drain, Reduce, Register,
                             Release, Send, Tick)
from aggregator.interleave import RoundOrder
from aggregator.membership import DrainAck
from aggregator.pool import BufferPool, ElasticPool
from aggregator.protocol import (HEADER_SIZE, MsgType, ProtocolError, error, parse_header, parse_hello)
from aggregator.scheduling import PoolController
from aggregator.sockio import SOCK_BUF, recv_exact, send_all
from nodesvc.bus import config
from nodesvc.bus.procs import split_hostport

log = logging.getLogger("dlshare.agg")

# Per-connection receive buffer.  A held-back job (``interleave``) can still push this much per
# connection; 256 KiB keeps that small next to a round and still fills a 10 Gbit/s link at
# 200 us RTT from a single connection (raise it for long fat networks).
RECV_BUF = 256 << 10

config.register_section("agg", {
    "listen": "127.0.0.1:7700",
    "id": "agg0",
    "min_cores": 1,
    "max_cores": 0,  # 0: every CPU of the machine
    "round_timeout_s": 30.0,
    "telemetry_interval_s": 2.0,
    "max_job_bytes": 4 << 30,  # unfinished reductions one job may hold in server memory
    "interleave": True,  # overlapping rounds of different jobs are read first come, first served
    "recv_buffer_bytes": RECV_BUF,  # per connection; bounds what a held-back job pushes meanwhile
})


def resolve(cfg: dict) -> dict:
    """Fill derived values (max_cores 0 -> CPU count) and check the section."""
    a = dict(cfg["agg"])
    if a["max_cores"] <= 0:
        a["max_cores"] = max(a["min_cores"], os.cpu_count() or 1)
    if not 1 <= a["min_cores"] <= a["max_cores"]:
        raise config.ConfigError(f"agg.min_cores ({a['min_cores']}) must be 1..max_cores ({a['max_cores']})")
    if a["max_job_bytes"] <= 0:
        raise config.ConfigError("agg.max_job_bytes must be positive")
    if a["round_timeout_s"] <= 0:
        raise config.ConfigError("agg.round_timeout_s must be positive")
    if not 4096 <= a["recv_buffer_bytes"] <= 1 << 30:
        raise config.ConfigError("agg.recv_buffer_bytes must be 4096..1073741824")
    return {**cfg, "agg": a}


class _Conn:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.outq: queue.SimpleQueue = queue.SimpleQueue()
        self.alive = True
        self.bye = False

    def __repr__(self) -> str:
        return f"<conn {self.peer}>"

    def send(self, header: bytes, payload: memoryview | None = None, done=None) -> None:
        if not self.alive:
            if done:
                done()
            return
        self.outq.put((header, payload, done))

    def sender(self) -> None:
        while True:
            item = self.outq.get()
            if item is None:
                break
            if item == "close":
                self.close()
                continue
            header, payload, done = item
            try:
                if self.alive:
                    send_all(self.sock, header, payload)
            except OSError:
                self.close()
            finally:
                if done:
                    done()
        # drain what is left so that every buffer goes back to the pool
        while True:
            try:
                item = self.outq.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple) and item[2]:
                item[2]()

    def close_after_flush(self) -> None:
        """Close once what is queued (typically an error message) has been sent."""
        self.outq.put("close")

    def close(self) -> None:
        if self.alive:
            self.alive = False
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _guard_peer(sock: socket.socket, send_timeout_s: float) -> None:
    """A peer that stops reading must not pin the server: a send that blocks this long fails,
    which closes the connection and fails its rounds (its queued results are then released).
    TCP keepalive finds peers whose host died without a reset."""
    sec = int(send_timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", sec, int((send_timeout_s - sec) * 1_000_000)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


class AggregationServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, server_id: str = "agg0", min_cores: int = 1,
                 max_cores: int = 4, round_timeout_s: float = 30.0, tick_s: float = 0.1,
                 shrink_after_s: float = 1.0, max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
                 interleave: bool = True, recv_buffer_bytes: int = RECV_BUF) -> None:
        """``interleave``: read overlapping rounds of different jobs first come, first served
        (aggregator/interleave.py) instead of all at once; ``recv_buffer_bytes``: each connection's
        receive buffer, which bounds what a held-back job can still push meanwhile."""
        self.server_id = server_id
        self.send_timeout_s = max(1.0, round_timeout_s)
        self.core = AggregationCore(server_id, round_timeout_s, max_job_bytes)
        self.pool = ElasticPool(PoolController(min_cores, max_cores, shrink_after_s=shrink_after_s), name=server_id)
        self.buffers = BufferPool()
        self._lock = threading.Lock()
        self._turns = threading.Condition(self._lock)
        self.order = RoundOrder() if interleave else None
        self.recv_buffer_bytes = recv_buffer_bytes
        self._eids = itertools.count(1)  # the core's stimulus ids: a counter, unique per server
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._conns: set[_Conn] = set()
        self._threads: list[threading.Thread] = []
        self.listener = socket.create_server((host, port), backlog=128)
        self.address = self.listener.getsockname()[:2]
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.monotonic()

    # --- life cycle ---

    def start(self) -> "AggregationServer":
        self.pool.start()
        for fn, name in ((self._accept_loop, "accept"), (self._tick_loop, "tick")):
            t = threading.Thread(target=fn, name=f"{self.server_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("aggregation server %s listening on %s:%d (pool %d..%d threads, kernel %s)", self.server_id,
                 *self.address, self.pool.controller.min, self.pool.controller.max,
                 "avx2+f16c" if kernel.uses_simd() else "scalar")
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            self.listener.close()
        except OSError:
            pass
        for c in list(self._conns):
            c.close()
            c.outq.put(None)
        self.pool.stop()
        for t in self._threads:
            t.join(timeout=2)

    def drain(self) -> None:
        """Move every job's future rounds to the other servers (clients re-route)."""
        self._handle(Drain(str(next(self._eids)), time.monotonic()))

    # --- core plumbing ---

    def _handle(self, ev) -> None:
        with self._lock:
            decisions = self.core.handle(ev)
        for d in decisions:
            if isinstance(d, Reduce):
                self.pool.submit(d.job, lambda d=d: self._reduce(d), d.nbytes * len(d.bufs))
            elif isinstance(d, Send):
                d.conn.send(d.data)
            elif isinstance(d, Release):
                for b in d.bufs:
                    self.buffers.release(b)
            elif isinstance(d, Close):
                d.conn.close_after_flush()

    def _reduce(self, d: Reduce) -> None:
        dst = d.bufs[0]
        kernel.reduce_sum(d.dtype, dst, d.bufs, d.divisor)
        for b in d.bufs[1:]:
            self.buffers.release(b)
        targets = [c for c in d.conns if c is not None and c.alive]
        if not targets:
            self.buffers.release(dst)
            return
        remaining = [len(targets)]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.buffers.release(dst)

        header = d.result.pack()
        payload = memoryview(dst)
        for c in targets:
            self.bytes_out += d.nbytes
            c.send(header, payload, done)

    # --- threads ---

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.recv_buffer_bytes)
            _guard_peer(sock, self.send_timeout_s)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            self._conns.add(conn)
            threading.Thread(target=conn.sender, name=f"{self.server_id}-send", daemon=True).start()
            threading.Thread(target=self._reader, args=(conn,), name=f"{self.server_id}-recv", daemon=True).start()

    def _reader(self, conn: _Conn) -> None:
        hbuf = bytearray(HEADER_SIZE)
        hview = memoryview(hbuf)
        orderly = False
        try:
            while not self._stop.is_set():
                if not recv_exact(conn.sock, hview):
                    break
                try:
                    h = parse_header(hbuf)
                except ProtocolError as exc:
                    log.warning("closing %s: %s", conn.peer, exc)
                    conn.send(error("bad_message", str(exc)))
                    break
                if h.mtype == MsgType.PUSH:
                    job = self._take_turn(conn, h)
                    buf = self.buffers.acquire(h.nbytes)
                    try:
                        got = recv_exact(conn.sock, memoryview(buf))
                    finally:
                        if job is not None:
                            with self._turns:
                                self.order.end(job, conn, time.monotonic())
                                self._turns.notify_all()
                    if not got:
                        raise ConnectionError("peer closed the connection mid-message")
                    self.bytes_in += h.nbytes
                    self._handle(ChunkArrived(str(next(self._eids)), time.monotonic(), conn, h, buf))
                    continue
                payload = bytearray(h.nbytes)
                if h.nbytes and not recv_exact(conn.sock, memoryview(payload)):
                    raise ConnectionError("peer closed the connection mid-message")
                if h.mtype == MsgType.HELLO:
                    try:
                        hello = parse_hello(payload)
                    except ProtocolError as exc:
                        conn.send(error("bad_message", str(exc)))
                        break
                    self._handle(Register(str(next(self._eids)), time.monotonic(), conn, hello))
                elif h.mtype == MsgType.BYE:
                    orderly = True
                    break
                elif h.mtype == MsgType.DRAINED:
                    self._handle(DrainAck(str(next(self._eids)), time.monotonic(), conn))
                else:
                    conn.send(error("bad_message", f"a server does not accept {h.mtype.name} messages"))
                    break
        except (ConnectionError, OSError) as exc:
            log.debug("connection %s lost: %s", conn.peer, exc)
        finally:
            with self._lock:
                who = self.core.conn_job.get(conn)
            self._handle(ConnectionLost(str(next(self._eids)), time.monotonic(), conn, orderly))
            if who is not None and self.order is not None:
                with self._lock:
                    if who[0] not in self.core.jobs:
                        self.order.forget(who[0])
            conn.close_after_flush()  # the sender flushes what is queued (an error), shuts the socket down
            conn.outq.put(None)  # and ends
            self._conns.discard(conn)
            # the descriptor itself is closed a little later, once no thread can still be using it
            closer = threading.Timer(0.5, self._finish, args=(conn,))
            closer.daemon = True
            closer.start()

    def _take_turn(self, conn: _Conn, h) -> str | None:
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

    def _finish(self, conn: _Conn) -> None:
        conn.close()
        try:
            conn.sock.close()
        except OSError:
            pass

    def _tick_loop(self) -> None:
        last_obs = 0.0
        while not self._stop.wait(self._tick_s):
            now = time.monotonic()
            self._handle(Tick(str(next(self._eids)), now))
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
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "draining": draining,
            "drain": drain,
            "kernel": "avx2+f16c" if kernel.uses_simd() else "scalar",
        }


# --- MQTT telemetry and commands ----------------------------------------------------------------


async def _telemetry(server: AggregationServer, broker: str, interval: float, stop: asyncio.Event) -> None:
    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import Bus

    sid = server.server_id
    state_t = messages.topic("agg", sid, "state")
    last = {"t": time.monotonic(), "in": server.bytes_in, "out": server.bytes_out}

    def state(st: dict[str, Any], rate_in: float = 0.0) -> bytes:
        # The retained state carries a load summary, so `dlshare status` shows load from retained
        # messages alone; telemetry has the full figures.
        pool = st["pool"]
        summary = {"cores": pool["size"], "min_cores": pool["min"], "max_cores": pool["max"],
                   "busy": pool["busy_fraction"], "cores_avg": pool["cores_avg"], "jobs": sorted(st["jobs"]),
                   "bytes_in_per_s": rate_in, "draining": st["draining"],
                   "drained": bool(st["drain"] and st["drain"]["moved"])}
        return messages.encode({"status": "online", "server": sid, "address": st["address"], "ts": time.time(),
                                "summary": summary})

    async def on_connect(bus: Bus) -> None:
        await bus.publish(state_t, state(server.stats()), qos=1, retain=True)

    async def on_message(topic: str, payload: bytes) -> None:
        cid = messages.command_id_of(payload)
        try:
            cmd = messages.parse_command(payload)
            if cmd.op == "ping":
                result: Any = {"pong": True}
            elif cmd.op == "stats":
                result = server.stats()
            elif cmd.op == "drain":
                server.drain()
                result = {"draining": True}
            else:
                raise messages.PayloadError(f"unknown op {cmd.op!r} (known: ping, stats, drain)")
            await bus.publish(messages.topic("agg", sid, "reply"), messages.reply(cmd.id, True, result), qos=1)
        except messages.PayloadError as exc:
            log.warning("bad command on %s: %s", topic, exc)
            await bus.publish(messages.topic("agg", sid, "reply"), messages.reply(cid, False, error=str(exc)), qos=1)

    bus = Bus(broker, f"dlshare-agg-{sid}", subscriptions=[(messages.topic("agg", sid, "cmd"), 1)],
              handler=on_message, on_connect=on_connect,
              will=(state_t, messages.encode({"status": "offline", "server": sid, "address": server.stats()["address"]}), 1, True))
    bus_stop = asyncio.Event()  # outlives ``stop`` long enough to publish the offline state
    runner = asyncio.ensure_future(bus.run(bus_stop))
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
            now = time.monotonic()
            dt = max(1e-9, now - last["t"])
            st = server.stats()
            st["ts"] = time.time()
            st["bytes_in_per_s"] = round((server.bytes_in - last["in"]) / dt, 1)
            st["bytes_out_per_s"] = round((server.bytes_out - last["out"]) / dt, 1)
            last.update(t=now, **{"in": server.bytes_in, "out": server.bytes_out})
            await bus.publish(messages.topic("agg", sid, "telemetry"), messages.encode(st))
            await bus.publish(state_t, state(st, st["bytes_in_per_s"]), qos=1, retain=True)
        await bus.publish(state_t, messages.encode({"status": "offline", "server": sid, "address": server.stats()["address"]}), qos=1, retain=True)
    finally:
        bus_stop.set()
        await runner


def serve(cfg: dict[str, dict[str, Any]], stop_event: threading.Event,
          ready_event: threading.Event | None = None) -> AggregationServer:
    """Run an aggregation server from config until ``stop_event`` is set.

    ``cfg["agg"]``: listen, id, min_cores, max_cores (0: all CPUs), round_timeout_s, telemetry_interval_s,
    max_job_bytes, interleave, recv_buffer_bytes;
    ``cfg["dlshare"]["broker"]``: MQTT broker URL ("" for none).
    """
    cfg = resolve(cfg)
    a = cfg["agg"]
    host, port = split_hostport(a["listen"], 7700)
    server = AggregationServer(host, port, a["id"], a["min_cores"], a["max_cores"], a["round_timeout_s"],
                               max_job_bytes=a["max_job_bytes"], interleave=bool(a["interleave"]),
                               recv_buffer_bytes=int(a["recv_buffer_bytes"])).start()
    broker = cfg.get("dlshare", {}).get("broker", "")
    loop_thread = None
    astop: list = []
    if broker:
        def run_bus() -> None:
            async def main() -> None:
                ev = asyncio.Event()
                astop.append((asyncio.get_running_loop(), ev))
                await _telemetry(server, broker, float(a["telemetry_interval_s"]), ev)
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
        server.stop()
    return server
