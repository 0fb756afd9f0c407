"""A TCP relay in front of a slab server that holds one bulk reply, for tests of what waits on a slow copy."""

from __future__ import annotations

import socket
import threading
import time


class HoldFirstBulkReply:
    """Relays ``addr``.  The server's reply to the first bulk request (over 512 KiB sent on a connection
    since its last reply) is held ``hold_s`` before it is passed on; every other reply passes at once.
    ``holding`` is set when the hold starts; ``released_at`` is the ``time.monotonic()`` at which the
    held reply was passed on."""

    BULK = 512 << 10

    def __init__(self, addr: str, hold_s: float) -> None:
        host, _, port = addr.rpartition(":")
        self.target = (host, int(port))
        self.hold_s = hold_s
        self.holding = threading.Event()
        self.released_at: float | None = None
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.socks: list[socket.socket] = [self.lsock]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            self.socks += [c, s]
            sent = [0]  # bytes of requests on this connection since its last reply
            threading.Thread(target=self._pipe, args=(c, s, sent, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, sent, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, sent: list[int], replies: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if not replies:
                    sent[0] += len(data)
                else:
                    if sent[0] > self.BULK and not self.holding.is_set():
                        self.holding.set()
                        time.sleep(self.hold_s)  # the slow copy itself, not a test's wait
                        self.released_at = time.monotonic()
                    sent[0] = 0
                dst.sendall(data)
        except OSError:
            pass  # a side closed: the relay of this connection ends with it (the tests check the bytes)
        for x in (src, dst):
            x.close()

    def close(self) -> None:
        for x in self.socks:
            x.close()
