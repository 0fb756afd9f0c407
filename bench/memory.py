"""``dlshare bench memory``: remote memory against its baselines, side by side, on loopback.

One run measures, on this machine:

- local memcpy bandwidth (numpy copy);
- a raw Python socket 4 KiB request/response round trip (server in another process);
  (the latency series, ours and the baselines, are measured in interleaved turns so that
  the shared machine's drift hits all of them alike)
- redis-py 4 KiB GET against a redis-server the bench starts on a free port;
- our 4 KiB random read through ``RemoteBuffer.read`` (replicas=2, checksums on), p50/p99,
  and the same read at the C call (one segment) for reference;
- our batched 4 KiB page read and write throughput against loopback TCP bandwidth
  (large-buffer Python sockets between two processes, which run at kernel speed);
- reclaim: time from the donor's reclaim decision to every evicted slab unmapped (and
  its RSS back), scaled to seconds per GiB;
- a donor killed with SIGKILL under load: bytes lost (must be 0) and time to rebuild.

Donors are real node daemons (``dlshare node`` with ``lend = true``) on a broker
the bench starts; everything is stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import report
from nodesvc.bus.procs import free_port, wait_port, wait_until

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096
ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    if "--donors" not in seen:
        parser.add_argument("--donors", type=int, default=4,
                            help="memory bench: donor node daemons to start (at least 4: one is drained by the "
                                 "reclaim test and one killed after it, and 2 replicas need 2 more)")
        seen.add("--donors")


# --- small process helpers ---------------------------------------------------------------------

def _stop(proc: subprocess.Popen, timeout: float = 3.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _pcts(lat_ns: list[int] | np.ndarray) -> tuple[float, float]:
    a = np.asarray(lat_ns, dtype=np.float64) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


# --- baselines -----------------------------------------------------------------------------------

def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


_ECHO = r"""
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
resp = b"x" * 4096
while True:
    q = c.recv(64)
    if not q:
        break
    c.sendall(resp)
"""


class EchoBaseline:
    """A Python server in another process answering a 16-byte request with 4 KiB."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE)
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(PAGE)

    def measure(self, n: int) -> np.ndarray:
        c, mv = self.sock, memoryview(self.buf)
        lat = np.empty(n, dtype=np.int64)
        for i in range(n):
            t = time.perf_counter_ns()
            c.sendall(b"q" * 16)
            got = 0
            while got < PAGE:
                got += c.recv_into(mv[got:])
            lat[i] = time.perf_counter_ns() - t
        return lat

    def close(self) -> None:
        self.sock.close()
        _stop(self.proc)


class RedisBaseline:
    """redis-py GET of a 4 KiB value from a redis-server started on a free port."""

    def __init__(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if not exe:
            raise FileNotFoundError("redis-server is not installed")
        port = free_port()
        self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, self.proc)
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.set("k", b"v" * PAGE)
        for _ in range(200):
            self.r.get("k")

    def measure(self, n: int) -> np.ndarray:
        lat = np.empty(n, dtype=np.int64)
        get = self.r.get
        for i in range(n):
            t = time.perf_counter_ns()
            get("k")
            lat[i] = time.perf_counter_ns() - t
        return lat

    def close(self) -> None:
        self.r.close()
        _stop(self.proc)


_SINK = r"""
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
total = int(sys.argv[1]); buf = bytearray(4 << 20); mv = memoryview(buf); got = 0
while got < total:
    n = c.recv_into(mv)
    if not n:
        break
    got += n
c.sendall(b"k")
"""


def loopback_tcp_gbps(total: int) -> float:
    """Large-buffer Python sockets, one process to another: close to what the kernel can move."""
    p = subprocess.Popen([sys.executable, "-c", _SINK, str(total)], stdout=subprocess.PIPE)
    try:
        port = int(p.stdout.readline())
        c = socket.create_connection(("127.0.0.1", port))
        chunk = b"\0" * (4 << 20)
        t = time.perf_counter()
        sent = 0
        while sent < total:
            c.sendall(chunk)
            sent += len(chunk)
        c.recv(1)
        dt = time.perf_counter() - t
        c.close()
        return total / dt / 1e9
    finally:
        _stop(p)


# --- the cluster under test ---------------------------------------------------------------------

