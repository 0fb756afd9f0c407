"""``dlshare bench sched-service``: the scheduler service under bursts, at 1,000 nodes, and restarting.

1. **Burst.**  A real broker (mosquitto when installed, else the embedded amqtt), a real
   ``dlshare sched`` process and ``--nodes`` simulated node daemons (bench/fleet.py, one shard
   process) that end each job ``--job-s`` after it starts.  ``--jobs`` submissions through the
   HTTP API, half by one client in sequence, half by ``--concurrency`` clients at once (the
   burst), half GPU trainings and half CPU-only data preparation, all placed by the core.
   Measured: submissions/s; decision latency, from a job's ``submitted`` event to the node's
   reply to its ``run`` (``started``), p50/p99, from the service's own log, overall and for the
   burst alone.  Runs, side by side: the API on its own thread (the default) with SQLite
   ``synchronous=FULL`` and ``NORMAL``, and the baseline: the API on the live loop's thread
   (``sched.api_thread = false``, the design before this one), FULL; and FULL over HTTPS
   (``FULL-thread-tls``: a self-signed certificate made with openssl, every client checking it), with,
   for each run, the rate of fresh connections (one ``GET /healthz`` each: over HTTPS, a handshake
   each) to show what TLS costs.  Plus the pure core alone on the same jobs, to show what the shell
   costs.
2. **1,000 nodes** (bench/sched_scale.py ``fleet_run``): decision and telemetry lag with
   ``--fleet-nodes`` nodes reporting every 5 s, and ``--kill-nodes`` of them SIGKILLed at once.
3. **Restart** (``restart_run``): the time to a listening API after ``--restart-events`` logged
   events, with snapshots and, as the baseline, from the whole log.

Every run counts jobs lost or started twice, and breaks each decision's time down by stage
(``stages``/``burst_stages``, bench.sched_scale.STAGES: the store's group commit, the hand-over to
the loop, the wait for a core batch, the core and its log, the command's dispatch, the broker's
acknowledgement, the node taking it, its reply reaching the loop), from the times the service
writes into each job's ``started`` event.

Parts: ``--skip burst,fleet,restart``; ``--burst-modes`` picks the burst's runs (e.g. ``FULL-thread``
alone) and ``--restart-modes snapshots`` leaves out the whole-log baseline (~2 min a restart), so
``--burst-modes FULL-thread --restart-modes snapshots --restart-repeats 1`` is the targets' run in
about 10 minutes.  ``--quick`` shrinks every part.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.fleet import Fleet, double_starts
from bench.sched_scale import (
    TOKEN, fleet_run, pct, restart_run, stage_breakdown, start_broker, start_service, stop_proc,
)
from nodesvc.bus.procs import wait_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--jobs", dict(type=int, default=1000, help="submissions (sched-service burst)")),
                     ("--nodes", dict(type=int, default=16, help="simulated nodes (sched-service burst)")),
                     ("--gpus-per-node", dict(type=int, default=8, help="GPUs per simulated node (sched-service)")),
                     ("--concurrency", dict(type=int, default=16, help="clients at once (sched-service burst)")),
                     ("--job-s", dict(type=float, default=0.5, help="simulated job length (sched-service burst)")),
                     ("--fleet-nodes", dict(type=int, default=1000, help="nodes of the scale run (sched-service)")),
                     ("--fleet-shards", dict(type=int, default=4, help="processes for the surviving nodes")),
                     ("--kill-nodes", dict(type=int, default=100, help="nodes SIGKILLed at once (sched-service)")),
                     ("--stream-jobs", dict(type=int, default=1500, help="jobs streamed onto the fleet")),
                     ("--stream-rate", dict(type=float, default=10.0, help="jobs/s streamed onto the fleet")),
                     ("--stream-job-s", dict(type=float, default=60.0, help="job length on the fleet")),
                     ("--restart-events", dict(type=int, default=100_000, help="logged events before the restart")),
                     ("--restart-repeats", dict(type=int, default=3, help="restarts timed per database")),
                     ("--snapshot-events", dict(type=int, default=2000, help="the service's sched.snapshot_events")),
                     ("--snapshot-core-s", dict(type=float, default=1.0,
                                                help="the service's sched.snapshot_core_s (sched-service restart)")),
                     ("--skip", dict(default="", help="sched-service parts to skip: burst,fleet,restart")),
                     ("--burst-modes", dict(default="FULL-thread,FULL-thread-tls,NORMAL-thread,FULL-loop",
                                            help="sched-service burst runs: SYNC-thread|SYNC-loop, comma-separated "
                                                 "(SYNC: FULL or NORMAL; loop: the API on the loop, the baseline; "
                                                 "-tls: over HTTPS)")),
                     ("--restart-modes", dict(default="snapshots,whole_log",
                                              help="sched-service restarts: snapshots,whole_log (the whole log "
                                                   "is the slow baseline: ~2 min a restart)"))):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def _spec(i: int) -> dict[str, Any]:
    if i % 2:
        return {"id": f"b-{i:05d}", "kind": "data_prep", "gpus": 0, "cpus": 1.0, "memory_bytes": 1 << 30,
                "command": ["prep"]}
    return {"id": f"b-{i:05d}", "model": ("resnet50", "vgg16", "transformer")[i % 3], "batch_size": 32,
            "gpus": 1, "cpus": 2.0, "memory_bytes": 4 << 30, "command": ["train"]}


def _events(db: Path) -> dict[str, dict[str, float]]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT job, kind, ts FROM events WHERE job IS NOT NULL ORDER BY seq").fetchall()
    finally:
        con.close()
    out: dict[str, dict[str, float]] = {}
    for job, kind, ts in rows:
        out.setdefault(job, {}).setdefault(kind, ts)  # the first of each kind
    return out


def _self_signed(tmp: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (P-256, made by openssl), its own CA for the clients."""
    cert, key = tmp / "bench-sched.pem", tmp / "bench-sched.key"
    if not cert.exists():
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def _fresh_connections_per_s(url: str, ca_file: str | None, n: int = 200) -> float:
    """``GET /healthz`` ``n`` times, each on a new connection (a TLS handshake each over HTTPS)."""
    import httpx

    from nodesvc.bus import tls

    verify = tls.client_context(ca_file, what="scheduler")  # built once, as a launcher's client keeps it
    t0 = time.perf_counter()
    for _ in range(n):
        with httpx.Client(base_url=url, verify=verify, timeout=30) as fresh:
            fresh.get("/healthz").raise_for_status()
    return n / (time.perf_counter() - t0)


