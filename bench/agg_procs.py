"""Processes of ``dlshare bench agg``: aggregation servers and workers as spawned children."""

from __future__ import annotations

import time
from typing import Any

import psutil


def server_proc(conn, kw: dict[str, Any]) -> None:
    from aggregator.server import AggregationServer, ServerSettings

    srv = AggregationServer(ServerSettings(**kw)).start()
    conn.send(f"{srv.address[0]}:{srv.address[1]}")
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            conn.send(srv.stats())
        elif cmd == "stages":
            conn.send(srv.stages.records() if srv.stages is not None else [])
        else:
            srv.stop()
            conn.send("bye")
            return


class ServerProc:
    def __init__(self, ctx, **kw: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=server_proc, args=(child, kw), daemon=True)
        self.proc.start()
        self.addr = self.conn.recv()
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stats(self) -> dict[str, Any]:
        self.conn.send("stats")
        return self.conn.recv()

    def stages(self) -> list[dict[str, Any]]:
        """The server's stage records (started with ``trace=True``)."""
        self.conn.send("stages")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send("stop")
            self.conn.recv()
        except (EOFError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def gather(q, n: int, procs: list, timeout: float = 300) -> list:
    """n results from the queue; fails at once when a worker process dies instead."""
    import queue as _q

    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        try:
            out.append(q.get(timeout=0.5))
        except _q.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"bench worker {dead[0].name} died with exit code {dead[0].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench workers gave {len(out)} of {n} results in {timeout}s")
    return out


def spawn(ctx, target, argss) -> list:
    ps = [ctx.Process(target=target, args=a, daemon=True) for a in argss]
    for p in ps:
        p.start()
    return ps


def join_all(ps) -> None:
    for p in ps:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
