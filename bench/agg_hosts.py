"""The hosts of ``dlshare bench agg --network``: namespaces, server and worker processes, and a sampler.

:class:`Cluster` builds the shaped namespaces (nodesvc/netns.py), starts an aggregation server
process in each server host (recording its stage times) and runs worker processes for a list of
phases; :class:`Sampler` reads every host's link counters, its processes' CPU and its namespace's
TCP retransmissions while they run.  Everything is torn down in :meth:`Cluster.stop`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import agg_timeline
from nodesvc import netns
from nodesvc.bus.procs import stop_proc, wait_port

ROOT = Path(__file__).resolve().parents[1]
AGG_PORT = 7700


class Sampler(threading.Thread):
    """Link counters, server CPU and machine CPU, 10 times a second, for windows read afterwards."""

    def __init__(self, net: netns.HostNet, procs: dict[str, Any]) -> None:
        super().__init__(daemon=True, name="net-sampler")
        self.net, self.procs = net, procs
        self.rows: list[tuple[float, dict, dict, tuple[float, float]]] = []
        self.tcp: list[tuple[float, dict[str, dict[str, int]]]] = []  # every 5th sample
        self.stop = threading.Event()

    def _sample(self) -> None:
        cpu: dict[str, tuple[int, float]] = {}
        for host, p in list(self.procs.items()):
            try:
                t = psutil.Process(p.pid).cpu_times()
                cpu[host] = (p.pid, t.user + t.system + t.children_user + t.children_system)
            except (psutil.Error, AttributeError):
                pass
        ct = psutil.cpu_times()
        busy = ct.user + ct.nice + ct.system + ct.irq + ct.softirq + getattr(ct, "steal", 0.0)
        now = time.time()
        self.rows.append((now, self.net.counters(), cpu, (busy, busy + ct.idle + ct.iowait)))
        if len(self.rows) % 5 == 1:
            self.tcp.append((now, {h: agg_timeline.tcp_counters(pid) for h, (pid, _) in cpu.items()}))

    def run(self) -> None:
        while not self.stop.is_set():
            self._sample()
            self.stop.wait(0.1)
        self._sample()

    def delta(self, t0: float, t1: float) -> dict[str, Any]:
        """Per host: bytes sent and received between t0 and t1; server CPU-s; machine busy fraction."""
        rows = list(self.rows)  # the sampler goes on appending
        ts = np.array([r[0] for r in rows])

        def at(fn, t):
            return float(np.interp(t, ts, [fn(r) for r in rows]))

        out: dict[str, Any] = {"sent": {}, "recv": {}, "cpu_s": {}}
        for h in self.net.hosts:
            out["sent"][h] = at(lambda r: r[1][h][0], t1) - at(lambda r: r[1][h][0], t0)
            out["recv"][h] = at(lambda r: r[1][h][1], t1) - at(lambda r: r[1][h][1], t0)
        for h in {k for r in rows for k in r[2]}:
            # a restarted server is a new process: add up the CPU of each process over its part of the window
            total, seen = 0.0, False
            for pid in {r[2][h][0] for r in rows if h in r[2]}:
                mine = [(r[0], r[2][h][1]) for r in rows if h in r[2] and r[2][h][0] == pid]
                a, b = max(t0, mine[0][0]), min(t1, mine[-1][0])
                if len(mine) >= 2 and a < b:
                    xs, ys = [m[0] for m in mine], [m[1] for m in mine]
                    total += float(np.interp(b, xs, ys) - np.interp(a, xs, ys))
                    seen = True
            if seen:
                out["cpu_s"][h] = total
        busy = at(lambda r: r[3][0], t1) - at(lambda r: r[3][0], t0)
        total = at(lambda r: r[3][1], t1) - at(lambda r: r[3][1], t0)
        out["machine_busy"] = busy / total if total > 0 else None
        # TCP retransmissions in every host's namespace over the window (sampled twice a second)
        tcp = [r for r in list(self.tcp) if t0 - 0.6 <= r[0] <= t1 + 0.6]
        out["tcp"] = {}
        if len(tcp) >= 2:
            a, b = tcp[0][1], tcp[-1][1]
            for h in b:
                if h in a:
                    out["tcp"][h] = {k: b[h][k] - a[h].get(k, 0) for k in b[h]}
        return out

    def rates(self, t0: float, t1: float, hosts: list[str]) -> dict[str, Any]:
        """MB/s each of ``hosts`` sent and received between t0 and t1, per sample interval."""
        rows = [r for r in list(self.rows) if t0 - 0.2 <= r[0] <= t1 + 0.2]
        if len(rows) < 2:
            return {}
        ts = [(a[0] + b[0]) / 2 for a, b in zip(rows, rows[1:])]
        series = {}
        for h in hosts:
            for i, what in ((0, "out"), (1, "in")):
                series[f"{h} {what}"] = [round((b[1][h][i] - a[1][h][i]) / max(1e-6, b[0] - a[0]) / 1e6, 2)
                                         for a, b in zip(rows, rows[1:])]
        return {"t": ts, "series": series}


class Cluster:
    """The namespaces, the server processes and the worker processes of one run; teardown in stop()."""

    def __init__(self, workers: int, servers: int, rate_bit: int, tmp: Path) -> None:
        self.workers = [f"w{i}" for i in range(workers)]
        self.servers = [f"s{i}" for i in range(servers)]
        self.net = netns.HostNet(self.workers + self.servers)
        self.rate_bit, self.tmp = rate_bit, tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.sampler: Sampler | None = None
        self.restarts: dict[str, float] = {}

    def start(self) -> "Cluster":
        self.net.create()
        self.net.shape(self.rate_bit)
        for s in self.servers:
            self.start_server(s)
        self.sampler = Sampler(self.net, self.procs)
        self.sampler.start()
        return self

    def addr(self, host: str, port: int = AGG_PORT) -> str:
        return f"{self.net.addrs[host]}:{port}"

    def start_server(self, s: str) -> None:
        log = open(self.tmp / f"{s}.log", "ab")
        p = subprocess.Popen([*self.net.prefix(s), sys.executable, "-m", "aggregator.cli", "--listen", self.addr(s),
                              "--broker", "", "--id", s, "--round-timeout-s", "60", "--max-cores", "2",
                              "--trace-file", str(self.tmp / f"{s}.trace.json")],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.procs[s] = p
        try:  # the root namespace reaches every host through the bridge
            wait_port(AGG_PORT, proc=p, timeout=60, host=self.net.addrs[s])
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"aggregation server {s} did not start ({exc}): see {self.tmp / (s + '.log')}") from None

    def run_workers(self, specs: dict[str, dict], restart: set[str] = frozenset(), progress=None) -> dict:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        outs, started = {}, []
        for host, spec in specs.items():
            spec["out"] = str(self.tmp / f"{host}-{len(self.restarts)}-{time.monotonic_ns()}.json")
            path = self.tmp / f"{host}.spec.json"
            path.write_text(json.dumps(spec))
            log = open(self.tmp / f"{host}.log", "ab")
            p = subprocess.Popen([*self.net.prefix(host), sys.executable, "-m", "bench.agg_net_worker", str(path)],
                                 cwd=ROOT, stdout=subprocess.PIPE if host == "w0" else log,
                                 stderr=subprocess.STDOUT, env=env, text=True)
            self.procs[host] = p
            started.append(host)
            outs[host] = spec["out"]
        if progress and "w0" in specs:
            threading.Thread(target=self._echo, args=(self.procs["w0"], progress), daemon=True).start()
        deadline = time.monotonic() + 1800
        while any(self.procs[h].poll() is None for h in started):
            for s in restart:  # a server killed by the failover phase comes back
                if self.procs[s].poll() is not None and s not in self.restarts:
                    time.sleep(0.3)
                    self.restarts[s] = time.time()
                    self.start_server(s)
            bad = [h for h in started if self.procs[h].poll() not in (None, 0)]
            if bad or time.monotonic() > deadline:
                h = bad[0] if bad else started[0]
                raise RuntimeError(f"worker {h} failed (exit {self.procs[h].poll()}); log: {self.tmp / (h + '.log')}")
            time.sleep(0.1)
        return {h: json.loads(Path(o).read_text()) for h, o in outs.items()}

    @staticmethod
    def _echo(p: subprocess.Popen, progress) -> None:
        for line in p.stdout:
            progress(line.rstrip())

    def stop(self) -> None:
        if self.sampler:
            self.sampler.stop.set()
            self.sampler.join(timeout=5)
        for p in self.procs.values():
            try:
                stop_proc(p, timeout=5)
            except Exception:  # teardown goes on whatever one process does
                pass
        self.net.destroy()

    def traces(self) -> dict[str, dict]:
        """The servers' stage records (written when they stopped; a server killed by SIGKILL wrote none)."""
        out = {}
        for s in self.servers:
            f = self.tmp / f"{s}.trace.json"
            if f.exists():
                try:
                    out[s] = json.loads(f.read_text())
                except ValueError:
                    pass
        return out
