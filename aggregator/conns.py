"""The aggregation server's connection machinery: bounded threads, lazy senders, receive budgets.

No thread belongs to a connection.  An idle connection sits in the server's epoll set;
when it becomes readable a :class:`Workers` thread reads it until it goes quiet, and
a connection with something to send borrows a worker until its queue is empty.  So
the number of threads follows the connections that are *moving data*, not the
connections that are open, and it never exceeds the pool's cap.

:class:`RecvBudget` bounds the bytes of payload being received at once, in total
and per peer address: a peer that starts a 16 MiB push and stalls pins at most its
share, for at most the server's frame deadline.  :class:`PeerCounts` caps the
connections one address may hold.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable

from aggregator.sockio import send_all, send_nowait

log = logging.getLogger("dlshare.agg")

# Results up to this size go out from the thread that summed them (a hand-off to a worker costs a
# wake-up, tens of microseconds); larger ones are handed off (their copy into the socket costs
# milliseconds, which the one summing thread of a shared pool must not spend for every job).
INLINE_SEND_BYTES = 256 << 10


def guard_peer(sock: socket.socket, send_timeout_s: float) -> None:
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


class Workers:
    """A thread pool that grows on demand up to ``max_threads`` and shrinks when idle.

    A task queued while every thread is busy and the cap is reached runs when a thread frees up.
    Threads that found no work for ``idle_s`` exit, so a quiet server holds none."""

    def __init__(self, name: str, max_threads: int, idle_s: float = 5.0) -> None:
        self.name, self.max_threads, self.idle_s = name, max_threads, idle_s
        self._q: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._idle = 0
        self.live = 0
        self.peak = 0
        self._stopping = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                return
            self._q.append(fn)
            if len(self._q) > self._idle and self.live < self.max_threads:
                self.live += 1
                self.peak = max(self.peak, self.live)
                threading.Thread(target=self._run, name=f"{self.name}-io", daemon=True).start()
            else:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._stopping:
                    self._idle += 1
                    woke = self._cond.wait(self.idle_s)
                    self._idle -= 1
                    if not woke and not self._q:
                        self.live -= 1
                        return
                if self._stopping:
                    self.live -= 1
                    return
                fn = self._q.popleft()
            try:
                fn()
            except Exception:  # a task's bug must not shrink the pool for good
                log.exception("aggregation I/O task failed")

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._q.clear()
            self._cond.notify_all()


class RecvBudget:
    """Bytes of payload being received right now, bounded in total and per peer address."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.used = 0
        self._peer: dict[str, int] = {}
        self._cond = threading.Condition()

    def acquire(self, peer: str, n: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for room for ``n`` bytes; False if none came."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.used + n <= self.total and self._peer.get(peer, 0) + n <= self.per_peer, timeout)
            if ok:
                self.used += n
                self._peer[peer] = self._peer.get(peer, 0) + n
            return ok

    def release(self, peer: str, n: int) -> None:
        with self._cond:
            self.used -= n
            left = self._peer[peer] - n
            if left:
                self._peer[peer] = left
            else:
                del self._peer[peer]
            self._cond.notify_all()


class PeerCounts:
    """Open connections per peer address, with a cap on each and on the total."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total_cap, self.per_peer = total, per_peer
        self.total = 0
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip``, or say why it is refused."""
        with self._lock:
            if self.total >= self.total_cap:
                return f"the server holds {self.total} connections, its limit (agg.max_connections)"
            n = self._n.get(ip, 0)
            if n >= self.per_peer:
                return f"{ip} holds {n} connections, the limit per address (agg.max_connections_per_peer)"
            self._n[ip] = n + 1
            self.total += 1
            return None

    def leave(self, ip: str) -> None:
        with self._lock:
            self.total -= 1
            n = self._n[ip] - 1
            if n:
                self._n[ip] = n
            else:
                del self._n[ip]


class Conn:
    """One peer connection.  Sends are queued and flushed by a borrowed worker thread, in order,
    so a slow peer never blocks a reduction thread and an idle one holds no thread."""

    def __init__(self, sock: socket.socket, ip: str, port: int, workers: Workers, hello_deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.ip = ip
        self.peer = f"{ip}:{port}"
        self.workers = workers
        self.hello_deadline = hello_deadline
        self.alive = True
        self.ended = False  # the reader cleaned up (ConnectionLost handled)
        self.registered = False  # a HELLO was accepted
        self._out: deque = deque()
        self._sending = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<conn {self.peer}>"

    def send(self, header: bytes, payload: memoryview | None = None, done=None) -> None:
        if not self.alive:
            if done:
                done()
            return
        inline = payload is None or len(payload) <= INLINE_SEND_BYTES
        with self._lock:
            if self._sending or self._out or not inline:
                self._out.append((header, payload, done))
                if self._sending:
                    return
                self._sending = True
                inline = False
            else:
                self._sending = True  # this thread owns the socket's sending side now
        if not inline:
            self.workers.submit(self._flush)
            return
        # Nothing queued and a small message: send from this thread as far as the socket's buffer
        # takes it, without blocking; a worker is borrowed only for what is left (a full buffer: a
        # slow peer).  A small result costs no thread hand-off; a large one is sent by a worker, so
        # that a summing thread never spends milliseconds copying into sockets.
        try:
            sent = send_nowait(self.sock, header, payload)
        except OSError:
            self.close()
            sent = -1
        whole = len(header) + (0 if payload is None else len(payload))
        if sent < 0 or sent == whole:
            if done:
                done()
            with self._lock:
                if not self._out:
                    self._sending = False
                    return
        else:
            if sent < len(header):
                rest = (memoryview(header)[sent:], payload, done)
            else:
                rest = (b"", memoryview(payload)[sent - len(header):], done)
            with self._lock:
                self._out.appendleft(rest)
        self.workers.submit(self._flush)

    def close_after_flush(self) -> None:
        """Close once what is queued (typically an error message) has been sent."""
        self._queue("close")

    def _queue(self, item) -> None:
        with self._lock:
            self._out.append(item)
            if self._sending:
                return
            self._sending = True
        self.workers.submit(self._flush)

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._out:
                    self._sending = False
                    return
                item = self._out.popleft()
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

    def close(self) -> None:
        """Shut the socket down (a blocked reader or sender wakes); the descriptor is closed later."""
        if self.alive:
            self.alive = False
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
