"""The pure scheduler core: :class:`SchedulerState`.

``SchedulerState.handle(*events) -> list[Decision]`` is the only way its state
changes.  It reads no clock (time is ``event.now``), does no I/O and draws
randomness only from the ``random.Random`` handed in.  The simulator, the live
service and the Kubernetes extender all drive this same object.

One pass per ``handle`` call:

* Non-preemptive orders (FIFO): start queued jobs in key order while they fit
  (with ``backfill``, later jobs may start when the head cannot).
* Preemptive orders (LAS, 2D-LAS, Gittins, SRTF): on a :class:`Tick` the core
  picks the jobs that should hold the GPUs (in key order, greedily, up to the
  cluster's GPUs), preempts running jobs outside that set only where their GPUs
  are needed, and starts the rest.  Other events only fill free GPUs.  While
  jobs wait, the core asks for the next Tick with a :class:`Wakeup`.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scheduler.events import (
    Allocate, Decision, Event, JobArrived, JobCancelled, JobFinished, NodeLost, NodeReport, Place,
    PlacementFailed, Reject, Tick,
)
from scheduler.framework import Candidate, Context, NodeState
from scheduler.model import Allocation, Job, JobRecord, JobState, Node, Shard
from scheduler.passes import SchedulingPasses
from scheduler.profile import Profile, load_profile


class SchedulerError(ValueError):
    """An event the core cannot apply (unknown job, duplicate id).  State is unchanged."""


class SchedulerState(SchedulingPasses):
    """The scheduler's state machine (see the module docstring).

    ``profile``: a :class:`Profile`, a packaged profile name or a TOML path.
    ``nodes``: the initial cluster (more nodes arrive with :class:`NodeReport`).
    ``predictors``: a :class:`scheduler.predictors.Predictors` (default: the
    uninformed one, which learns online from node reports).
    ``rng``: the only source of randomness (seeded; default ``Random(0)``).
    """

    def __init__(self, profile: Profile | str | Path, nodes: Iterable[Node] = (), *,
                 predictors: Any = None, rng: random.Random | None = None) -> None:
        from scheduler.predictors import Predictors

        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.order = self.profile.build_order()
        self.filters = self.profile.build_filters()
        self.scores = self.profile.build_scores()
        self.allocator = self.profile.build_allocator()
        self.predictors = predictors if predictors is not None else Predictors.default()
        self.rng = rng if rng is not None else random.Random(0)
        self.records: dict[str, JobRecord] = {}
        self.nodes: dict[str, NodeState] = {}
        self.waiting: dict[str, JobRecord] = {}  # queued or preempted, insertion-ordered
        self.running: dict[str, JobRecord] = {}
        self._wait_key: dict[str, Any] = {}
        self._wait_order: list[tuple[Any, str]] = []  # (key, id) of waiting jobs, kept sorted
        self._class: dict[str, tuple[str, int, float, int]] = {}
        self.share_slots = 0  # GPUs a newcomer could join (see _slot)
        self._by_free: dict[int, dict[str, None]] = {}  # free GPU count -> nodes (ordered set)
        self.total_gpus = 0
        self.free_gpus = 0
        self.max_node_gpus = 0
        self.now = 0.0
        self._wakeup_at: float | None = None
        self._incompatible: set[frozenset[str]] = set()
        for n in nodes:
            self._add_node(n)

    # ------------------------------------------------------------ public API

    def handle(self, *events: Event) -> list[Decision]:
        """Apply ``events`` in order, then run one scheduling pass.

        An event that cannot be applied raises :class:`SchedulerError` before it
        changes anything; events earlier in the same call stay applied but no
        pass runs, so a live shell should hand in one event per call (the
        simulator batches events that share a timestamp)."""
        out: list[Decision] = []
        full_pass = False
        cause = ""
        for ev in events:
            if ev.now < self.now - 1e-9:
                raise SchedulerError(f"event {ev.id}: time went backwards ({ev.now} < {self.now})")
            before = self.now
            self.now = max(self.now, ev.now)
            cause = ev.id
            try:
                full_pass |= self._apply(ev, out)
            except SchedulerError:
                self.now = before
                raise
        if events:
            self._schedule(cause, full_pass or not self.order.preemptive, out)
        return out

    def job(self, job_id: str) -> JobRecord:
        try:
            return self.records[job_id]
        except KeyError:
            raise SchedulerError(f"unknown job {job_id!r}") from None

    def queue(self) -> list[JobRecord]:
        """Waiting jobs in the order the profile would start them now."""
        ctx = self._ctx()
        return sorted(self.waiting.values(), key=lambda r: self.order.key(r, ctx))

    def context(self) -> Context:
        """A plugin context for the current state (for explaining and for the extender)."""
        return self._ctx()

    def candidates(self, job: Job, node_ids: Iterable[str] | None = None) -> list[tuple[Candidate, float]]:
        """Feasible candidates for a (possibly unsubmitted) job with their
        weighted scores, best first: what the Kubernetes extender's filter and
        prioritize answer with.  Changes nothing."""
        rec = self.records.get(job.id) or JobRecord(job=job, queued_since=self.now)
        ctx = self._ctx()
        allowed = set(node_ids) if node_ids is not None else None
        cands = self._candidates(rec, ctx, limit=False, allowed=allowed)
        cands = [c if c.gpus else Candidate(c.node, c.node.free_indices()[:job.gpus], (), c.more) for c in cands]
        return self._rank(rec, cands, ctx)

    def explain(self, job: Job, node_ids: Iterable[str] | None = None) -> dict[str, str]:
        """Why ``job`` cannot go on each node that has no feasible placement for
        it (node id -> reason), as the Kubernetes extender's ``FailedNodes``
        wants.  Nodes that would take it are absent.  Changes nothing."""
        rec = self.records.get(job.id) or JobRecord(job=job, queued_since=self.now)
        ctx = self._ctx()
        ids = list(node_ids) if node_ids is not None else list(self.nodes)
        cands = self._candidates(rec, ctx, limit=False, allowed=set(ids))
        ok = {c.node.node.id for c in cands} | {ns.node.id for c in cands for ns, _ in c.more}
        out: dict[str, str] = {}
        for nid in ids:
            if nid in ok:
                continue
            ns = self.nodes.get(nid)
            if ns is None:
                out[nid] = "unknown node"
            elif not ns.alive:
                out[nid] = "node offline"
            elif job.gpus > ns.node.gpus and job.gpus > self.free_gpus:
                out[nid] = f"needs {job.gpus} GPUs; {self.free_gpus} free in the cluster"
            elif ns.free_gpus < job.gpus and not self._share_ok(rec):
                out[nid] = f"needs {job.gpus} free GPUs, node has {ns.free_gpus}"
            else:
                cand = Candidate(ns, ns.free_indices()[:job.gpus])
                if not self._fits_resources(rec, cand, ctx):
                    out[nid] = "not enough CPU or memory for the job's minimum"
                else:
                    reasons = [r for f in self.filters if (r := f.filter(rec, cand, ctx))]
                    out[nid] = reasons[0] if reasons else "no GPU it may share"
        return out

    # ------------------------------------------------------------ events

    def _apply(self, ev: Event, out: list[Decision]) -> bool:
        """Apply one event; returns True when it asks for a full (preemptive) pass."""
        if isinstance(ev, JobArrived):
            job = Job.from_dict(ev.job.to_dict())
            if job.id in self.records:
                raise SchedulerError(f"event {ev.id}: duplicate job id {job.id!r}")
            job.state = JobState.QUEUED
            job.attained_service = max(0.0, job.attained_service)
            rec = JobRecord(job=job, queued_since=ev.now)
            self.records[job.id] = rec
            if job.gpus > self.max_node_gpus and self.max_node_gpus and job.gpus > self.total_gpus:
                job.state = JobState.FAILED
                rec.finished_at = ev.now
                out.append(Reject(ev.id, job.id, f"needs {job.gpus} GPUs, the cluster has {self.total_gpus}"))
                return False
            self._enqueue(rec)
            return False
        if isinstance(ev, Tick):
            return True
        if isinstance(ev, (JobFinished, JobCancelled)):
            rec = self.job(ev.job)
            if not rec.job.state.active:
                raise SchedulerError(f"event {ev.id}: job {ev.job!r} already {rec.job.state.value}")
            failed = isinstance(ev, JobCancelled) or ev.failed
            self._end(rec, JobState.FAILED if failed else JobState.DONE, ev.id, out)
            return False
        if isinstance(ev, PlacementFailed):
            rec = self.job(ev.job)
            if rec.job.state is not JobState.RUNNING:
                raise SchedulerError(f"event {ev.id}: job {ev.job!r} is not running")
            shared = self._co_residents(rec)
            if shared:
                for other in shared:
                    self._incompatible.add(frozenset((rec.job.job_type, self.records[other].job.job_type)))
            self._stop(rec, ev.id, out, requeue=True)
            return False
        if isinstance(ev, NodeReport):
            self._report(ev)
            return False
        if isinstance(ev, NodeLost):
            ns = self.nodes.get(ev.node)
            if ns is None:
                raise SchedulerError(f"event {ev.id}: unknown node {ev.node!r}")
            if ns.alive:
                for jid in list(ns.jobs):
                    self._stop(self.records[jid], ev.id, out, requeue=True)
                self._set_alive(ns, False)
            return False
        raise SchedulerError(f"event {getattr(ev, 'id', '?')}: unknown event type {type(ev).__name__}")

    def _report(self, ev: NodeReport) -> None:
        ns = self.nodes.get(ev.node.id)
        if ns is None:
            self._add_node(ev.node)
            ns = self.nodes[ev.node.id]
        else:
            if ev.node.gpus != ns.node.gpus and ns.jobs:
                raise SchedulerError(f"event {ev.id}: node {ev.node.id} changed its GPU count while running jobs")
            if ev.node.gpus != ns.node.gpus:
                self._set_alive(ns, False)
                del self.nodes[ev.node.id]
                self._add_node(ev.node)
                ns = self.nodes[ev.node.id]
            else:
                ns.node = ev.node
            if not ns.alive:
                self._set_alive(ns, True)
        ns.gpu_util = tuple(ev.gpu_util)
        ns.cpu_percent = ev.cpu_percent
        ns.memory_available_bytes = ev.memory_available_bytes
        for jid, sample in ev.jobs.items():
            rec = self.records.get(jid)
            if rec is None or rec.job.state is not JobState.RUNNING:
                continue
            others = tuple(self.records[o].job.job_type for o in self._co_residents(rec))
            if sample.speed is not None:
                rec.speed = sample.speed
            self.predictors.observe(rec.job.job_type, others, sample)

    # ------------------------------------------------------------ nodes

    def _add_node(self, node: Node) -> None:
        if node.id in self.nodes:
            raise SchedulerError(f"duplicate node {node.id!r}")
        ns = NodeState.fresh(node)
        self.nodes[node.id] = ns
        self.total_gpus += node.gpus
        self.free_gpus += node.gpus
        self.max_node_gpus = max(self.max_node_gpus, node.gpus)
        self._by_free.setdefault(node.gpus, {})[node.id] = None

    def _set_alive(self, ns: NodeState, alive: bool) -> None:
        if ns.alive == alive:
            return
        slots = sum(self._slot(res) for res in ns.residents)
        ns.alive = alive
        sign = 1 if alive else -1
        self.share_slots += sign * slots
        self.total_gpus += sign * ns.node.gpus
        self.free_gpus += sign * ns.free_gpus
        if alive:
            self._by_free.setdefault(ns.free_gpus, {})[ns.node.id] = None
        else:
            self._by_free.get(ns.free_gpus, {}).pop(ns.node.id, None)

    def _set_free(self, ns: NodeState, free: int) -> None:
        if ns.alive:
            self._by_free[ns.free_gpus].pop(ns.node.id, None)
            self._by_free.setdefault(free, {})[ns.node.id] = None
            self.free_gpus += free - ns.free_gpus
        ns.free_gpus = free

    # ------------------------------------------------------------ job moves

    def _enqueue(self, rec: JobRecord) -> None:
        jid = rec.job.id
        self.waiting[jid] = rec
        rec.queued_since = self.now
        # A waiting job's service does not grow, so its key is fixed until it runs.
        key = self.order.key(rec, self._ctx())
        self._wait_key[jid] = key
        bisect.insort(self._wait_order, (key, jid))
        job = rec.job
        self._class[jid] = (job.job_type, job.gpus, job.cpus, job.memory_bytes)

    def _dequeue(self, jid: str) -> None:
        self.waiting.pop(jid, None)
        key = self._wait_key.pop(jid, None)
        if key is not None:
            i = bisect.bisect_left(self._wait_order, (key, jid))
            if i < len(self._wait_order) and self._wait_order[i][1] == jid:
                del self._wait_order[i]

    def _slot(self, res: list[str]) -> int:
        """1 when a GPU with these residents could take one more job, else 0."""
        if not res or len(res) >= self.profile.max_share or self.profile.share == "never":
            return 0
        limit = self.profile.share_max_gpus
        return int(all(self.records[o].job.gpus <= limit for o in res))

    def _co_residents(self, rec: JobRecord) -> list[str]:
        seen: dict[str, None] = {}
        for sh in rec.shards:
            ns = self.nodes[sh.node]
            for g in sh.gpus:
                for o in ns.residents[g]:
                    if o != rec.job.id:
                        seen[o] = None
        return list(seen)

    def _start(self, rec: JobRecord, cand: Candidate, cause: str, out: list[Decision]) -> None:
        job = rec.job
        shards = [(cand.node, cand.gpus), *cand.more]
        resumed = job.state is JobState.PREEMPTED
        touched = []
        for ns, gpus in shards:
            newly = 0
            for g in gpus:
                if not ns.residents[g]:
                    newly += 1
                before = self._slot(ns.residents[g]) if ns.alive else 0
                ns.residents[g].append(job.id)
                self.share_slots += (self._slot(ns.residents[g]) if ns.alive else 0) - before
            ns.jobs[job.id] = len(gpus)
            self._set_free(ns, ns.free_gpus - newly)
            touched.append(ns)
        rec.shards = tuple(Shard(ns.node.id, tuple(gpus)) for ns, gpus in shards)
        self._dequeue(job.id)
        self.running[job.id] = rec
        job.state = JobState.RUNNING
        rec.run_since = self.now
        rec.queueing_delay += self.now - rec.queued_since
        if rec.first_start is None:
            rec.first_start = self.now
        out.append(Place(cause, job.id, rec.shards, tuple(cand.residents), resumed))
        for ns in touched:
            self._reallocate(ns, cause, out)

    def _release(self, rec: JobRecord) -> list[NodeState]:
        job = rec.job
        touched = []
        for sh in rec.shards:
            ns = self.nodes[sh.node]
            freed = 0
            for g in sh.gpus:
                res = ns.residents[g]
                if job.id in res:
                    before = self._slot(res) if ns.alive else 0
                    res.remove(job.id)
                    self.share_slots += (self._slot(res) if ns.alive else 0) - before
                    if not res:
                        freed += 1
            ns.jobs.pop(job.id, None)
            self._set_free(ns, ns.free_gpus + freed)
            touched.append(ns)
        if rec.run_since is not None:
            job.attained_service += job.gpus * max(0.0, self.now - rec.run_since)
            rec.run_since = None
        rec.shards = ()
        rec.allocation = {}
        self.running.pop(job.id, None)
        return touched

    def _stop(self, rec: JobRecord, cause: str, out: list[Decision], requeue: bool, reason: str = "") -> None:
        touched = self._release(rec)
        if requeue:
            rec.job.state = JobState.PREEMPTED
            rec.preemptions += 1
            self._enqueue(rec)
        for ns in touched:
            if ns.alive:
                self._reallocate(ns, cause, out)

    def _end(self, rec: JobRecord, state: JobState, cause: str, out: list[Decision]) -> None:
        if rec.job.state is JobState.RUNNING:
            touched = self._release(rec)
        else:
            touched = []
            self._dequeue(rec.job.id)
        rec.job.state = state
        rec.finished_at = self.now
        hook = getattr(self.order, "observe_finished", None)
        if hook is not None and state is JobState.DONE:
            hook(rec, self._ctx())
        for ns in touched:
            if ns.alive:
                self._reallocate(ns, cause, out)

    def _reallocate(self, ns: NodeState, cause: str, out: list[Decision]) -> None:
        ctx = self._ctx()
        dc = dm = 0.0
        for jid, n in ns.jobs.items():
            d = self.allocator.demand(self.records[jid], ns, n, ctx)
            dc += d.cpus
            dm += d.memory_bytes
        ns.demand_cpus, ns.demand_memory = dc, dm
        split = self.allocator.split(ns, ctx)
        for jid, alloc in split.items():
            rec = self.records[jid]
            old = rec.allocation.get(ns.node.id)
            if old is None or abs(old.cpus - alloc.cpus) > 1e-9 or old.memory_bytes != alloc.memory_bytes:
                rec.allocation[ns.node.id] = alloc
                out.append(Allocate(cause, jid, ns.node.id, alloc.cpus, alloc.memory_bytes))

    # ------------------------------------------------------------ placement

    def _ctx(self) -> Context:
        return Context(now=self.now, records=self.records, nodes=self.nodes, predictors=self.predictors,
                       rng=self.rng, total_gpus=self.total_gpus, free_gpus=self.free_gpus)

    # ------------------------------------------------------------ summaries

    def allocation_of(self, job_id: str) -> dict[str, Allocation]:
        return dict(self.job(job_id).allocation)
