"""``dlshare bench slurm``: a real Slurm alone against dlshare driving the same Slurm.

* **Cluster:** a real Slurm on this host (``scheduler.slurm.testbed``): one slurmctld, ``--slurm-nodes``
  slurmd of 4 fake GPUs, 12 CPUs and 250 GiB each.
* **Trace:** the first ``--slurm-jobs`` jobs of philly/vc_0e4a51, arrivals scaled so they span
  ``--slurm-span-s`` seconds, durations scaled so the offered load over the span is ``--slurm-load``
  (1.5: a queue forms; 0: the arrivals' factor, which leaves the cluster mostly idle), at least
  ``--slurm-min-s``.  Each job is
  ``bench/slurm_workload.py``: it progresses at the simulator's ground-truth speed (slower when
  sharing a GPU) and checkpoints, so preemption and co-location change its finish time as the
  simulator models them.
* **Runs:** (a) Slurm alone: its own scheduler (sched/backfill, priority/basic: FIFO), GPUs as
  GRES files, every job submitted with its GPU-proportional CPUs and memory and a time limit of
  ``--slurm-time-factor`` x its duration + 1 min (a user's estimate: without one, backfill cannot
  start anything behind a blocked job); (b) the same jobs at the
  same times on a fresh cluster whose partition dlshare schedules (job_submit.lua holds, ``dlshare
  slurm`` with the dlshare profile places and releases), with a ``kill -9`` of ``dlshare slurm`` in the
  middle and an immediate restart; (c) the simulator on the same scaled trace (dlshare and fifo).
* **Metrics:** avg/p99 JCT (submit to end), decisions carried out, decision -> running latency
  (dlshare's release log line -> the job's start), jobs lost (never ended) and run twice (two live
  copies, or a start after the end), counted across both runs and the kill.

The policies run on the wall clock, as deployed: on a replay of a few minutes a 6-minute quantum
never comes round, so (b) shows dlshare's placement and start order, not its preemption (the tests
cover that).  The simulator runs the same compressed trace with the same profiles, so (c) is the
prediction for (b) and for a FIFO scheduler.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report, trace_replay
from bench.trace_replay import percentile

ROOT = Path(__file__).resolve().parent.parent
GPUS, CPUS, MEM_MB = 4, 12, 256000  # per node; the simulator's cluster is the same (below)
_REL = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*released job (\S+):")


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--slurm-jobs", dict(type=int, default=60, help="first N jobs of vc_0e4a51 (slurm)")),
                     ("--slurm-nodes", dict(type=int, default=4, help="slurmd nodes of 4 GPUs (slurm)")),
                     ("--slurm-span-s", dict(type=float, default=150.0, help="arrivals scaled to this span (slurm)")),
                     ("--slurm-min-s", dict(type=float, default=3.0, help="shortest scaled job, s (slurm)")),
                     ("--slurm-load", dict(type=float, default=1.5,
                                           help="durations scaled so the offered load over the span is this "
                                                "(above 1: a queue forms); 0: by the arrivals' factor (slurm)")),
                     ("--slurm-time-factor", dict(type=float, default=2.0,
                                                  help="each job's --time is this x its duration + 1 min; 0: none "
                                                       "(slurm)"))):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def scaled_trace(n: int, span_s: float, min_s: float, load: float = 0.0,
                 gpus_total: int = 0) -> tuple[list[Any], float]:
    """The first ``n`` jobs, arrivals scaled to span ``span_s``; durations by the same factor, or with
    ``load`` and ``gpus_total`` so that the GPU-seconds asked are ``load`` x what the cluster has over
    the span (the trace's own factor leaves the cluster mostly idle: no queue, nothing to order)."""
    from scheduler import data
    from scheduler.trace import TraceJob, load_trace

    full = load_trace(data.path("philly/vc_0e4a51.csv"))[:n]
    scale = span_s / max(max(t.arrival_s for t in full), 1.0)
    d_scale = scale
    if load > 0 and gpus_total > 0:
        d_scale = load * span_s * gpus_total / sum(t.gpus * t.duration_s for t in full)
    return [TraceJob(t.id, t.arrival_s * scale, t.model, t.batch_size, t.gpus, t.steps,
                     max(min_s, t.duration_s * d_scale)) for t in full], scale


def _type_key(t: Any) -> str:
    return f"{t.model}@{t.batch_size}x{t.gpus}"


def speed_table(trace: list[Any]) -> dict[str, dict[str, float]]:
    """Each job type's speed next to each other one on a GPU (the simulator's ground truth)."""
    from scheduler import data
    from scheduler.predictors.sensitivity import SensitivityModel
    from scheduler.sim import GroundTruth, _job_of

    truth = GroundTruth(data.gavel_throughputs()["v100"], SensitivityModel.from_data())
    kinds = {_type_key(t): _job_of(t) for t in trace}
    out: dict[str, dict[str, float]] = {}
    for ka, a in kinds.items():
        for kb, b in kinds.items():
            p = truth.pair(a, b)
            out.setdefault(ka, {})[kb] = 0.5 if p is None else float(p[0])  # does not fit: time-slices
    return out


def simulate(trace: list[Any], nodes: int) -> dict[str, dict[str, float]]:
    return trace_replay.simulate(trace, nodes, GPUS, CPUS, MEM_MB)


def _dlshare(cluster: Any, work: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nodesvc.cli", "slurm", "--slurm-conf", str(cluster.conf),
           "--journal", str(work / "journal"), "--partition", cluster.partition, "--profile", "dlshare",
           "--predictors", "data", "--poll", "0.3", "--gpu-slots", str(cluster.gpu_slots), "--log-level", "info"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def live_run(mode: str, trace: list[Any], root: Path, nodes: int, kill_at_s: float | None,
             timeout_s: float, time_factor: float = 2.0) -> dict[str, Any]:
    """One run on a fresh cluster: ``alone`` (Slurm's own scheduler) or ``dlshare``."""
    from scheduler.slurm.testbed import LocalSlurm

    dlshare = mode == "dlshare"
    work = root / mode
    work.mkdir(parents=True)
    (work / "speeds.json").write_text(json.dumps(speed_table(trace)))
    cluster = LocalSlurm(root / f"slurm-{mode}", nodes=nodes, gpus=GPUS, cpus=CPUS, memory_mb=MEM_MB,
                         gpu_slots=2 if dlshare else 0, lua=dlshare, taskprolog=dlshare)
    cluster.start()
    log = work / "dlshare.log"
    proc = _dlshare(cluster, work, log) if dlshare else None
    submitted: dict[str, float] = {}
    ids: dict[str, str] = {}
    kills = 0
    try:
        if proc is not None:  # ready once its journal exists (the predictors are trained before it is written)
            from nodesvc.bus.procs import wait_until

            wait_until(lambda: (work / "journal").exists() or proc.poll() is not None, timeout=300,
                       what="dlshare slurm ready", interval=0.2)
            time.sleep(0.5)
        t0 = time.time()
        for t in trace:
            while (now := time.time()) < t0 + t.arrival_s:
                if proc is not None and kill_at_s is not None and not kills and now >= t0 + kill_at_s:
                    proc, kills = _kill_and_restart(proc, cluster, work, log), 1
                time.sleep(min(0.05, t0 + t.arrival_s - now))
            g = t.gpus
            cmd = (f"{sys.executable} -m bench.slurm_workload --type {_type_key(t)} --work {t.duration_s:.3f} "
                   f"--dir {work}")
            comment = f"model={t.model}" + (f" batch_size={t.batch_size}" if t.batch_size else "")
            limit = [f"--time={math.ceil(time_factor * t.duration_s / 60) + 1}"] if time_factor > 0 else []
            submitted[t.id] = time.time()
            ids[t.id] = cluster.sbatch("-p", cluster.partition, f"--gres=gpu:{g}", "-c", str(3 * g),
                                       f"--mem={MEM_MB // GPUS * g}", "-J", t.model, "--comment", comment, *limit,
                                       "-o", "/dev/null", f"--chdir={ROOT}", "--wrap", cmd)
        if proc is not None and kill_at_s is not None and not kills:
            proc, kills = _kill_and_restart(proc, cluster, work, log), 1
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            ends = _events(work)[1]
            if all(ids[t.id] in ends for t in trace):
                break
            time.sleep(0.5)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        releases_in_log = _count(cluster.root / "log" / "slurmctld.log", r"release hold on JobId=")
        timed_out = _count(cluster.root / "log" / "slurmctld.log", r"Time limit exhausted for JobId=")
        cluster.stop()
    starts, ends, twice = _events(work)
    jct = [ends[ids[t.id]] - submitted[t.id] for t in trace if ids[t.id] in ends]
    lost = [t.id for t in trace if ids[t.id] not in ends]
    run_twice = sorted({j for j in twice} | {j for j, ss in starts.items() if j in ends and any(s > ends[j] for s in ss)})
    out: dict[str, Any] = {
        "mode": mode, "jobs": len(trace), "finished": len(jct), "avg_jct_s": sum(jct) / len(jct) if jct else None,
        "p99_jct_s": percentile(jct, 0.99), "makespan_s": (max(ends.values()) - min(submitted.values())) if ends else None,
        "jobs_lost": len(lost), "jobs_run_twice": len(run_twice), "restarts": sum(len(s) - 1 for s in starts.values()),
        "kills": kills, "jobs_timed_out": timed_out,  # killed by Slurm at their --time
    }
    if dlshare:
        rel = _releases(log)
        lat = []
        for jid, times in rel.items():
            for r in times:
                after = [s for s in starts.get(jid, []) if s >= r - 0.05]
                if after:
                    lat.append(min(after) - r)
        out.update({"decisions_carried_out": _count(log, r"slurm: (released|requeue|hold) job"),
                    "releases": sum(len(v) for v in rel.values()), "releases_in_slurm_log": releases_in_log,
                    "requeues": _count(log, r"slurm: requeue job"),
                    "decision_to_running_p50_s": percentile(lat, 0.5), "decision_to_running_p99_s": percentile(lat, 0.99),
                    "refused_or_failed_actions": _count(log, r"failed \(exit"),
                    "releases_shared": _count(log, r"released job \S+: placed on [^\n]* shared with"),
                    # a newcomer's longer limit comes in its release, a resident's by its own update
                    "time_limits_extended": _count(log, r"released job [^\n]* while shared\)")
                    + _count(log, r"while it shares a GPU")})
    return out


def _kill_and_restart(proc: subprocess.Popen, cluster: Any, work: Path, log: Path) -> subprocess.Popen:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    with open(log, "a") as f:
        f.write(f"--- bench: kill -9 at {time.time():.3f}, restarting ---\n")
    return _dlshare(cluster, work, log)


def _events(work: Path) -> tuple[dict[str, list[float]], dict[str, float], set[str]]:
    starts: dict[str, list[float]] = {}
    ends: dict[str, float] = {}
    twice: set[str] = set()
    p = work / "events"
    for line in (p.read_text().splitlines() if p.exists() else []):
        f = line.split()
        if f[0] == "start":
            starts.setdefault(f[1], []).append(float(f[2]))
        elif f[0] == "end":
            if f[1] in ends:
                twice.add(f[1])
            ends[f[1]] = float(f[2])
        elif f[0] == "twice":
            twice.add(f[1])
    return starts, ends, twice


def _releases(log: Path) -> dict[str, list[float]]:
    import datetime as dt

    out: dict[str, list[float]] = {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        m = _REL.match(line)
        if m:
            t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
            out.setdefault(m.group(3), []).append(t)
    return out


def _count(path: Path, pattern: str) -> int:
    try:
        return len(re.findall(pattern, path.read_text()))
    except OSError:
        return 0


def run(args) -> dict[str, Any]:
    from scheduler.slurm import testbed

    missing = testbed.available()
    if missing:
        raise SystemExit(f"bench slurm: Slurm is not installed ({missing}); run `make deps`")
    # A SIGTERM (timeout, Ctrl-C from a supervisor) unwinds through the finally blocks that stop the clusters.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n, span, nodes = args.slurm_jobs, args.slurm_span_s, args.slurm_nodes
    if getattr(args, "quick", False):
        n, span = min(n, 30), min(span, 60.0)
    load = getattr(args, "slurm_load", 0.0)
    trace, scale = scaled_trace(n, span, args.slurm_min_s, load, nodes * GPUS)
    print(f"slurm: {n} jobs of vc_0e4a51 x {scale:.3g} (arrivals over {span:.0f} s) on {nodes}x{GPUS} GPUs",
          flush=True)
    sim = simulate(trace, nodes)
    timeout = 3 * max(s["makespan_s"] for s in sim.values()) + 120
    runs = {}
    with tempfile.TemporaryDirectory(prefix="dlshare-bench-slurm-") as tmp:
        for mode in ("alone", "dlshare"):
            print(f"slurm: run {mode} ...", flush=True)
            runs[mode] = live_run(mode, trace, Path(tmp), nodes, span * 0.4 if mode == "dlshare" else None, timeout,
                                  args.slurm_time_factor)
            print(f"slurm: {mode}: " + json.dumps({k: v for k, v in runs[mode].items()}, default=str), flush=True)
    a, b = runs["alone"], runs["dlshare"]
    sim_b = sim["dlshare"]["mean_jct_s"]
    metrics = {
        "jobs": n, "nodes": nodes, "gpus_per_node": GPUS, "time_scale": scale, "span_s": span,
        "offered_load": sum(t.gpus * t.duration_s for t in trace) / (span * nodes * GPUS),
        "slurm_avg_jct_s": a["avg_jct_s"], "slurm_p99_jct_s": a["p99_jct_s"],
        "dlshare_avg_jct_s": b["avg_jct_s"], "dlshare_p99_jct_s": b["p99_jct_s"],
        "sim_avg_jct_s": sim_b, "sim_p99_jct_s": sim["dlshare"]["p99_jct_s"],
        "sim_fifo_avg_jct_s": sim["fifo"]["mean_jct_s"],
        "dlshare_vs_slurm": b["avg_jct_s"] / a["avg_jct_s"] if a["avg_jct_s"] and b["avg_jct_s"] else None,
        "slurm_mean_jct_vs_slurm": b["avg_jct_s"] / a["avg_jct_s"] if a["avg_jct_s"] and b["avg_jct_s"] else None,
        "live_vs_sim": b["avg_jct_s"] / sim_b if b["avg_jct_s"] and sim_b else None,
        "decisions_carried_out": b.get("decisions_carried_out"),
        "decision_to_running_p50_s": b.get("decision_to_running_p50_s"),
        "decision_to_running_p99_s": b.get("decision_to_running_p99_s"),
        "jobs_lost": a["jobs_lost"] + b["jobs_lost"], "jobs_run_twice": a["jobs_run_twice"] + b["jobs_run_twice"],
        "jobs_timed_out": a["jobs_timed_out"] + b["jobs_timed_out"],
        "releases_shared": b.get("releases_shared"), "time_limits_extended": b.get("time_limits_extended"),
        "kills": b["kills"], "runs": runs, "sim": sim,
    }
    rows = [
        {"run": "(a) Slurm alone (sched/backfill, FIFO)", "avg JCT s": a["avg_jct_s"], "p99 JCT s": a["p99_jct_s"],
         "makespan s": a["makespan_s"], "lost": a["jobs_lost"], "run twice": a["jobs_run_twice"]},
        {"run": f"(b) dlshare slurm (profile dlshare, {b['kills']} kill -9)", "avg JCT s": b["avg_jct_s"],
         "p99 JCT s": b["p99_jct_s"], "makespan s": b["makespan_s"], "lost": b["jobs_lost"],
         "run twice": b["jobs_run_twice"]},
        {"run": "(c) simulator, profile dlshare", "avg JCT s": sim_b, "p99 JCT s": sim["dlshare"]["p99_jct_s"],
         "makespan s": sim["dlshare"]["makespan_s"]},
        {"run": "(c) simulator, profile fifo", "avg JCT s": sim["fifo"]["mean_jct_s"],
         "p99 JCT s": sim["fifo"]["p99_jct_s"], "makespan s": sim["fifo"]["makespan_s"]},
    ]
    print(report.markdown_table(rows))
    print(f"decisions carried out: {b.get('decisions_carried_out')}; decision -> running p50/p99: "
          f"{b.get('decision_to_running_p50_s')}/{b.get('decision_to_running_p99_s')} s; released onto a shared GPU: "
          f"{b.get('releases_shared')}; time limits stretched for sharing: {b.get('time_limits_extended')}")
    gap = abs(metrics["live_vs_sim"] - 1.0) if metrics["live_vs_sim"] is not None else None
    targets = report.target_rows([
        ("slurm_mean_jct_vs_slurm (dlshare / Slurm alone, with a queue)", metrics["slurm_mean_jct_vs_slurm"], "<=", 0.8),
        ("|live / simulator - 1|", gap, "<=", 0.15),
        ("jobs lost (both runs, kill included)", float(metrics["jobs_lost"]), "==", 0.0),
        ("jobs run twice (both runs, kill included)", float(metrics["jobs_run_twice"]), "==", 0.0),
        (f"jobs killed at their --time (both runs; each asked {args.slurm_time_factor:g}x its duration + 1 min)",
         float(metrics["jobs_timed_out"]), "==", 0.0),
    ])
    print(report.markdown_table(targets))
    return report.envelope("slurm", metrics, table=rows, targets=targets)
