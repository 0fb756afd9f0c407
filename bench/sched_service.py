"""``dlshare bench sched-service``: the scheduler service under a burst of submissions.

What runs: a real broker (mosquitto when installed, else the embedded amqtt),
a real ``dlshare sched`` process, and ``--nodes`` simulated node daemons in this
process that speak the node MQTT contract (telemetry, ``run``/``stop`` with
replies, ``job_exit`` events) and end each job after ``--job-s`` seconds.  The
simulated nodes keep the measurement on the service: real daemons would start
1,000 processes on the benchmark machine.

What is measured, for ``--jobs`` submissions through the HTTP API:

- submissions/s, one client in sequence and ``--concurrency`` clients at once;
- decision latency: from a job's ``submitted`` event to the node's reply to its
  ``run`` command (the ``started`` event), p50/p99, from the service's own log;
- the baseline, in the same run: the pure core (``SchedulerState``) alone on the
  same jobs and cluster, to show what the HTTP, SQLite and MQTT shell costs;
- both SQLite durability modes (``synchronous=FULL``, the default, and ``NORMAL``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import report
from nodesvc.bus.procs import free_port, wait_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--jobs", dict(type=int, default=1000, help="submissions (sched-service)")),
                     ("--nodes", dict(type=int, default=16, help="simulated nodes (sched-service)")),
                     ("--gpus-per-node", dict(type=int, default=8, help="GPUs per simulated node (sched-service)")),
                     ("--concurrency", dict(type=int, default=16, help="clients at once (sched-service)")),
                     ("--job-s", dict(type=float, default=0.5, help="simulated job length (sched-service)"))):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start_broker(tmp: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
    if exe:
        conf = tmp / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        "max_queued_messages 100000\nmax_inflight_messages 0\n")
        cmd, kind = [exe, "-c", str(conf)], "mosquitto"
    else:
        cmd, kind = [sys.executable, "-m", "nodesvc.cli", "broker", "--listen", f"127.0.0.1:{port}"], "amqtt"
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, p)
    return p, f"mqtt://127.0.0.1:{port}", kind


class SimulatedNodes:
    """``n`` simulated nodes, one MQTT connection each, in their own process (so that the load
    generator's threads do not slow the nodes' replies down and count as service latency)."""

    def __init__(self, broker: str, n: int, gpus: int, job_s: float) -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.stop_ev = self.ctx.Event()
        self.ready = self.ctx.Event()
        self._runs = self.ctx.Value("i", 0)
        self.proc = self.ctx.Process(target=_nodes_main, args=(broker, n, gpus, job_s, self.stop_ev, self.ready,
                                                               self._runs), daemon=True)

    @property
    def runs(self) -> int:
        return self._runs.value

    def start(self) -> None:
        self.proc.start()
        if not self.ready.wait(30):
            raise TimeoutError("simulated nodes did not start")

    def stop(self) -> None:
        self.stop_ev.set()
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _nodes_main(broker: str, n: int, gpus: int, job_s: float, stop_ev, ready, runs) -> None:
    asyncio.run(_nodes(broker, n, gpus, job_s, stop_ev, ready, runs))


async def _nodes(broker: str, n: int, gpus: int, job_s: float, stop_ev, ready, runs) -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_node(broker, f"bench-{i:03d}", gpus, job_s, stop, runs)) for i in range(n)]
    await asyncio.sleep(0.5)
    ready.set()
    while not stop_ev.is_set():
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _node(broker: str, nid: str, gpus: int, job_s: float, stop: asyncio.Event, runs) -> None:
    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import Bus

    running: dict[str, float] = {}

    async def on_cmd(topic: str, payload: bytes) -> None:
        cmd = messages.parse_command(payload)
        if cmd.op == "run":
            running[cmd.args["job"]] = time.monotonic() + job_s
            with runs.get_lock():
                runs.value += 1
        elif cmd.op == "stop":
            running.pop(cmd.args.get("job"), None)
        # Replies are sent from their own task: the message pump goes on to the next command while
        # the broker acknowledges this one (a node must not serialise commands on broker round trips).
        t = asyncio.create_task(bus.publish(messages.node_topic(nid, "reply"),
                                            messages.reply(cmd.id, True, {"op": cmd.op}), 1))
        pending.add(t)
        t.add_done_callback(pending.discard)

    pending: set[asyncio.Task] = set()

    async def online(b) -> None:
        await b.publish(messages.node_topic(nid, "state"), messages.encode({"status": "online"}), 1, True)

    bus = Bus(broker, f"bench-{nid}", subscriptions=[(messages.node_topic(nid, "cmd"), 1)], handler=on_cmd,
              on_connect=online, will=(messages.node_topic(nid, "state"), messages.encode({"status": "offline"}), 1, True))
    bus_stop = asyncio.Event()  # set once the node has said it goes offline
    runner = asyncio.create_task(bus.run(bus_stop))
    last_t = 0.0
    while not stop.is_set():
        now = time.monotonic()
        for job in [j for j, end in running.items() if end <= now]:
            running.pop(job)
            await bus.publish(messages.node_topic(nid, "events"),
                              messages.encode({"event": "job_exit", "job": job, "exit_code": 0}), 1)
        if now - last_t >= 1.0:
            last_t = now
            t = {"node": nid, "ts": time.time(), "cpu": {"count": 64, "percent": 10.0},
                 "memory": {"total_bytes": 512 << 30, "available_bytes": 400 << 30},
                 "gpus": {"devices": [{"index": g, "util_percent": 50.0, "memory_total_bytes": 32 << 30}
                                      for g in range(gpus)], "reason": None, "simulated": True},
                 "rdma": {"devices": []},
                 "jobs": {j: {"pids": [1], "state": "running"} for j in running}}
            await bus.publish(messages.node_topic(nid, "telemetry"), messages.encode(t))
        await asyncio.sleep(0.02)
    await bus.publish(messages.node_topic(nid, "state"), messages.encode({"status": "offline"}), 1, True)
    bus_stop.set()
    await runner


def _spec(i: int) -> dict[str, Any]:
    if i % 2:
        return {"id": f"b-{i:05d}", "kind": "data_prep", "gpus": 0, "cpus": 1.0, "memory_bytes": 1 << 30,
                "command": ["prep"]}
    return {"id": f"b-{i:05d}", "model": ("resnet50", "vgg16", "transformer")[i % 3], "batch_size": 32,
            "gpus": 1, "cpus": 2.0, "memory_bytes": 4 << 30, "command": ["train"]}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _service_run(args, synchronous: str, tmp: Path) -> dict[str, Any]:
    from scheduler.client import SchedulerClient

    broker, burl, bkind = _start_broker(tmp)
    nodes = SimulatedNodes(burl, args.nodes, args.gpus_per_node, args.job_s)
    port = free_port()
    db = tmp / f"sched-{synchronous}.db"
    env = {**os.environ, "DLSHARE_SCHED_SYNCHRONOUS": synchronous, "DLSHARE_SCHED_TICK_S": "0.5"}
    log = open(tmp / f"sched-{synchronous}.log", "ab")
    prof = os.environ.get("DLSHARE_BENCH_PROFILE")  # cProfile the service into this file (for digging)
    pre = ["-m", "cProfile", "-o", f"{prof}.{synchronous}"] if prof else []
    svc = subprocess.Popen([sys.executable, *pre, "-m", "nodesvc.cli", "sched", "--listen", f"127.0.0.1:{port}",
                            "--db", str(db), "--token", TOKEN, "--broker", burl, "--profile", "dlshare",
                            "--log-level", "warning"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, svc)
        nodes.start()
        url = f"http://127.0.0.1:{port}"
        c = SchedulerClient(url, TOKEN, timeout=30)
        wait_until(lambda: sum(1 for n in c.cluster()["nodes"] if n["status"] == "online") >= args.nodes,
                   timeout=30, what="the simulated nodes online", interval=0.2)
        n_seq = max(1, args.jobs // 2)
        t0 = time.perf_counter()
        for i in range(n_seq):
            c.submit(_spec(i))
        seq_s = time.perf_counter() - t0
        rest = list(range(n_seq, args.jobs))
        lock = threading.Lock()

        def worker() -> None:
            with SchedulerClient(url, TOKEN, timeout=30) as wc:
                while True:
                    with lock:
                        if not rest:
                            return
                        i = rest.pop()
                    wc.submit(_spec(i))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conc_s = time.perf_counter() - t0
        deadline = time.monotonic() + max(60.0, args.jobs * args.job_s / max(1, args.nodes * args.gpus_per_node) * 4)
        while True:
            jobs = c.all()
            states = [j["state"] for j in jobs]
            if all(s in ("done", "failed") for s in states) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        lat, placed, cmd, gpu_lat, cpu_lat, seq_lat = [], [], [], [], [], []
        for j in jobs:
            ev: dict[str, float] = {}
            for e in c.events(j["id"]):
                ev.setdefault(e["kind"], e["ts"])  # the first of each kind
            if "started" in ev and "submitted" in ev:
                lat.append(ev["started"] - ev["submitted"])
                (gpu_lat if j["spec"]["gpus"] else cpu_lat).append(lat[-1])
                if int(j["id"].split("-")[1]) < n_seq:
                    seq_lat.append(lat[-1])
            if "placed" in ev and "submitted" in ev:
                placed.append(ev["placed"] - ev["submitted"])
            if "placed" in ev and "started" in ev:
                cmd.append(ev["started"] - ev["placed"])
        c.close()
        return {"synchronous": synchronous, "broker": bkind, "submit_seq_per_s": n_seq / seq_s,
                "submit_concurrent_per_s": (args.jobs - n_seq) / conc_s if conc_s > 0 else None,
                "decision_p50_ms": (_pct(lat, 0.5) or 0) * 1e3, "decision_p99_ms": (_pct(lat, 0.99) or 0) * 1e3,
                "placed_p50_ms": (_pct(placed, 0.5) or 0) * 1e3, "placed_p99_ms": (_pct(placed, 0.99) or 0) * 1e3,
                "command_p50_ms": (_pct(cmd, 0.5) or 0) * 1e3, "command_p99_ms": (_pct(cmd, 0.99) or 0) * 1e3,
                "gpu_jobs_p50_ms": (_pct(gpu_lat, 0.5) or 0) * 1e3, "cpu_jobs_p50_ms": (_pct(cpu_lat, 0.5) or 0) * 1e3,
                "seq_phase_p50_ms": (_pct(seq_lat, 0.5) or 0) * 1e3, "seq_phase_p99_ms": (_pct(seq_lat, 0.99) or 0) * 1e3,
                "started": len(lat), "done": states.count("done"), "failed": states.count("failed"),
                "runs_seen_by_nodes": nodes.runs}
    finally:
        try:
            nodes.stop()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        _stop(svc)
        _stop(broker)


def _core_baseline(args) -> dict[str, Any]:
    """The pure core on the same jobs and cluster: arrivals, then a finish for each start."""
    from scheduler import Job, JobArrived, JobFinished, Node, NodeReport, Place, SchedulerState

    st = SchedulerState("dlshare")
    now = 1.0
    for i in range(args.nodes):
        st.handle(NodeReport(f"n{i}", now, Node(f"bench-{i:03d}", gpus=args.gpus_per_node, cores=64,
                                                memory_bytes=512 << 30)))
    gpu_jobs = [s for s in map(_spec, range(args.jobs)) if s["gpus"]]
    t0 = time.perf_counter()
    running: list[str] = []
    lat = []
    for k, s in enumerate(gpu_jobs):
        now += 0.001
        a = time.perf_counter()
        out = st.handle(JobArrived(f"a{k}", now, Job(s["id"], s["model"], batch_size=32, gpus=1, cpus=2.0,
                                                    memory_bytes=4 << 30)))
        lat.append(time.perf_counter() - a)
        running += [d.job for d in out if isinstance(d, Place)]
        if len(running) > args.nodes * args.gpus_per_node // 2:
            now += 0.001
            st.handle(JobFinished(f"f{k}", now, running.pop(0)))
    el = time.perf_counter() - t0
    return {"core_events_per_s": len(gpu_jobs) / el, "core_decision_p50_ms": _pct(lat, 0.5) * 1e3,
            "core_decision_p99_ms": _pct(lat, 0.99) * 1e3}


def run(args) -> dict[str, Any]:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    if getattr(args, "quick", False):
        args.jobs, args.nodes = min(args.jobs, 200), min(args.nodes, 4)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dlshare-bench-sched-") as tmp:
        for mode in ("FULL", "NORMAL"):
            print(f"sched-service: {args.jobs} submissions, synchronous={mode} ...", flush=True)
            runs.append(_service_run(args, mode, Path(tmp)))
    base = _core_baseline(args)
    full = runs[0]
    metrics = {
        "jobs": args.jobs, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
        "concurrency": args.concurrency, "job_s": args.job_s, "runs": runs, "core": base,
        "submit_per_s": full["submit_concurrent_per_s"], "decision_p50_ms": full["decision_p50_ms"],
        "decision_p99_ms": full["decision_p99_ms"],
        "shell_vs_core_p50": full["decision_p50_ms"] / base["core_decision_p50_ms"] if base["core_decision_p50_ms"] else None,
    }
    rows = [{"mode": f"service, synchronous={r['synchronous']} ({r['broker']})",
             "submit/s (1 client)": r["submit_seq_per_s"],
             f"submit/s ({args.concurrency} clients)": r["submit_concurrent_per_s"],
             "decision p50 ms": r["decision_p50_ms"], "decision p99 ms": r["decision_p99_ms"],
             "placed p50/p99 ms": f"{r['placed_p50_ms']:.0f}/{r['placed_p99_ms']:.0f}",
             "run cmd p50/p99 ms": f"{r['command_p50_ms']:.0f}/{r['command_p99_ms']:.0f}",
             "GPU/CPU jobs p50 ms": f"{r['gpu_jobs_p50_ms']:.0f}/{r['cpu_jobs_p50_ms']:.0f}",
             "1-client phase p50/p99 ms": f"{r['seq_phase_p50_ms']:.0f}/{r['seq_phase_p99_ms']:.0f}",
             "started": r["started"], "done": r["done"], "failed": r["failed"]} for r in runs]
    rows.append({"mode": "baseline: pure core, no I/O", "submit/s (1 client)": base["core_events_per_s"],
                 "decision p50 ms": base["core_decision_p50_ms"], "decision p99 ms": base["core_decision_p99_ms"]})
    print(report.markdown_table(rows))
    targets = report.target_rows([
        ("every submission started", float(full["started"]), "==", float(args.jobs)),
        ("every job done", float(full["done"]), "==", float(args.jobs)),
        ("submissions/s (concurrent, FULL)", full["submit_concurrent_per_s"], ">=", 100.0),
        ("decision p99 ms (FULL)", full["decision_p99_ms"], "<=", 1000.0),
    ])
    print(report.markdown_table(targets))
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"sync={r['synchronous']}" for r in runs]
    ax.bar([x - 0.2 for x in range(len(runs))], [r["decision_p50_ms"] for r in runs], 0.4, label="p50")
    ax.bar([x + 0.2 for x in range(len(runs))], [r["decision_p99_ms"] for r in runs], 0.4, label="p99")
    ax.set_xticks(range(len(runs)), labels)
    ax.set_ylabel("submit -> started (ms)")
    ax.set_title(f"scheduler service, {args.jobs} jobs")
    ax.legend()
    fig.tight_layout()
    png = report.out_dir(getattr(args, "json", None)) / "sched_service.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return report.envelope("sched-service", metrics, table=rows, targets=targets, plots=[str(png)])
