"""``dlshare bench forecast``: how close the service's start estimates come to the real starts.

The simulator replays a trace under a profile.  When a job is submitted and has to wait, its start
is estimated from the core as it stands, exactly as the service estimates it
(:func:`scheduler.forecast.forecast`: the queue replayed forward through a copy of the core, running
jobs ending when the duration prior expects them to: the Philly runtimes, learning per job type from
the jobs that finished, :func:`scheduler.service.pending.philly_prior`);
the simulation then goes on and the job's real start is recorded.  For every job that waited at
least ``MIN_WAIT_S``:

* ``within_25``: the share whose estimated wait is within +-25% of its real wait (the issue's
  figure), ``within_50`` likewise, ``median_error``: the median of |estimated - real| / real wait;
* ``estimated``: the share that got an estimate at all (the replay started it within its horizon).

Beside it, in the same run, two references:

* ``work_ahead``: what a launcher could compute without the scheduler's replay: now + (the
  expected GPU-seconds left of the running jobs and of the jobs ahead of it in the queue) / the
  cluster's GPUs, with the same prior;
* ``oracle``: the same replay knowing every job's true isolated run time, so what is left is the
  error no duration guess can remove (jobs submitted later that overtake it, co-location slowing
  jobs down).

Defaults: Philly vc_103959 on 4x4 GPUs (load 0.78, the fair-share bench's main trace) under FIFO
and ``dlshare``; ``--quick``: its first 150 jobs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench import report

MIN_WAIT_S = 60.0  # shorter waits are noise next to a scheduling pass and a start
RUNS = [("vc_103959", "4x4")]
PROFILES = ("fifo", "dlshare")
QUICK_JOBS = 150


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--forecast-trace", {"help": "forecast: a trace (path or name) instead of vc_103959"}),
                     ("--forecast-cluster", {"help": "forecast: NODESxGPUS for --forecast-trace"}),
                     ("--forecast-profiles", {"help": "forecast: comma-separated profiles (default fifo,dlshare)"}),
                     ("--forecast-jobs", {"type": int, "help": "forecast: only the first N jobs of the trace"})):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def measure(trace: list, cluster: Any, profile: str, progress: Any = None) -> dict[str, Any]:
    """One simulated run with an estimate at each waiting submission; the accuracy of the three."""
    from scheduler.events import JobArrived, JobFinished, Place
    from scheduler.forecast import DurationPrior, elapsed_of, forecast
    from scheduler.service.pending import philly_prior
    from scheduler.sim import simulate

    prior: DurationPrior = philly_prior()
    submitted: dict[str, float] = {}
    started: dict[str, float] = {}
    est: dict[str, dict[str, float | None]] = {"replay": {}, "oracle": {}, "work_ahead": {}}
    cost: list[float] = []

    def oracle(rec: Any, ran: float) -> float:
        return (rec.job.duration or 0.0) - ran

    def on_batch(state: Any, t: float, events: list, decisions: list) -> None:
        for d in decisions:
            if isinstance(d, Place) and d.job not in started:
                started[d.job] = t
        for e in events:
            if isinstance(e, JobFinished):
                rec = state.records.get(e.job)
                if rec is not None and rec.job.state.value == "done":
                    prior.add(elapsed_of(rec, t), rec.job.job_type)  # as the service learns from them
        new = [e.job.id for e in events if isinstance(e, JobArrived) and e.job.id in state.waiting]
        for jid in (e.job.id for e in events if isinstance(e, JobArrived)):
            submitted[jid] = t
        if not new:
            return
        t0 = time.perf_counter()
        f = forecast(state, prior)
        cost.append(time.perf_counter() - t0)
        g = forecast(state, prior, remaining=oracle)
        queue = state.queue()
        total = max(1, state.total_gpus)
        running = sum(r.job.gpus * prior.remaining(elapsed_of(r, t)) for r in state.running.values())
        ahead = 0.0
        for r in queue:
            if r.job.id in new:
                est["work_ahead"][r.job.id] = t + (running + ahead) / total
            ahead += r.job.gpus * prior.remaining(elapsed_of(r, t))
        for jid in new:
            est["replay"][jid] = f.starts.get(jid)
            est["oracle"][jid] = g.starts.get(jid)
        if progress is not None:
            progress(len(submitted))

    sim = simulate(trace, cluster, profile, seed=0, on_batch=on_batch)
    out: dict[str, Any] = {"jobs": len(trace), "waited": 0, "forecasts": len(cost),
                           "forecast_ms_mean": 1e3 * float(np.mean(cost)) if cost else None,
                           "forecast_ms_p99": 1e3 * float(np.percentile(cost, 99)) if cost else None,
                           "avg_jct_h": sim.metrics()["avg_jct_h"]}
    waited = [j for j in est["replay"] if j in started and started[j] - submitted[j] >= MIN_WAIT_S]
    out["waited"] = len(waited)
    for name, e in est.items():
        errs, have = [], 0
        for j in waited:
            real = started[j] - submitted[j]
            guess = e.get(j)
            if guess is None:
                errs.append(np.inf)
                continue
            have += 1
            errs.append(abs((guess - submitted[j]) - real) / real)
        a = np.asarray(errs, dtype=float)
        out[name] = {"within_25": float(np.mean(a <= 0.25)) if len(a) else None,
                     "within_50": float(np.mean(a <= 0.5)) if len(a) else None,
                     "median_error": float(np.median(a)) if len(a) else None,
                     "estimated": have / len(waited) if waited else None}
    out["_points"] = [(started[j] - submitted[j], (est["replay"][j] or np.nan) - submitted[j]) for j in waited]
    return out


def run(args) -> dict[str, Any]:
    from scheduler import data
    from scheduler.sim import Cluster
    from scheduler.trace import load_trace

    if getattr(args, "forecast_trace", None):
        runs = [(args.forecast_trace, args.forecast_cluster or "4x4")]
    else:
        runs = RUNS
    profiles = (args.forecast_profiles or ",".join(PROFILES)).split(",")
    limit = getattr(args, "forecast_jobs", None) or (QUICK_JOBS if args.quick else None)
    rows, results, points = [], {}, {}
    for trace_name, cl in runs:
        trace = load_trace(data.resolve_trace(trace_name))
        trace = sorted(trace, key=lambda j: j.arrival_s)[:limit] if limit else trace
        cluster = Cluster.parse(cl)
        for prof in profiles:
            with report.step(f"forecast: {trace_name} on {cl}, {prof} ({len(trace)} jobs)") as step:
                m = measure(trace, cluster, prof, progress=lambda n: step(f"{n}/{len(trace)} jobs submitted"))
            points[f"{trace_name}/{prof}"] = m.pop("_points")
            results[f"{trace_name}/{prof}"] = m
            for est in ("replay", "work_ahead", "oracle"):
                r = m[est]
                rows.append({"trace": trace_name, "cluster": cl, "profile": prof, "estimate": est,
                             "waited": m["waited"], "within_25%": r["within_25"], "within_50%": r["within_50"],
                             "median_error": r["median_error"], "estimated": r["estimated"],
                             "forecast_ms_mean": m["forecast_ms_mean"] if est == "replay" else None})
    print(report.markdown_table(rows))
    plot = _plot(points, getattr(args, "json", None))
    return report.envelope("forecast", results, rows=rows, plot=plot, min_wait_s=MIN_WAIT_S)


def _plot(points: dict[str, list], json_path: str | None) -> str | None:
    if not points:
        return None
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    hi = 1.0
    for name, pts in points.items():
        xs = np.asarray([p[0] for p in pts], dtype=float) / 3600
        ys = np.asarray([p[1] for p in pts], dtype=float) / 3600
        ok = np.isfinite(ys) & (ys > 0)
        ax.scatter(xs[ok], ys[ok], s=8, alpha=0.6, label=name)
        if ok.any():
            hi = max(hi, float(xs[ok].max()), float(ys[ok].max()))
    line = np.asarray([1 / 60, hi])
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(line, line * 0.75, line * 1.25, color="0.85", label="+-25%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("real wait (h)")
    ax.set_ylabel("estimated wait at submission (h)")
    ax.legend(fontsize=8)
    ax.set_title("start estimates against real starts")
    path = report.out_dir(json_path) / "forecast.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
