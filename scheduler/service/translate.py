"""What nodes say, as the core's events: the service's half of "messages in, events out".

:class:`Translator` folds each node's telemetry into the live node table and
turns what the core must know into events, with no policy of its own:

* telemetry -> ``NodeReport`` when the node's resources or the jobs it lists
  as running changed, when it comes (back) online, and every ``report_s``
  while it runs jobs (the predictors' samples); the report carries the running
  jobs, so the core can tell a job that vanished (:mod:`scheduler.watch`) and
  one that runs where it should not;
* a job reported exited (its ``job_exit`` event, or ``exited`` in telemetry)
  -> the row's exit code and ``JobFinished`` (once, and only from the node the
  job runs on);
* a donor whose lendable memory (free plus lent) fell below what the core promised on it
  (it reclaimed memory for its own jobs) -> ``DonorReclaimed`` for the drop, before its report
  (:func:`donor_reclaim`);
* the retained ``offline`` state (a Last Will or a clean stop), or no
  telemetry for ``node_timeout_s`` while the other nodes reported -> ``NodeLost`` (a lost
  donor's lent memory is taken back by the core).

The core then decides (requeue, release, place elsewhere); the carrier turns
its decisions into rows and commands.  Everything here runs on the live loop's
thread and reads the core only to translate (which node a job runs on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from nodesvc.bus.messages import NodeTelemetry
from scheduler import DonorReclaimed, Event, JobFinished, JobSample, JobState, NodeLost, NodeReport, SchedulerState
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.nodes import LiveNode, apply_telemetry, core_node
from scheduler.service.stats import ServiceStats
from scheduler.service.store import JobStore

log = logging.getLogger("dlshare.sched.live")


def donor_reclaim(core: Any, node_id: str, lendable: int, now: float,
                  posted: int | None = None) -> DonorReclaimed | None:
    """``DonorReclaimed`` for a donor that can now lend only ``lendable`` bytes while the core has
    promised more on it; ``None`` when nothing promised is affected.  ``posted``: the capacity a
    reclaim posted before (not handled yet, or handled) left it, so a drop is posted once."""
    ns = core.nodes.get(node_id)
    if ns is None or not ns.alive:
        return None
    known = ns.node.lendable_bytes if posted is None else min(posted, ns.node.lendable_bytes)
    if core.ledger.pool.promised_on(node_id) <= lendable or known <= lendable:
        return None
    return DonorReclaimed(_eid(), now, node_id, int(known - max(0, lendable)))


class TranslatorHost(Protocol):
    """What the translator reads of the service (the live service is one): its core, store, node
    table, statistics, clocks and two settings; nothing else."""

    core: SchedulerState
    store: JobStore
    nodes: dict[str, LiveNode]
    stats: ServiceStats
    report_s: float  # a node's report reaches the core at least this often while it runs jobs
    node_timeout_s: float  # a node silent this long is lost

    def clock(self) -> float: ...  # wall time (the store's timestamps)
    def now(self) -> float: ...  # the core's time


class Translator:
    """Node messages -> core events (see the module docstring).  It shares the service's node
    table, store, core and clock; ``post`` queues an event for the next batch."""

    def __init__(self, svc: TranslatorHost, post: Callable[[Event], None]) -> None:
        self.svc = svc
        self.post = post
        self.exiting: set[str] = set()  # JobFinished posted, not yet handled (cleared after each batch)
        self.published: dict[str, float] = {}  # NodeReport stimulus_id -> when the node published it
        self.reclaimed_to: dict[str, int] = {}  # donor -> the capacity its last DonorReclaimed left it

    # --- telemetry ------------------------------------------------------------------------

    def on_telemetry(self, t: NodeTelemetry) -> None:
        svc = self.svc
        node = svc.nodes.setdefault(t.node, LiveNode(id=t.node))
        was_online = node.status == "online"
        now = svc.clock()
        apply_telemetry(node, t, now)
        if node.published_at is not None:
            svc.stats.telemetry_seen(now - node.published_at)
        if not was_online:
            svc.store.log_event("node_online", node=node.id, data={"cpus": node.cpu_count, "gpus": len(node.gpus)})
        self.report(node, force=not was_online)
        for job, (code, run_id) in node.exited().items():
            self.job_exited(node.id, job, code, "", run_id)

    def report(self, node: LiveNode, force: bool = False) -> None:
        """A NodeReport when the node's resources or its running jobs changed, or every ``report_s``."""
        svc, core = self.svc, self.svc.core
        n = core_node(node)
        # A donor that counts slabs reports its capacity exactly (a reclaim of a few slabs matters);
        # MemAvailable-based figures move all the time, so they count in 64 MiB steps.
        lend_key = n.lendable_bytes if node.lend_capacity_bytes is not None else n.lendable_bytes >> 26
        key = (n.gpus, n.cores, n.memory_bytes, lend_key, n.gpu_type)
        running = node.running
        now = svc.clock()
        ns = core.nodes.get(node.id)
        # Jobs the node confirmed it started that it does not list: the core must hear of them even
        # when the list itself did not change (a job that never showed up in telemetry).
        started = core.watch.started
        missing = frozenset(j for j in (ns.jobs if ns is not None else ())
                            if node.id in started.get(j, ()) and j not in running)
        changed = force or key != node.reported or running != node.reported_running or missing != node.reported_missing
        if not changed and (now - node.reported_at < svc.report_s or not running):
            return  # nothing new (an idle node's periodic report would carry no sample either)
        if ns is not None and ns.node.gpus != n.gpus and ns.jobs:
            log.warning("node %s now reports %d GPUs while running jobs; keeping %d", node.id, n.gpus, ns.node.gpus)
            return
        node.reported, node.reported_running, node.reported_missing, node.reported_at = key, running, missing, now
        # Measured utilisation of each running GPU job here (its GPUs' mean), for the predictors'
        # online update: the core learns a job type's solo utilisation from these samples.
        util = {g.index: (g.util_percent, g.memory_util_percent) for g in node.gpus}
        samples = {}
        for job in (ns.jobs if ns is not None else ()):
            rec = core.records.get(job)
            if rec is None or rec.job.state is not JobState.RUNNING:
                continue
            gpus = [g for sh in rec.shards if sh.node == node.id for g in sh.gpus]
            us = [util[g] for g in gpus if g in util and util[g][0] is not None]
            if us:
                mems = [m for _, m in us if m is not None]
                samples[job] = JobSample(sm_percent=sum(u for u, _ in us) / len(us),
                                         mem_percent=sum(mems) / len(mems) if mems else None)
        reclaim = donor_reclaim(core, n.id, n.lendable_bytes, svc.now(), self.reclaimed_to.get(n.id))
        if n.lendable_bytes > self.reclaimed_to.get(n.id, n.lendable_bytes):
            self.reclaimed_to.pop(n.id, None)  # it lends more again: the core hears it in the report
        if reclaim is not None:
            self.reclaimed_to[n.id] = n.lendable_bytes
            svc.store.log_event("donor_reclaimed", node=n.id, data={"bytes": reclaim.bytes})
            log.info("donor %s took %d lent bytes back", n.id, reclaim.bytes)
            self.post(reclaim)
        ev = NodeReport(_eid(), svc.now(), n, gpu_util=tuple(float(g.util_percent or 0.0) for g in node.gpus),
                        cpu_percent=node.cpu_percent, memory_available_bytes=node.memory_available_bytes,
                        jobs=samples, running=running)
        if node.published_at is not None:
            self.published[ev.stimulus_id] = node.published_at
        self.post(ev)

    # --- node state -----------------------------------------------------------------------

    def on_node_state(self, node_id: str, state: dict[str, Any]) -> None:
        node = self.svc.nodes.setdefault(node_id, LiveNode(id=node_id))
        status = state.get("status")
        if status == "offline" and node.status != "offline":
            self.node_lost(node, "went offline (its Last Will or its shutdown)")
        elif status == "online" and node.status == "offline":
            node.status = "unknown"  # back once its telemetry arrives

    def node_lost(self, node: LiveNode, why: str) -> None:
        svc = self.svc
        node.status = "offline"
        node.reported = node.reported_running = None
        node.reported_missing = frozenset()
        ns = svc.core.nodes.get(node.id)
        jobs = sorted(ns.jobs) if ns is not None else []
        svc.store.log_event("node_offline", node=node.id, data={"why": why, "jobs": jobs})
        log.warning("node %s %s; the core requeues its %d jobs", node.id, why, len(jobs))
        if ns is not None and ns.alive:
            self.post(NodeLost(_eid(), svc.now(), node.id))

    def check_stale(self, now: float) -> None:
        """Nodes silent for ``node_timeout_s`` while other nodes spoke are lost.  Silence is measured
        against the freshest telemetry the loop has taken in, not against the clock alone: when
        the loop falls behind its messages, every node looks silent to it, and none is lost for
        that (a node alone in the cluster then relies on its Last Will)."""
        limit = self.svc.node_timeout_s
        online = [n for n in self.svc.nodes.values() if n.status == "online" and n.last_seen]
        if len(online) < 2:
            return
        freshest = min(now, max(n.last_seen for n in online))
        for node in online:
            if freshest - node.last_seen > limit:
                self.node_lost(node, f"sent no telemetry for {limit:g}s while the other nodes did")

    # --- job exits ------------------------------------------------------------------------

    def on_event(self, node_id: str, ev: dict[str, Any]) -> None:
        if ev.get("event") == "job_exit" and isinstance(ev.get("job"), str):
            code = ev.get("exit_code")
            run_id = ev.get("run_id")
            self.job_exited(node_id, ev["job"], code if isinstance(code, int) and not isinstance(code, bool) else None,
                            "oom-killed" if ev.get("oom_killed") else "", run_id if isinstance(run_id, str) else "")

    def job_exited(self, node_id: str, job_id: str, code: int | None, why: str, run_id: str = "") -> None:
        """The job's processes on ``node_id`` exited: its row, then ``JobFinished`` (once).  ``run_id``
        (the placement's id, sent with ``run``) names the run that exited: the exit of an older run
        on the same node (stopped when its node was lost and placed there again) ends nothing."""
        svc = self.svc
        rec = svc.core.records.get(job_id)
        if (rec is None or rec.job.state is not JobState.RUNNING or rec.external or job_id in self.exiting
                or node_id not in {sh.node for sh in rec.shards}):
            return  # already handled (the event and the telemetry both say so), or a run it has left
        if run_id and run_id != rec.placed_by:
            log.info("job %s: an exit on %s of an earlier run (%s) ends nothing", job_id, node_id, run_id)
            return
        self.exiting.add(job_id)
        ok = code == 0
        reason = None if ok else (why or f"exited with code {code}")
        svc.store.update_job(job_id, event="exited", node=node_id, event_data={"exit_code": code, "why": why},
                             state="done" if ok else "failed", exit_code=code, finished_at=svc.clock(),
                             reason=reason, allocation=None, attained_service=rec.service(svc.now()),
                             only_active=True)
        self.post(JobFinished(_eid(), svc.now(), job_id, failed=not ok, reason=reason or "", node=node_id))