def _burst_run(args, synchronous: str, api_thread: bool, tmp: Path, tls: bool = False, run: int = 0) -> dict[str, Any]:
    from scheduler.client import SchedulerClient

    # A database of its own per run: a mode given twice would otherwise resubmit the same ids to the
    # first run's database, idempotent 200s, and report the first run's latencies again.
    name = f"{synchronous}-{'thread' if api_thread else 'loop'}{'-tls' if tls else ''}{f'-{run}' if run else ''}"
    broker, burl, bkind = start_broker(tmp)
    db = tmp / f"burst-{name}.db"
    env = {"DLSHARE_SCHED_SYNCHRONOUS": synchronous, "DLSHARE_SCHED_API_THREAD": "true" if api_thread else "false"}
    ca = None
    if tls:
        ca, key = _self_signed(tmp)
        env.update(DLSHARE_SCHED_TLS_CERT_FILE=ca, DLSHARE_SCHED_TLS_KEY_FILE=key)
    svc, url = start_service(tmp, db, burl, env, name)
    url = url.replace("http://", "https://") if tls else url
    fleet = Fleet(burl, tmp, gpus=args.gpus_per_node, cpus=64, interval=1.0, job_s=args.job_s)
    try:
        wait_port(int(url.rsplit(":", 1)[1]), svc, timeout=120)
        fleet.start(f"burst-{name}", args.nodes, prefix=f"b{name[0]}")
        fleet.wait_ready()
        c = SchedulerClient(url, TOKEN, timeout=60, ca_file=ca)
        wait_until(lambda: sum(1 for n in c.cluster()["nodes"] if n["status"] == "online") >= args.nodes,
                   timeout=60, what="the simulated nodes online", interval=0.2)
        n_seq = max(1, args.jobs // 2)
        t0 = time.perf_counter()
        for i in range(n_seq):
            c.submit(_spec(i))
        seq_s = time.perf_counter() - t0
        rest = list(range(n_seq, args.jobs))
        lock = threading.Lock()

        def worker() -> None:
            with SchedulerClient(url, TOKEN, timeout=60, ca_file=ca) as wc:
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
            counts = c.cluster()["jobs_by_state"]
            if sum(counts.get(s, 0) for s in ("queued", "running", "preempted")) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        stats = c.http.get("/v1/stats").json()
        c.close()
        fresh_per_s = _fresh_connections_per_s(url, ca)
    finally:
        fleet.stop()
        stop_proc(svc)
        stop_proc(broker)
    ev = _events(db)
    lat, placed, cmd, gpu_lat, cpu_lat, seq_lat, burst_lat = [], [], [], [], [], [], []
    placements = {}
    con = sqlite3.connect(db)
    try:
        for job, n in con.execute("SELECT job, COUNT(*) FROM events WHERE kind='placed' GROUP BY job"):
            placements[job] = n
    finally:
        con.close()
    for i in range(args.jobs):
        jid = _spec(i)["id"]
        e = ev.get(jid, {})
        if "started" in e and "submitted" in e:
            lat.append(e["started"] - e["submitted"])
            (gpu_lat if i % 2 == 0 else cpu_lat).append(lat[-1])
            (seq_lat if i < n_seq else burst_lat).append(lat[-1])
        if "placed" in e and "submitted" in e:
            placed.append(e["placed"] - e["submitted"])
        if "placed" in e and "started" in e:
            cmd.append(e["started"] - e["placed"])
    twice = double_starts(fleet.records(), fleet.node_deaths(), placements)
    ms = lambda xs, q: (pct(xs, q) or 0) * 1e3  # noqa: E731
    return {"synchronous": synchronous, "api_thread": api_thread, "tls": tls, "broker": bkind,
            "fresh_connections_per_s": fresh_per_s,
            "submit_seq_per_s": n_seq / seq_s,
            "submit_concurrent_per_s": (args.jobs - n_seq) / conc_s if conc_s > 0 else None,
            "decision_p50_ms": ms(lat, 0.5), "decision_p99_ms": ms(lat, 0.99),
            "burst_decision_p50_ms": ms(burst_lat, 0.5), "burst_decision_p99_ms": ms(burst_lat, 0.99),
            "placed_p50_ms": ms(placed, 0.5), "placed_p99_ms": ms(placed, 0.99),
            "command_p50_ms": ms(cmd, 0.5), "command_p99_ms": ms(cmd, 0.99),
            "gpu_jobs_p50_ms": ms(gpu_lat, 0.5), "cpu_jobs_p50_ms": ms(cpu_lat, 0.5),
            "seq_phase_p50_ms": ms(seq_lat, 0.5), "seq_phase_p99_ms": ms(seq_lat, 0.99),
            "started": len(lat), "done": counts.get("done", 0), "failed": counts.get("failed", 0),
            "jobs_lost": args.jobs - counts.get("done", 0), "jobs_started_twice": len(twice),
            "loop_lag_p99_ms": stats["loop_lag_ms"]["p99_ms"], "telemetry_to_core_p99_ms":
            stats["telemetry_to_core_ms"]["p99_ms"], "round_ms": stats.get("round_ms"),
            "stages": stage_breakdown(db), "burst_stages": stage_breakdown(db, [_spec(i)["id"] for i in range(n_seq,
                                                                                                        args.jobs)])}


def _median_ratio(runs: list[dict[str, Any]], key: str) -> float | None:
    """median over the HTTPS runs (FULL, API thread) / median over the plain ones, of ``key``."""
    import statistics

    def med(tls: bool) -> float | None:
        xs = [r[key] for r in runs if r["synchronous"] == "FULL" and r["api_thread"] and r["tls"] == tls
              and r.get(key)]
        return statistics.median(xs) if xs else None

    a, b = med(True), med(False)
    return a / b if a is not None and b else None


def _burst_modes(args) -> list[tuple[str, bool, bool]]:
    """(synchronous, API on its own thread, HTTPS) of each ``--burst-modes`` entry, in order."""
    out = []
    for m in filter(None, (x.strip() for x in getattr(args, "burst_modes", "FULL-thread").split(","))):
        sync, _, where = m.partition("-")
        where, _, tls = where.partition("-")
        if sync.upper() not in ("FULL", "NORMAL") or where not in ("thread", "loop") or tls not in ("", "tls"):
            raise SystemExit(f"--burst-modes: {m!r} is not SYNC-thread or SYNC-loop, optionally with -tls "
                             "(SYNC: FULL or NORMAL)")
        out.append((sync.upper(), where == "thread", tls == "tls"))
    return out


def stage_rows(name: str, stages: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per stage of a decision's way (bench.sched_scale.STAGES)."""
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return [{"run": name, "stage": k, "n": v["n"], "p50 ms": f(v["p50_ms"]), "p99 ms": f(v["p99_ms"]),
             "max ms": f(v["max_ms"])} for k, v in stages.items() if v["n"]]


def _core_baseline(args) -> dict[str, Any]:
    """The pure core on the same jobs and cluster: arrivals, then a finish for each start."""
    from scheduler import Job, JobArrived, JobFinished, Node, NodeReport, Place, SchedulerState

    st = SchedulerState("dlshare")
    now = 1.0
    for i in range(args.nodes):
        st.handle(NodeReport(f"n{i}", now, Node(f"bench-{i:03d}", gpus=args.gpus_per_node, cores=64,
                                                memory_bytes=512 << 30)))
    specs = [_spec(i) for i in range(args.jobs)]
    t0 = time.perf_counter()
    running: list[str] = []
    lat = []
    for k, s in enumerate(specs):
        now += 0.001
        a = time.perf_counter()
        out = st.handle(JobArrived(f"a{k}", now, Job(s["id"], s.get("model", "prep"), batch_size=32, gpus=s["gpus"],
                                                    cpus=s["cpus"], memory_bytes=s["memory_bytes"])))
        lat.append(time.perf_counter() - a)
        running += [d.job for d in out if isinstance(d, Place)]
        if len(running) > args.nodes * args.gpus_per_node // 2:
            now += 0.001
            st.handle(JobFinished(f"f{k}", now, running.pop(0)))
    el = time.perf_counter() - t0
    return {"core_events_per_s": len(specs) / el, "core_decision_p50_ms": pct(lat, 0.5) * 1e3,
            "core_decision_p99_ms": pct(lat, 0.99) * 1e3}


def run(args) -> dict[str, Any]:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    if getattr(args, "quick", False):
        args.jobs, args.nodes = min(args.jobs, 200), min(args.nodes, 4)
        args.stream_jobs, args.stream_job_s = min(args.stream_jobs, 300), min(args.stream_job_s, 20.0)
        args.restart_events, args.restart_repeats = min(args.restart_events, 5_000), min(args.restart_repeats, 1)
    skip = set(filter(None, getattr(args, "skip", "").split(",")))
    runs: list[dict[str, Any]] = []
    scale: dict[str, Any] = {}
    restart: dict[str, Any] = {}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dlshare-bench-sched-") as tmpd:
        tmp = Path(tmpd)
        if "burst" not in skip:
            for i, (mode, api_thread, tls) in enumerate(_burst_modes(args)):
                print(f"sched-service: {args.jobs} submissions, synchronous={mode}, API on "
                      f"{'its own thread' if api_thread else 'the loop (baseline)'}{', HTTPS' if tls else ''} ...",
                      flush=True)
                runs.append(_burst_run(args, mode, api_thread, tmp, tls, run=i))
        if "fleet" not in skip:
            scale = fleet_run(args, tmp)
        if "restart" not in skip:
            restart = restart_run(args, tmp)
    base = _core_baseline(args)
    full = next((r for r in runs if r["synchronous"] == "FULL" and r["api_thread"] and not r["tls"]), {})
    baseline = next((r for r in runs if not r["api_thread"]), {})
    lost = sum(r["jobs_lost"] for r in runs) + scale.get("jobs_lost", 0)
    twice = sum(r["jobs_started_twice"] for r in runs) + scale.get("jobs_started_twice", 0)
    metrics = {
        "jobs": args.jobs, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
        "concurrency": args.concurrency, "job_s": args.job_s, "runs": runs, "core": base,
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "submit_per_s": full.get("submit_concurrent_per_s"), "decision_p50_ms": full.get("decision_p50_ms"),
        "decision_p99_ms": full.get("decision_p99_ms"),
        "burst_decision_p99_ms": full.get("burst_decision_p99_ms"),
        "burst_decision_p99_ms_api_on_loop": baseline.get("burst_decision_p99_ms"),
        "shell_vs_core_p50": (full["decision_p50_ms"] / base["core_decision_p50_ms"]
                              if full and base["core_decision_p50_ms"] else None),
        "nodes1000": scale, "nodes1000_decision_p99_ms": scale.get("decision_p99_ms"),
        "nodes1000_telemetry_lag_p99_ms": scale.get("telemetry_to_core_p99_ms"),
        "restart": restart, "restart_s_after_100k_events": (restart.get("snapshots") or {}).get("restart_s"),
        "restart_s_whole_log": (restart.get("whole_log") or {}).get("restart_s"),
        "jobs_lost": lost, "jobs_started_twice": twice,
        # what HTTPS costs (FULL, API thread): medians over the runs of each, when the modes repeat
        "https_vs_http_submit_per_s": _median_ratio(runs, "submit_concurrent_per_s"),
        "https_vs_http_burst_decision_p99": _median_ratio(runs, "burst_decision_p99_ms"),
        "https_vs_http_fresh_connections_per_s": _median_ratio(runs, "fresh_connections_per_s"),
    }
    rows = [{"mode": f"burst, synchronous={r['synchronous']}, API on {'own thread' if r['api_thread'] else 'loop'}"
                     f"{', HTTPS' if r['tls'] else ''}",
             "submit/s (1 client)": r["submit_seq_per_s"],
             f"submit/s ({args.concurrency} clients)": r["submit_concurrent_per_s"],
             "decision p50/p99 ms": f"{r['decision_p50_ms']:.0f}/{r['decision_p99_ms']:.0f}",
             "burst p50/p99 ms": f"{r['burst_decision_p50_ms']:.0f}/{r['burst_decision_p99_ms']:.0f}",
             "placed p50/p99 ms": f"{r['placed_p50_ms']:.0f}/{r['placed_p99_ms']:.0f}",
             "run cmd p50/p99 ms": f"{r['command_p50_ms']:.0f}/{r['command_p99_ms']:.0f}",
             "fresh conn/s": r["fresh_connections_per_s"],
             "started": r["started"], "done": r["done"], "lost": r["jobs_lost"],
             "twice": r["jobs_started_twice"]} for r in runs]
    rows.append({"mode": "baseline: pure core, no I/O", "submit/s (1 client)": base["core_events_per_s"],
                 "decision p50/p99 ms": f"{base['core_decision_p50_ms']:.2f}/{base['core_decision_p99_ms']:.2f}"})
    if scale:
        rows.append({"mode": f"{scale['nodes']} nodes, {scale['killed_nodes']} killed",
                     "submit/s (1 client)": None,
                     "decision p50/p99 ms": f"{scale['decision_p50_ms']:.0f}/{scale['decision_p99_ms']:.0f}",
                     "burst p50/p99 ms": f"telemetry {scale['telemetry_to_core_p50_ms'] or 0:.0f}/"
                                         f"{scale['telemetry_to_core_p99_ms'] or 0:.0f}",
                     "started": scale["started"], "done": scale["jobs_by_state"].get("done", 0),
                     "lost": scale["jobs_lost"], "twice": scale["jobs_started_twice"]})
    print(report.markdown_table(rows))
    srows = [x for r in runs for x in stage_rows(f"burst {r['synchronous']} "
                                                 f"{'thread' if r['api_thread'] else 'loop'}"
                                                 f"{' https' if r['tls'] else ''}", r["burst_stages"])]
    if scale:
        srows += stage_rows(f"{scale['nodes']} nodes", scale["stages"])
    if srows:
        print(report.markdown_table(srows))
    checks = []
    if full:
        checks += [("every submission started (FULL)", float(full["started"]), "==", float(args.jobs)),
                   ("submissions/s (concurrent, FULL)", full["submit_concurrent_per_s"], ">=", 100.0),
                   ("burst_decision_p99_ms (16 clients, FULL)", full["burst_decision_p99_ms"], "<=", 1000.0)]
    if scale:
        checks += [("nodes1000_decision_p99_ms", scale["decision_p99_ms"], "<=", 1000.0),
                   ("nodes1000_telemetry_lag_p99_ms", scale["telemetry_to_core_p99_ms"], "<=", 2000.0),
                   ("killed nodes' jobs placed elsewhere", float(scale["requeued_placed_elsewhere"]), "==",
                    float(scale["requeued_by_kill"]))]
    if restart:
        checks.append(("restart_s_after_100k_events", metrics["restart_s_after_100k_events"], "<=", 5.0))
    checks += [("jobs lost (every run)", float(lost), "==", 0.0), ("jobs started twice (every run)", float(twice),
                                                                     "==", 0.0)]
    targets = report.target_rows(checks)
    print(report.markdown_table(targets))
    plots = []
    if runs:
        plt = report.pyplot()
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        labels = [f"{r['synchronous']}\n{'API thread' if r['api_thread'] else 'API on loop'}"
                  f"{' HTTPS' if r['tls'] else ''}" for r in runs]
        ax.bar([x - 0.2 for x in range(len(runs))], [r["burst_decision_p50_ms"] for r in runs], 0.4, label="p50")
        ax.bar([x + 0.2 for x in range(len(runs))], [r["burst_decision_p99_ms"] for r in runs], 0.4, label="p99")
        ax.set_xticks(range(len(runs)), labels)
        ax.set_ylabel("burst: submit -> started (ms)")
        ax.set_title(f"scheduler service, {args.concurrency} clients")
        ax.legend()
        fig.tight_layout()
        png = report.out_dir(getattr(args, "json", None)) / "sched_service.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        plots.append(str(png))
    return report.envelope("sched-service", metrics, table=rows, stage_table=srows, targets=targets, plots=plots)


__all__ = ["add_arguments", "run"]
