"""The scheduler service at scale, for ``dlshare bench sched-service``: 1,000 nodes and a restart.

* :func:`fleet_run`: a real mosquitto, a real ``dlshare sched`` and ``--fleet-nodes`` simulated
  node daemons (bench/fleet.py) in a few shard processes, telemetry every 5 s.  A stream of
  jobs is submitted through the API by 16 clients; halfway through, the shard that holds
  ``--kill-nodes`` of the nodes is SIGKILLed (their Last Wills fire at once).  Measured: the
  decision latency (submitted -> the node answered ``run``, from the service's own log), the
  telemetry lag (the node published -> the core handled the report, from ``/v1/stats``), how
  long the killed nodes' jobs took to run elsewhere, and jobs lost or started twice (the
  fleet's logs of every start against the service's placements).
* :func:`restart_run`: a database with ``--restart-events`` logged core events (the real
  service, in this process, fed node telemetry, submissions and exits), once with snapshots
  (``snapshot_events``, the default) and once without (the whole log: the baseline); then
  ``dlshare sched`` is started on each and timed until its API answers (the core is restored
  before the API listens), with the production predictors (trained from the shared data when
  no snapshot holds them).
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, double_starts, raise_fd_limit
from nodesvc.bus.procs import free_port, wait_port, wait_until
from nodesvc.bus.messages import telemetry_from

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stop_proc(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_broker(tmp: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
    if exe:
        conf = tmp / f"mosquitto-{port}.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        "max_queued_messages 100000\nmax_inflight_messages 0\nset_tcp_nodelay true\n")
        cmd, kind = [exe, "-c", str(conf)], "mosquitto"
    else:
        cmd, kind = [sys.executable, "-m", "nodesvc.cli", "broker", "--listen", f"127.0.0.1:{port}"], "amqtt"
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=raise_fd_limit)
    wait_port(port, p)
    return p, f"mqtt://127.0.0.1:{port}", kind


def start_service(tmp: Path, db: Path, broker: str, env: dict[str, str], name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp / f"sched-{name}.log", "ab")
    env = {**os.environ, "DLSHARE_SCHED_TICK_S": "0.5", "DLSHARE_SCHED_PREDICTORS": "default", **env}
    p = subprocess.Popen([sys.executable, "-m", "nodesvc.cli", "sched", "--listen", f"127.0.0.1:{port}",
                          "--db", str(db), "--token", TOKEN, "--broker", broker, "--profile", "dlshare",
                          "--log-level", "warning"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                         preexec_fn=raise_fd_limit)
    return p, f"http://127.0.0.1:{port}"


def job_latencies(db: Path) -> dict[str, dict[str, list[float]]]:
    """job -> event kind -> times, from the service's log (read after the run)."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT job, kind, ts, node FROM events WHERE job IS NOT NULL ORDER BY seq").fetchall()
    finally:
        con.close()
    out: dict[str, dict[str, list]] = {}
    for job, kind, ts, node in rows:
        out.setdefault(job, {}).setdefault(kind, []).append((ts, node))
    return out


# A decision's way from submitted to started, per stage (the ``started`` event's ``stages``, wall clock):
# name -> (from, to).  ``round_trip`` overlaps ``to_node`` + ``node_to_loop`` (for replies without a ts).
STAGES = (("commit", "submitted", "committed"),  # the store's group commit (fsync) on the API's side
          ("handoff", "committed", "queued"),  # the API's thread -> the loop's thread
          ("loop_queue", "queued", "batch"),  # waiting in the loop for its core batch
          ("wait_capacity", "batch", "decided"),  # arrived at the core -> the batch that placed it
          ("core_and_log", "decided", "logged"),  # the core, then the batch's log transaction
          ("dispatch", "logged", "publish"),  # the command task queued behind others -> handed to the bus
          ("puback", "publish", "sent"),  # handed to the bus -> the broker acknowledged it (QoS 1)
          ("to_node", "publish", "node"),  # handed to the bus -> the broker -> the node took it
          ("node_to_loop", "node", "reply"),  # the node's reply -> the broker -> the service's loop
          ("round_trip", "publish", "reply"),
          ("record", "reply", "started"))  # the reply -> the started event committed