class Cluster:
    """A broker and donor node daemons, all separate processes."""

    def __init__(self, n_donors: int, slab_bytes: int, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self._cpu: dict[subprocess.Popen, float] = {}  # each donor process's CPU seconds at its last reading
        port = free_port()
        self.url = f"mqtt://127.0.0.1:{port}"
        mosq = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
        if mosq:
            conf = tmp / "mosquitto.conf"
            conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                            "set_tcp_nodelay true\n")
            cmd = [mosq, "-c", str(conf)]
            self.broker_kind = "mosquitto"
        else:
            cmd = [sys.executable, "-m", "nodesvc.cli", "broker", "--listen", f"127.0.0.1:{port}"]
            self.broker_kind = "amqtt"
        self.broker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        wait_port(port, self.broker)
        self.slab_bytes = slab_bytes
        for i in range(n_donors):
            self.start_donor(f"bench-donor{i}")

    def start_donor(self, node: str) -> None:
        env = dict(os.environ, DLSHARE_NODE_LEND="1", DLSHARE_NODE_ENFORCE="0", DLSHARE_NODE_INTERVAL="1.0",
                   DLSHARE_NODE_METRICS_LISTEN="127.0.0.1:-1", DLSHARE_NODE_STATE_DIR=str(self.tmp / node),
                   DLSHARE_DONOR_SLAB_BYTES=str(self.slab_bytes), DLSHARE_DONOR_RECLAIM_DEADLINE_S="5")
        with open(self.tmp / f"{node}.log", "ab") as log:
            self.procs[node] = subprocess.Popen(
                [sys.executable, "-m", "nodesvc.cli", "node", "--node-id", node, "--broker", self.url],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def cpu_s(self) -> float:
        """CPU seconds the donor processes have used so far, those that have exited included: a
        killed donor counts as of its last reading (:meth:`kill9` takes one just before the kill), so
        a run's difference of two readings never goes negative when a donor dies in it."""
        for p in self.procs.values():
            if p.poll() is not None:
                continue  # gone (and its pid free for another process): its last reading stands
            try:
                t = psutil.Process(p.pid).cpu_times()
            except psutil.Error:
                continue
            self._cpu[p] = t.user + t.system
        return sum(self._cpu.values())

    def restart_dead(self) -> list[str]:
        """Start again every donor that has exited (killed by a fault test); their names."""
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        for node in dead:
            self.start_donor(node)
        return dead

    def rss(self, node: str) -> int:
        return psutil.Process(self.procs[node].pid).memory_info().rss

    def kill9(self, node: str) -> None:
        self.cpu_s()  # the victim's CPU up to its death
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 3
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        _stop(self.broker)


# --- our path ------------------------------------------------------------------------------------

def our_latency(buf, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """RemoteBuffer.read of random 4 KiB pages, and the same read at the C call."""
    out = np.empty(PAGE, dtype=np.uint8)
    pages = rng.integers(0, buf.npages, n)
    lat = np.empty(n, dtype=np.int64)
    for i, p in enumerate(pages):
        t = time.perf_counter_ns()
        buf.read(int(p) * PAGE, PAGE, out)
        lat[i] = time.perf_counter_ns() - t
    # the same read at the C call, for reference (one segment, no failover logic)
    ext = buf.extents[0]
    rep = ext.readable()[0]
    ep = buf.io.endpoint(rep)  # buf.io: its RemoteMemory's DataPlane
    c_lat = np.empty(n, dtype=np.int64)
    for i, p in enumerate(rng.integers(0, ext.npages, n)):
        t = time.perf_counter_ns()
        ep.read_one(rep.slab, rep.token, int(p) * PAGE, PAGE, out, local_crc=True)
        c_lat[i] = time.perf_counter_ns() - t
    return lat, c_lat


def interleaved_latency(buf, n: int, rng, baselines: dict[str, Any], rounds: int = 6) -> dict[str, np.ndarray]:
    """Every series in short turns, so that the shared machine's drift hits all of them alike."""
    chunk = max(100, n // rounds)
    series: dict[str, list[np.ndarray]] = {"ours": [], "c_call": [], **{k: [] for k in baselines}}
    our_latency(buf, 200, rng)  # warm up
    for _ in range(rounds):
        for name, b in baselines.items():
            series[name].append(b.measure(chunk))
        ours, c_call = our_latency(buf, chunk, rng)
        series["ours"].append(ours)
        series["c_call"].append(c_call)
    return {k: np.concatenate(v) for k, v in series.items() if v}


def our_throughput(buf, nbytes: int, rng, reps: int) -> tuple[float, float]:
    npages = nbytes // PAGE
    pages = np.sort(rng.choice(buf.npages, npages, replace=False))
    data = rng.integers(0, 256, npages * PAGE, dtype=np.uint8)
    out = np.empty_like(data)
    wbest = rbest = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.write_pages(pages, data)
        wbest = min(wbest, time.perf_counter() - t)
        t = time.perf_counter()
        buf.read_pages(pages, out)
        rbest = min(rbest, time.perf_counter() - t)
    if not np.array_equal(out, data):
        raise AssertionError("batched read returned different bytes")
    return npages * PAGE / rbest / 1e9, npages * PAGE / wbest / 1e9


def reclaim(cluster: Cluster, mem, buf, ctl) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for e in buf.extents:
        for r in e.replicas:
            counts[r.node] = counts.get(r.node, 0) + r.slab_bytes
    victim = max(counts, key=counts.get)
    held = counts[victim]
    rss0 = cluster.rss(victim)
    t0 = time.perf_counter()
    ctl.call(victim, "reclaim", {"bytes": held, "pause_s": 3600.0})
    wait_until(lambda: not ctl.call(victim, "donor_status", {})["slabs"], 60, "evicted slabs to be unmapped",
               interval=0.01)
    dt = time.perf_counter() - t0
    rss1 = cluster.rss(victim)
    st = ctl.call(victim, "donor_status", {})["stats"]
    healthy = mem.wait_healthy(buf, 60)
    return {"reclaim_bytes": held, "reclaim_s": dt, "reclaim_s_per_gib": dt / (held / GIB),
            "reclaim_rss_returned_bytes": rss0 - rss1, "reclaim_forced_unmaps": st["forced_unmaps"],
            "reclaim_rebuilt_ok": healthy, "reclaim_victim": victim}


def donor_kill(cluster: Cluster, mem, nbytes: int, rng) -> dict[str, Any]:
    buf = mem.alloc(nbytes)
    model = rng.integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, model)
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    def writer() -> None:
        r = np.random.default_rng(99)
        try:
            while not stop.is_set():
                pages = np.unique(r.integers(0, buf.npages, 32))
                data = r.integers(0, 256, len(pages) * PAGE, dtype=np.uint8)
                with lock:
                    buf.write_pages(pages, data)
                    model.reshape(-1, PAGE)[pages] = data.reshape(-1, PAGE)
        except Exception as exc:  # noqa: BLE001 - counted as a failure below
            errors.append(repr(exc))

    th = threading.Thread(target=writer)
    th.start()
    time.sleep(0.3)
    victim = buf.extents[0].replicas[0].node
    t0 = time.perf_counter()
    cluster.kill9(victim)
    time.sleep(0.5)
    healthy = mem.wait_healthy(buf, 60)
    rebuild_s = time.perf_counter() - t0
    stop.set()
    th.join(60)
    lost = 0
    for ext in buf.extents:
        lo, hi = ext.first_page * PAGE, (ext.first_page + ext.npages) * PAGE
        try:
            got = buf.read(lo, min(hi, len(buf)) - lo)
            lost += int(np.count_nonzero(got != model[lo:lo + len(got)]))
        except Exception:  # noqa: BLE001 - an unreadable extent is lost data
            lost += min(hi, len(buf)) - lo
    buf.free()
    return {"donor_kill_lost_bytes": lost, "donor_kill_rebuild_s": rebuild_s, "donor_kill_healthy": healthy,
            "donor_kill_writer_errors": len(errors), "donor_kill_bytes": nbytes}


# --- the run --------------------------------------------------------------------------------------

def run(args) -> dict[str, Any]:
    from rdma import RemoteMemory
    from rdma.control import ControlPlane

    quick = bool(getattr(args, "quick", False))
    n_donors = max(4, int(getattr(args, "donors", 4) or 4))
    n_lat = 3000 if quick else 20000
    slab = 64 * MIB if quick else 256 * MIB
    thr_bytes = 32 * MIB if quick else 256 * MIB
    rng = np.random.default_rng(1)
    m: dict[str, Any] = {}
    notes: list[str] = []
    t_start = time.perf_counter()

    m["memcpy_gbps"] = memcpy_gbps(64 * MIB if quick else 512 * MIB)
    baselines: dict[str, Any] = {"raw": EchoBaseline()}
    try:
        baselines["redis"] = RedisBaseline()
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the bench still runs
        notes.append(f"redis baseline skipped: {exc}")

    tmp = Path(tempfile.mkdtemp(prefix="dlshare-bench-mem-"))
    cluster = Cluster(n_donors, slab, tmp)
    try:
        mem = RemoteMemory(broker=cluster.url, replicas=2, consumer_id="bench-consumer", discover_timeout_s=30)
        ctl = ControlPlane(cluster.url, "bench-operator")
        try:
            wait_until(lambda: len(mem.donors()) >= n_donors, 30, "donors", interval=0.01)
            # a buffer that puts several slabs on every donor: the reclaim victim gets ~4
            main_bytes = 2 * n_donors * slab
            t = time.perf_counter()
            buf = mem.alloc(main_bytes)
            m["alloc_s"] = time.perf_counter() - t
            fill = rng.integers(0, 256, 16 * MIB, dtype=np.uint8)
            for off in range(0, main_bytes, len(fill)):
                buf.write(off, fill[: min(len(fill), main_bytes - off)])
            lats = interleaved_latency(buf, n_lat, rng, baselines)
            raw, red, lat, c_lat = lats["raw"], lats.get("redis"), lats["ours"], lats["c_call"]
            m["raw_socket_rtt_p50_us"], m["raw_socket_rtt_p99_us"] = _pcts(raw)
            if red is not None:
                m["redis_get_4k_p50_us"], m["redis_get_4k_p99_us"] = _pcts(red)
            else:
                m["redis_get_4k_p50_us"] = m["redis_get_4k_p99_us"] = None
            m["read_4k_p50_us"], m["read_4k_p99_us"] = _pcts(lat)
            m["read_4k_c_call_p50_us"], m["read_4k_c_call_p99_us"] = _pcts(c_lat)
            # the shared machine's speed drifts: measure the loopback baseline right before
            # and right after our batches, under the same conditions, and keep its best
            loop_bytes = 512 * MIB if quick else 2 * GIB
            loops = [loopback_tcp_gbps(loop_bytes)]
            m["batched_read_gbps"], m["batched_write_gbps"] = our_throughput(buf, thr_bytes, rng, 2 if quick else 3)
            loops.append(loopback_tcp_gbps(loop_bytes))
            m["loopback_tcp_gbps"] = max(loops)
            m["loopback_tcp_gbps_runs"] = loops
            m["write_replicas"] = 2
            m.update(reclaim(cluster, mem, buf, ctl))
            buf.free()
            m.update(donor_kill(cluster, mem, 32 * MIB if quick else 128 * MIB, rng))
        finally:
            ctl.close()
            mem.close()
    finally:
        cluster.close()
        for b in baselines.values():
            b.close()
        shutil.rmtree(tmp, ignore_errors=True)
    m["slab_bytes"] = slab
    m["donors"] = n_donors
    m["bench_s"] = time.perf_counter() - t_start

    rtt, redis_p50 = m["raw_socket_rtt_p50_us"], m.get("redis_get_4k_p50_us")
    targets = report.target_rows([
        ("read_4k_p50_us <= 1.0 x raw_socket_rtt_p50_us", m["read_4k_p50_us"], "<=", rtt),
        ("read_4k_p50_us <= 0.5 x redis_get_4k_p50_us", m["read_4k_p50_us"], "<=",
         0.5 * redis_p50 if redis_p50 else None),
        ("batched_read_gbps >= 0.8 x loopback_tcp_gbps", m["batched_read_gbps"], ">=", 0.8 * m["loopback_tcp_gbps"]),
        ("reclaim_s_per_gib <= 1.0", m["reclaim_s_per_gib"], "<=", 1.0),
        ("donor_kill_lost_bytes == 0", m["donor_kill_lost_bytes"], "==", 0),
    ])
    ratios = {
        "read_4k_p50 / raw_socket_rtt_p50": m["read_4k_p50_us"] / rtt,
        "read_4k_p50 / redis_get_4k_p50": m["read_4k_p50_us"] / redis_p50 if redis_p50 else None,
        "batched_read / loopback_tcp": m["batched_read_gbps"] / m["loopback_tcp_gbps"],
        "batched_write / loopback_tcp": m["batched_write_gbps"] / m["loopback_tcp_gbps"],
        "batched_read / memcpy": m["batched_read_gbps"] / m["memcpy_gbps"],
    }
    result = report.envelope("memory", m, targets=targets, ratios=ratios, notes=notes, quick=quick,
                             broker=cluster.broker_kind)
    _print(result)
    _plot(result, raw, red, lat, c_lat, getattr(args, "json", None))
    return result


def _print(result: dict[str, Any]) -> None:
    m = result["metrics"]
    rows = [
        {"measure": "memcpy (numpy)", "value": m["memcpy_gbps"], "unit": "GB/s"},
        {"measure": "loopback TCP, large buffers", "value": m["loopback_tcp_gbps"], "unit": "GB/s"},
        {"measure": "raw Python socket 4 KiB RTT p50 / p99", "value": f"{m['raw_socket_rtt_p50_us']:.1f} / "
                                                                     f"{m['raw_socket_rtt_p99_us']:.1f}", "unit": "us"},
        {"measure": "redis-py 4 KiB GET p50 / p99",
         "value": (f"{m['redis_get_4k_p50_us']:.1f} / {m['redis_get_4k_p99_us']:.1f}"
                   if m.get("redis_get_4k_p50_us") else "n/a"), "unit": "us"},
        {"measure": "ours: RemoteBuffer.read 4 KiB p50 / p99 (2 replicas, crc)",
         "value": f"{m['read_4k_p50_us']:.1f} / {m['read_4k_p99_us']:.1f}", "unit": "us"},
        {"measure": "ours: C call, one 4 KiB segment p50 / p99",
         "value": f"{m['read_4k_c_call_p50_us']:.1f} / {m['read_4k_c_call_p99_us']:.1f}", "unit": "us"},
        {"measure": "ours: batched 4 KiB page read", "value": m["batched_read_gbps"], "unit": "GB/s"},
        {"measure": "ours: batched 4 KiB page write (to 2 replicas)", "value": m["batched_write_gbps"],
         "unit": "GB/s of user data"},
        {"measure": f"reclaim of {m['reclaim_bytes'] / MIB:.0f} MiB", "value": m["reclaim_s"], "unit": "s"},
        {"measure": "reclaim, scaled", "value": m["reclaim_s_per_gib"], "unit": "s/GiB"},
        {"measure": "donor RSS returned by reclaim", "value": m["reclaim_rss_returned_bytes"] / MIB, "unit": "MiB"},
        {"measure": "donor kill -9: bytes lost", "value": m["donor_kill_lost_bytes"], "unit": "bytes"},
        {"measure": "donor kill -9: until every extent has 2 live copies", "value": m["donor_kill_rebuild_s"],
         "unit": "s"},
    ]
    print(f"\n## memory ({'quick' if result['quick'] else 'full'}, broker {result['broker']})\n")
    print(report.markdown_table(rows, ["measure", "value", "unit"]))
    print(report.markdown_table([{"ratio": k, "value": v} for k, v in result["ratios"].items()]))
    report.print_targets_and_notes(result)


def _plot(result, raw, red, lat, c_lat, json_path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("raw Python socket", raw), ("redis-py GET", red), ("RemoteBuffer.read", lat), ("C call", c_lat)]
    for name, s in series:
        if s is None:
            continue
        v = np.sort(np.asarray(s, dtype=np.float64) / 1000.0)
        ax.plot(v, np.linspace(0, 1, len(v)), label=f"{name} (p50 {np.percentile(v, 50):.1f} us)")
    ax.set_xscale("log")
    ax.set_xlabel("4 KiB round trip, microseconds (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("dlshare remote memory: 4 KiB read latency on loopback")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = report.out_dir(json_path) / "memory_latency.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
