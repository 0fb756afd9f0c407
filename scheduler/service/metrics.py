"""The scheduler service's own Prometheus metrics (``GET /metrics``), named as Prometheus asks:
base units, ``_total`` for counters, ``_seconds`` and ``_bytes``.

Counters and histograms move on the live loop's thread as batches are handled (prometheus-client
makes them safe to read from the API's thread).  Gauges are the cluster now: the API asks the loop
for a :meth:`SchedulerMetrics.snapshot` before each scrape and the collector reads it.

=================================================  =====================================================
series                                             meaning
=================================================  =====================================================
``dlshare_sched_info{profile,version}``            1: the service and its scheduling profile
``dlshare_sched_jobs{state}``                      jobs queued, running, preempted now
``dlshare_sched_queue_length{reason}``             waiting jobs by reason code (Resources, Priority...)
``dlshare_sched_queue_wait_longest_seconds``       the longest a waiting job has waited since submission
``dlshare_sched_jobs_submitted_total``             jobs accepted
``dlshare_sched_jobs_finished_total{state}``       jobs that ended: done, failed, cancelled
``dlshare_sched_job_wait_seconds``                 histogram: submission to first start
``dlshare_sched_job_completion_seconds``           histogram: submission to done (JCT)
``dlshare_sched_decisions_total{kind}``            the core's decisions: place, preempt, allocate, ...
``dlshare_sched_decision_latency_seconds``         histogram: one batch through the core, logged
``dlshare_sched_nodes{status}``                    node daemons online, offline
``dlshare_sched_gpus`` / ``_gpus_allocated``       GPUs on online nodes, and those jobs hold
``dlshare_sched_cpus`` / ``_cpus_allocated``       cores on online nodes, and those allocated
``dlshare_sched_memory_lendable_bytes``            what the donors could lend (their telemetry)
``dlshare_sched_memory_lent_bytes``                what the donors lend now (their telemetry)
``dlshare_sched_lent_memory_promised_bytes``       lent memory the core promised to jobs
``dlshare_sched_lent_memory_reclaimed_bytes_total`` promised lent memory taken back (reclaims, lost donors)
``dlshare_sched_aggregation_servers``              aggregation servers reporting
``dlshare_sched_aggregation_pool_cores`` / ``_busy_cores``  their elastic pools, and the work in them
``dlshare_sched_forecast_duration_seconds``        what the last start-estimate replay took
=================================================  =====================================================
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler import (
    Decision, Event, JobCancelled, JobFinished, JobState, Place, Reject, Release, SchedulerState,
)

# No ``_created`` series beside every counter and histogram: nothing here reads them, and they double
# what a scrape carries (this process holds only the scheduler's own registry).
disable_created_metrics()

_MIN, _H = 60.0, 3600.0
WAIT_BUCKETS = (1, 5, 15, 30, _MIN, 5 * _MIN, 15 * _MIN, 30 * _MIN, _H, 2 * _H, 4 * _H, 8 * _H, 24 * _H)
JCT_BUCKETS = (_MIN, 5 * _MIN, 15 * _MIN, 30 * _MIN, _H, 2 * _H, 4 * _H, 8 * _H, 16 * _H, 24 * _H, 48 * _H,
               7 * 24 * _H)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SchedulerMetrics:
    def __init__(self, profile: str, version: str) -> None:
        self.registry = CollectorRegistry()
        self.profile, self.version = profile, version
        r = self.registry
        self.submitted = Counter("dlshare_sched_jobs_submitted", "Jobs accepted by the API.", registry=r)
        self.finished = Counter("dlshare_sched_jobs_finished", "Jobs that ended, by how.", ["state"], registry=r)
        self.decisions = Counter("dlshare_sched_decisions", "Decisions of the scheduling core, by kind.", ["kind"],
                                 registry=r)
        self.wait = Histogram("dlshare_sched_job_wait_seconds", "Time from submission to first start.",
                              buckets=WAIT_BUCKETS, registry=r)
        self.jct = Histogram("dlshare_sched_job_completion_seconds",
                             "Job completion time: submission to done.", buckets=JCT_BUCKETS, registry=r)
        self.latency = Histogram("dlshare_sched_decision_latency_seconds",
                                 "One batch of events through the core, logged with its decisions.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        for kind in ("place", "preempt", "allocate", "release", "reject"):
            self.decisions.labels(kind)  # every kind is a series from the start (rate() needs one)
        for state in ("done", "failed", "cancelled"):
            self.finished.labels(state)
        self.gauges: dict[str, Any] = {}
        r.register(_Gauges(self))

    # --- the loop's thread ----------------------------------------------------------------

    def batch(self, events: list[Event], decisions: list[Decision], core: SchedulerState, seconds: float) -> None:
        """One batch handled: its decisions, the starts and ends it made, what it cost."""
        self.latency.observe(seconds)
        now = core.now
        # A batch may hold several events, and the core's clock ends at the last one's time: a job
        # that ended at an earlier event of the batch has finished_at < now.  Whatever ended within
        # the batch's span ended in this batch (a job ends once).
        start = min((e.now for e in events), default=now)

        def ended_here(rec: Any) -> bool:
            return not rec.job.state.active and rec.finished_at is not None and start <= rec.finished_at <= now

        for d in decisions:
            kind = type(d).__name__.lower()
            if kind != "wakeup":
                self.decisions.labels(kind).inc()
            rec = core.records.get(getattr(d, "job", ""))
            if rec is None or rec.external:
                continue
            if isinstance(d, Place) and not d.resumed and rec.first_start is not None and start <= rec.first_start <= now:
                self.wait.observe(max(0.0, now - rec.job.arrival))
            elif isinstance(d, (Reject, Release)) and ended_here(rec):
                if not any(isinstance(e, (JobFinished, JobCancelled)) and e.job == d.job for e in events):
                    self._ended(rec, "done" if rec.job.state is JobState.DONE else "failed")
        for e in events:
            if isinstance(e, (JobFinished, JobCancelled)):
                rec = core.records.get(e.job)
                if rec is not None and not rec.external and ended_here(rec):
                    self._ended(rec, "cancelled" if isinstance(e, JobCancelled) else
                                "done" if rec.job.state is JobState.DONE else "failed")

    def _ended(self, rec: Any, how: str) -> None:
        self.finished.labels(how).inc()
        if how == "done":
            self.jct.observe(max(0.0, rec.finished_at - rec.job.arrival))

    def snapshot(self, view: dict[str, Any], core: SchedulerState, pending: Any, now: float) -> None:
        """The gauges for the next scrape (from the cluster view and the core, on the loop)."""
        by_code = dict(pending.by_code())
        unexplained = len(core.waiting) - sum(by_code.values())
        if unexplained > 0:
            by_code["Unexplained"] = unexplained
        waits = [now - r.job.arrival for r in core.waiting.values()]
        online = [n for n in view["nodes"] if n["status"] == "online"]
        agg = view.get("aggregation") or {}
        self.gauges = {
            "jobs": {"queued": sum(1 for r in core.waiting.values() if r.job.state is JobState.QUEUED),
                     "running": sum(1 for r in core.running.values() if not r.external),
                     "preempted": sum(1 for r in core.waiting.values() if r.job.state is JobState.PREEMPTED)},
            "queue": by_code, "wait_longest": max(waits) if waits else 0.0,
            "nodes": {"online": len(online), "offline": len(view["nodes"]) - len(online)},
            "gpus": view["gpus_total"], "gpus_allocated": view["gpus_allocated"],
            "cpus": view["cpus_total"], "cpus_allocated": view["cpus_allocated"],
            "lendable": view["memory_lendable_bytes"], "lent": view["memory_lent_bytes"],
            "promised": view.get("memory_promised_bytes", 0),
            "reclaimed": core.ledger.pool.stats().get("reclaimed_bytes", 0),
            "agg_servers": agg.get("servers", 0), "agg_pool": agg.get("pool_cores", 0.0),
            "agg_busy": agg.get("busy_cores", 0.0), "forecast": pending.forecast_seconds,
        }

    # --- the API's thread -------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    """The collector of the gauges (and the counter the core keeps) from the last snapshot."""

    def __init__(self, m: SchedulerMetrics) -> None:
        self.m = m

    def collect(self):
        m, g = self.m, self.m.gauges
        info = GaugeMetricFamily("dlshare_sched_info", "The scheduler service: its profile and version.",
                                 labels=["profile", "version"])
        info.add_metric([m.profile, m.version], 1)
        yield info
        if not g:
            return

        def labelled(name: str, doc: str, label: str, values: dict[str, float]) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=[label])
            for k, v in sorted(values.items()):
                fam.add_metric([k], v)
            return fam

        yield labelled("dlshare_sched_jobs", "Jobs by state now (queued, running, preempted).", "state", g["jobs"])
        queue = {"Resources": 0, "Priority": 0, **g["queue"]}  # the common reasons are always there
        yield labelled("dlshare_sched_queue_length", "Waiting jobs by the reason they wait.", "reason", queue)
        yield labelled("dlshare_sched_nodes", "Node daemons by status.", "status", g["nodes"])
        plain = (
            ("dlshare_sched_queue_wait_longest_seconds", "The longest a waiting job has waited since submission.",
             g["wait_longest"]),
            ("dlshare_sched_gpus", "GPUs on online nodes.", g["gpus"]),
            ("dlshare_sched_gpus_allocated", "GPUs jobs hold on online nodes.", g["gpus_allocated"]),
            ("dlshare_sched_cpus", "CPU cores on online nodes.", g["cpus"]),
            ("dlshare_sched_cpus_allocated", "CPU cores allocated to jobs on online nodes.", g["cpus_allocated"]),
            ("dlshare_sched_memory_lendable_bytes", "Memory the donors could lend (their telemetry).", g["lendable"]),
            ("dlshare_sched_memory_lent_bytes", "Memory the donors lend now (their telemetry).", g["lent"]),
            ("dlshare_sched_lent_memory_promised_bytes", "Lent memory the core promised to jobs.", g["promised"]),
            ("dlshare_sched_aggregation_servers", "Aggregation servers reporting.", g["agg_servers"]),
            ("dlshare_sched_aggregation_pool_cores", "Cores the aggregation servers' pools hold.", g["agg_pool"]),
            ("dlshare_sched_aggregation_busy_cores", "Cores' worth of reduction work demanded.", g["agg_busy"]),
        )
        for name, doc, value in plain:
            yield GaugeMetricFamily(name, doc, value=float(value))
        if g["forecast"] is not None:
            yield GaugeMetricFamily("dlshare_sched_forecast_duration_seconds",
                                    "What the last start-estimate replay of the queue took.", value=g["forecast"])
        yield CounterMetricFamily("dlshare_sched_lent_memory_reclaimed_bytes",
                                  "Promised lent memory taken back from jobs (donor reclaims, lost donors).",
                                  value=float(g["reclaimed"]))


__all__ = ["SchedulerMetrics"]