def stage_breakdown(db: Path, jobs: list[str] | None = None) -> dict[str, dict[str, float | None]]:
    """p50/p99/max ms of each of :data:`STAGES`, over the jobs (all when ``jobs`` is None) whose
    first ``started`` event carries stages."""
    import json

    con = sqlite3.connect(db)
    try:
        sub = dict(con.execute("SELECT job, MIN(ts) FROM events WHERE kind='submitted' GROUP BY job"))
        rows = con.execute("SELECT job, ts, data FROM events WHERE kind='started' ORDER BY seq").fetchall()
    finally:
        con.close()
    want = set(jobs) if jobs is not None else None
    per: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    seen: set[str] = set()
    for job, ts, data in rows:
        if job in seen or (want is not None and job not in want) or job not in sub:
            continue
        seen.add(job)
        st = (json.loads(data or "{}") or {}).get("stages")
        if not st:
            continue
        t = {**st, "submitted": sub[job], "started": ts}
        for name, a, b in STAGES:
            if a in t and b in t:
                per[name].append(max(0.0, t[b] - t[a]))
    return {name: {"n": len(xs), "p50_ms": None if not xs else pct(xs, 0.5) * 1e3,
                   "p99_ms": None if not xs else pct(xs, 0.99) * 1e3, "max_ms": None if not xs else max(xs) * 1e3}
            for name, xs in per.items()}


def _spec(i: int, prefix: str) -> dict[str, Any]:
    if i % 3 == 2:
        return {"id": f"{prefix}-{i:05d}", "kind": "data_prep", "gpus": 0, "cpus": 2.0, "memory_bytes": 2 << 30,
                "command": ["prep"]}
    return {"id": f"{prefix}-{i:05d}", "model": ("resnet50", "vgg16", "transformer")[i % 3], "batch_size": 32,
            "gpus": 1 + (i % 4 == 0), "cpus": 2.0, "memory_bytes": 4 << 30, "command": ["train"]}


def fleet_run(args, tmp: Path) -> dict[str, Any]:
    from scheduler.client import SchedulerApiError, SchedulerClient

    n_nodes, n_kill = args.fleet_nodes, min(args.kill_nodes, args.fleet_nodes // 2)
    n_jobs = args.stream_jobs
    broker, burl, bkind = start_broker(tmp)
    db = tmp / "fleet.db"
    svc, url = start_service(tmp, db, burl, {"DLSHARE_SCHED_NODE_TIMEOUT_S": "30"}, "fleet")
    fleet = Fleet(burl, tmp, gpus=8, cpus=64, interval=5.0, job_s=args.stream_job_s)
    try:
        wait_port(int(url.rsplit(":", 1)[1]), svc, timeout=120)
        survivors = n_nodes - n_kill
        per = max(1, -(-survivors // args.fleet_shards))
        t0 = time.monotonic()
        for k, first in enumerate(range(0, survivors, per)):
            fleet.start(f"s{k}", min(per, survivors - first), first=first, prefix="node")
        fleet.start("victims", n_kill, first=survivors, prefix="node")
        fleet.wait_ready(timeout=600)
        c = SchedulerClient(url, TOKEN, timeout=60)
        wait_until(lambda: c.http.get("/v1/stats").json()["core"]["nodes"] >= n_nodes, timeout=300,
                   what=f"{n_nodes} nodes known to the core", interval=1.0, ignore=(SchedulerApiError, OSError))
        connect_s = time.monotonic() - t0
        print(f"sched-service: {n_nodes} nodes up in {connect_s:.0f}s; streaming {n_jobs} jobs ...", flush=True)
        pending = list(range(n_jobs))
        lock = threading.Lock()
        accepted: list[str] = []
        rate = args.stream_rate
        t_start = time.monotonic()

        def worker() -> None:
            with SchedulerClient(url, TOKEN, timeout=60) as wc:
                while True:
                    with lock:
                        if not pending:
                            return
                        i = pending.pop(0)
                    due = t_start + i / rate
                    if due > time.monotonic():
                        time.sleep(due - time.monotonic())
                    accepted.append(wc.submit(_spec(i, "s"))["id"])

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        while len(accepted) < n_jobs // 2:
            time.sleep(0.2)
        victims = set(fleet.ids["victims"])
        snap = c.http.get("/v1/stats").json()
        t_kill = time.time()
        fleet.kill("victims")  # SIGKILL: every Last Will at once
        for t in threads:
            t.join()
        deadline = time.monotonic() + max(300.0, 4 * args.stream_job_s)
        while time.monotonic() < deadline:
            counts = c.http.get("/v1/cluster").json()["jobs_by_state"]
            if sum(counts.get(s, 0) for s in ("queued", "running", "preempted")) == 0:
                break
            time.sleep(2.0)
        stats = c.http.get("/v1/stats").json()
        counts = c.http.get("/v1/cluster").json()["jobs_by_state"]
        c.close()
    finally:
        fleet.stop()
        stop_proc(svc)
        stop_proc(broker)
    ev = job_latencies(db)
    lat, requeued, back = [], [], []
    placements = {j: len(k.get("placed", [])) for j, k in ev.items()}
    for j in accepted:
        k = ev.get(j, {})
        if "started" in k and "submitted" in k:
            lat.append(k["started"][0][0] - k["submitted"][0][0])
        placed = k.get("placed", [])
        if any(node in victims for _, node in placed) and "requeued" in k:
            requeued.append(j)
            later = [ts for ts, node in k.get("started", []) if ts > t_kill]
            if later:
                back.append(min(later) - t_kill)
    elsewhere = sum(1 for j in requeued if ev[j]["placed"][-1][1] not in victims)
    twice = double_starts(fleet.records(), fleet.node_deaths(), placements)
    lost = n_jobs - counts.get("done", 0)
    return {"broker": bkind, "nodes": n_nodes, "killed_nodes": n_kill, "jobs": n_jobs, "accepted": len(accepted),
            "connect_s": connect_s, "decision_p50_ms": (pct(lat, 0.5) or 0) * 1e3,
            "decision_p99_ms": (pct(lat, 0.99) or 0) * 1e3, "started": len(lat),
            "telemetry_to_core_p50_ms": stats["telemetry_to_core_ms"]["p50_ms"],
            "telemetry_to_core_p99_ms": stats["telemetry_to_core_ms"]["p99_ms"],
            "telemetry_seen_p99_ms": stats["telemetry_seen_ms"]["p99_ms"],
            "telemetry_samples": stats["telemetry_to_core_ms"]["count"],
            "batch_p99_ms": stats["batch_ms"]["p99_ms"], "loop_lag_p99_ms": stats["loop_lag_ms"]["p99_ms"],
            "running_at_kill": snap["core"]["running"], "requeued_by_kill": len(requeued),
            "requeued_placed_elsewhere": elsewhere, "requeued_running_again_p99_s": pct(back, 0.99),
            "jobs_by_state": counts, "jobs_lost": lost, "jobs_started_twice": len(twice), "twice": twice[:10],
            "snapshot": stats["snapshot"], "stages": stage_breakdown(db, accepted),
            "round_ms": stats.get("round_ms"), "reports_coalesced": stats.get("reports_coalesced")}


def _fill_db(db: Path, n_events: int, snapshot_events: int, predictors,
             snapshot_core_s: float = float("inf")) -> dict[str, Any]:
    """Log ``n_events`` core events into ``db`` through the real service (in this process, no
    broker: the decisions are logged, as if their commands were answered), in the 1,000-node
    run's mix: 1,000 nodes of 8 GPUs reporting, 10 jobs/s arriving and each ending 60 s after
    its start, on a simulated clock."""
    from scheduler import JobStarted
    from scheduler.service.core_log import new_event_id
    from scheduler.service.live import SchedulerService
    from scheduler.service.store import JobStore

    svc = SchedulerService(JobStore(db, synchronous="NORMAL"), profile="dlshare", predictors=predictors,
                           snapshot_events=snapshot_events, snapshot_core_s=snapshot_core_s)
    svc.commands.spawn = lambda coro, key=None: coro.close()
    t = [1_000_000.0]
    svc.clock = lambda: t[0]
    svc.carrier.clock = svc.clock
    nodes = [f"node-{i:04d}" for i in range(1000)]
    running: dict[str, dict[str, float]] = {n: {} for n in nodes}  # node -> job -> when it ends

    def tel(n: str) -> dict[str, Any]:
        return {"schema": 1, "node": n, "ts": t[0], "cpu": {"count": 64, "percent": 10.0},
                "memory": {"total_bytes": 512 << 30, "available_bytes": 256 << 30},
                "gpus": {"devices": [{"index": g, "util_percent": 40.0, "memory_total_bytes": 32 << 30}
                                     for g in range(8)]},
                "rdma": {"devices": []}, "jobs": {j: {"pids": [1], "state": "running"} for j in running[n]}}

    i, k = 0, 0
    t0 = time.perf_counter()
    for n in nodes:
        svc.translator.on_telemetry(telemetry_from(tel(n)))
    while svc.stats.events < n_events:
        t[0] += 0.1  # one round: 20 nodes' telemetry is due (every 5 s), 1 job arrives (10/s)
        for _ in range(20):
            svc.translator.on_telemetry(telemetry_from(tel(nodes[k % len(nodes)])))
            k += 1
        svc.submit(_spec(i, "r"))
        i += 1
        svc.round()
        for jid, rec in list(svc.core.running.items()):
            node = rec.shards[0].node
            if jid not in running[node] and not rec.external:
                running[node][jid] = t[0] + 60.0
                svc.post(JobStarted(new_event_id(), svc.now(), jid, node, rec.placed_by))
        for n, jobs in running.items():
            for jid in [j for j, end in jobs.items() if end <= t[0]]:
                del jobs[jid]
                svc.translator.job_exited(n, jid, 0, "")
        svc.round()
        with svc.store.tx() as con:  # as if the nodes had answered: nothing left to re-send at a restart
            con.execute("UPDATE decisions SET state='acked' WHERE state='pending'")
    svc.store.close()
    return {"events": svc.stats.events, "jobs": i, "build_s": time.perf_counter() - t0}


def restart_run(args, tmp: Path) -> dict[str, Any]:
    from scheduler import Predictors
    from scheduler.service.journal import Journal
    from scheduler.service.store import JobStore

    n = args.restart_events
    preds = Predictors.from_data()  # the production predictors (sched.predictors = data)
    broker, burl, _ = start_broker(tmp)
    out: dict[str, Any] = {"events": n}
    try:
        modes = set(filter(None, getattr(args, "restart_modes", "snapshots,whole_log").split(",")))
        core_s = getattr(args, "snapshot_core_s", 1.0)
        for mode, every, budget in (("snapshots", args.snapshot_events, core_s), ("whole_log", 1 << 40, float("inf"))):
            if mode not in modes:
                continue
            db = tmp / f"restart-{mode}.db"
            print(f"sched-service: logging {n} core events ({mode}) ...", flush=True)
            built = _fill_db(db, n, every, preds, budget)
            st = JobStore(db, synchronous="NORMAL")
            j = Journal(st)
            tail = j.events_after(j.latest_snapshot().batch if j.latest_snapshot() else 0)
            st.close()
            times, restores = [], []
            for k in range(args.restart_repeats):
                copy = tmp / f"restart-{mode}-{k}.db"  # each start on the database as it was logged
                shutil.copyfile(db, copy)
                t0 = time.monotonic()
                p, url = start_service(tmp, copy, burl, {"DLSHARE_SCHED_PREDICTORS": "data"}, f"restart-{mode}-{k}")
                try:
                    wait_port(int(url.rsplit(":", 1)[1]), p, timeout=300)
                    times.append(time.monotonic() - t0)
                    import httpx

                    restores.append(httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"},
                                              timeout=30).json()["restore"])
                finally:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
            out[mode] = {"restart_s": sorted(times)[len(times) // 2], "restart_s_all": times,
                         "replayed_events": restores[-1].get("events"), "restore_s": restores[-1].get("seconds"),
                         "restored_from": restores[-1].get("from"), "log_events_after_snapshot": tail, **built}
    finally:
        stop_proc(broker)
    return out
