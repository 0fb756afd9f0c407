"""The pure scheduler core: :class:`SchedulerState`.

``SchedulerState.handle(*events) -> list[Decision]`` is the only way its state
changes.  It reads no clock (time is ``event.now``), does no I/O and draws
randomness only from the ``random.Random`` handed in.  The simulator, the live
service and the Kubernetes extender all drive this same object.

It is composed of two parts it holds: the :class:`~scheduler.ledger.Ledger`
(the books: jobs, nodes, indexes, and the moves that keep them consistent) and
the :class:`~scheduler.passes.SchedulingPasses` (the decisions).  This module
applies events to the ledger and runs one pass per ``handle`` call:

* Non-preemptive orders (FIFO): start queued jobs in key order while they fit
  (with ``backfill``, later jobs may start when the head cannot).
* Preemptive orders (LAS, 2D-LAS, Gittins, SRTF): on a :class:`Tick` the core
  picks the jobs that should hold the GPUs (in key order, greedily, up to the
  cluster's GPUs), preempts running jobs outside that set only where their GPUs
  are needed, and starts the rest.  Other events only fill free GPUs.  While
  jobs wait, the core asks for the next Tick with a :class:`Wakeup`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scheduler.events import (
    Decision, DonorReclaimed, Event, JobArrived, JobBound, JobCancelled, JobFinished, JobStarted, NodeLost, NodeReport, PlacementFailed,
    Reject, Release, Tick, Wakeup,
)
from scheduler.fairshare import never_reason, queued_reason
from scheduler.framework import Candidate, Context, NodeState
from scheduler.ledger import Ledger, SchedulerError
from scheduler.model import Allocation, Job, JobRecord, JobState, Node
from scheduler.passes import SchedulingPasses
from scheduler.profile import Profile, load_profile
from scheduler.watch import Watch, WatchRules


class SchedulerState:
    """The scheduler's state machine (see the module docstring).

    ``profile``: a :class:`Profile`, a packaged profile name or a TOML path.
    ``nodes``: the initial cluster (more nodes arrive with :class:`NodeReport`).
    ``predictors``: a :class:`scheduler.predictors.Predictors` (default: the
    uninformed one, which learns online from node reports).
    ``rng``: the only source of randomness (seeded; default ``Random(0)``).
    ``rules``: the :class:`~scheduler.watch.WatchRules` a live cluster needs (start
    backoff, vanished jobs); off by default.
    """

    def __init__(self, profile: Profile | str | Path, nodes: Iterable[Node] = (), *,
                 predictors: Any = None, rng: random.Random | None = None, rules: WatchRules | None = None) -> None:
        from scheduler.predictors import Predictors

        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.order = self.profile.build_order()
        self.filters = self.profile.build_filters()
        self.scores = self.profile.build_scores()
        self.allocator = self.profile.build_allocator()
        self.predictors = predictors if predictors is not None else Predictors.default()
        self.rng = rng if rng is not None else random.Random(0)
        self.watch = Watch(rules)
        self.ledger = Ledger(self.profile, self.order, self.allocator, self.predictors, self.rng, self.watch)
        self.passes = SchedulingPasses(self.ledger, self.profile, self.order, self.filters, self.scores,
                                       self.allocator)
        for n in nodes:
            self.ledger.add_node(n)

    # ------------------------------------------------------------ the books, read-only

    @property
    def now(self) -> float:
        """The time of the latest event handled."""
        return self.ledger.now

    @property
    def records(self) -> dict[str, JobRecord]:
        """Every job the core has seen: id -> record."""
        return self.ledger.records

    @property
    def nodes(self) -> dict[str, NodeState]:
        return self.ledger.nodes

    @property
    def waiting(self) -> dict[str, JobRecord]:
        """Queued or preempted jobs."""
        return self.ledger.waiting

    @property
    def running(self) -> dict[str, JobRecord]:
        return self.ledger.running

    @property
    def total_gpus(self) -> int:
        """GPUs on alive nodes."""
        return self.ledger.total_gpus

    @property
    def free_gpus(self) -> int:
        return self.ledger.free_gpus

    # ------------------------------------------------------------ public API

    def handle(self, *events: Event) -> list[Decision]:
        """Apply ``events`` in order, then run one scheduling pass.

        An event that cannot be applied raises :class:`SchedulerError` before it
        changes anything; events earlier in the same call stay applied but no
        pass runs, so a live shell should hand in one event per call (the
        simulator batches events that share a timestamp)."""
        out: list[Decision] = []
        full_pass = False
        stimulus_id = ""
        led = self.ledger
        for ev in events:
            if ev.now < led.now - 1e-9:
                raise SchedulerError(f"event {ev.stimulus_id}: time went backwards ({ev.now} < {led.now})")
            before = led.now
            led.now = max(led.now, ev.now)
            stimulus_id = ev.stimulus_id
            try:
                full_pass |= self._apply(ev, out)
            except SchedulerError:
                led.now = before
                raise
        if events:
            self._pass(stimulus_id, full_pass, out)
        return out

    def handle_batch(self, events: Iterable[Event]) -> tuple[list[Decision], list[tuple[str, str]]]:
        """What a live shell calls: apply every event that can be applied, skip the others
        (each leaves the state as it was), then run one pass.  Returns the decisions and the
        refused events as (stimulus_id, reason).  A replay of the same batches gives the same."""
        out: list[Decision] = []
        refused: list[tuple[str, str]] = []
        full_pass = False
        stimulus_id = ""
        led = self.ledger
        for ev in events:
            if ev.now < led.now - 1e-9:
                refused.append((ev.stimulus_id, f"time went backwards ({ev.now} < {led.now})"))
                continue
            before = led.now
            led.now = max(led.now, ev.now)
            try:
                full_pass |= self._apply(ev, out)
            except SchedulerError as exc:
                led.now = before
                refused.append((ev.stimulus_id, str(exc)))
                continue
            stimulus_id = ev.stimulus_id
        if stimulus_id:
            self._pass(stimulus_id, full_pass, out)
        return out, refused

    def _pass(self, stimulus_id: str, full_pass: bool, out: list[Decision]) -> None:
        """The watched deadlines that are due, one scheduling pass, and the next Wakeup."""
        vanished, expired = self.watch.due(self.now)
        for jid, node in vanished:
            rec = self.records.get(jid)
            if rec is not None and rec.job.state is JobState.RUNNING:
                self.ledger.end(rec, JobState.FAILED, stimulus_id, out,
                                f"node {node} no longer reports the job (for {self.watch.rules.vanish_after_s:g} s)")
        for jid in expired:
            rec = self.records.get(jid)
            if rec is not None and rec.job.state is JobState.RUNNING:
                self.ledger.end(rec, JobState.DONE, stimulus_id, out, "hold ended", stop=False)
            self.watch.holds.pop(jid, None)
        self.passes.schedule(stimulus_id, full_pass or not self.order.preemptive, out)
        self.ledger.offer_freed(stimulus_id, out)
        at = self.watch.wakeup(self.now)
        if at is not None:
            out.append(Wakeup(stimulus_id, at))

    def compact(self) -> int:
        """Forget the jobs that are over (done or failed), which no decision reads again:
        the books then grow with the active jobs, not with history.  Returns how many."""
        gone = [jid for jid, rec in self.records.items() if not rec.job.state.active]
        for jid in gone:
            del self.records[jid]
            self.ledger.job_class.pop(jid, None)
        return len(gone)

    def job(self, job_id: str) -> JobRecord:
        return self.ledger.job(job_id)

    def queue(self) -> list[JobRecord]:
        """Waiting jobs in the order the profile would start them now (fair share between their
        owners first, when the profile has it)."""
        ctx = self.ledger.context()
        return sorted(self.waiting.values(), key=lambda r: self.ledger.sort_key(r, ctx))

    def quota_reason(self, job: Job) -> str:
        """Why ``job`` may not start now for its owner's quota (GPUs in use, lent memory);
        "" when it may.  Changes nothing."""
        return self.ledger.quota_reason(job)

    def fair_share(self) -> list[dict[str, Any]]:
        """Per owner with jobs in the system (account, user): decayed GPU-seconds, shares, usage
        over share, Slurm's factor ``2^(-usage/share)`` and the level the order uses now; empty
        when the profile does not share between users."""
        fair = self.ledger.fair
        return fair.report(self.now) if fair is not None else []

    def context(self) -> Context:
        """A plugin context for the current state (for explaining and for the extender)."""
        return self.ledger.context()

    def candidates(self, job: Job, node_ids: Iterable[str] | None = None) -> list[tuple[Candidate, float]]:
        """Feasible candidates for a (possibly unsubmitted) job with their
        weighted scores, best first: what the Kubernetes extender's filter and
        prioritize answer with.  Changes nothing."""
        rec = self.records.get(job.id) or JobRecord(job=job, queued_since=self.now)
        if self.ledger.quota_reason(job):
            return []  # its owner is at a limit: no node may take it now (explain says why)
        ctx = self.ledger.context()
        allowed = set(node_ids) if node_ids is not None else None
        cands = self.passes.candidates(rec, ctx, limit=False, allowed=allowed)
        cands = [c if c.gpus else Candidate(c.node, c.node.free_indices()[:job.gpus], (), c.more) for c in cands]
        return self.passes.rank(rec, cands, ctx)

    def explain(self, job: Job, node_ids: Iterable[str] | None = None) -> dict[str, str]:
        """Why ``job`` cannot go on each node that has no feasible placement for
        it (node id -> reason), as the Kubernetes extender's ``FailedNodes``
        wants.  Nodes that would take it are absent.  Changes nothing."""
        rec = self.records.get(job.id) or JobRecord(job=job, queued_since=self.now)
        ids = list(node_ids) if node_ids is not None else list(self.nodes)
        over = self.ledger.quota_reason(job)
        if over:  # the same on every node: the owner's limit, not the node, keeps it waiting
            return {nid: over for nid in ids}
        ctx = self.ledger.context()
        cands = self.passes.candidates(rec, ctx, limit=False, allowed=set(ids))
        ok = {c.node.node.id for c in cands} | {ns.node.id for c in cands for ns, _ in c.more}
        free_gpus = self.free_gpus
        out: dict[str, str] = {}
        for nid in ids:
            if nid in ok:
                continue
            ns = self.nodes.get(nid)
            if ns is None:
                out[nid] = "unknown node"
            elif not ns.alive:
                out[nid] = "node offline"
            elif job.gpus and not ns.node.gpus:
                out[nid] = f"needs {job.gpus} GPUs; the node has none"
            elif job.gpus > ns.node.gpus and job.gpus > free_gpus:
                out[nid] = f"needs {job.gpus} GPUs; {free_gpus} free in the cluster"
            elif ns.free_gpus < job.gpus and not self.passes.share_ok(rec):
                out[nid] = f"needs {job.gpus} free GPUs, node has {ns.free_gpus}"
            elif job.remote_memory_bytes > self.ledger.pool.total_free():
                out[nid] = (f"needs {job.remote_memory_bytes} bytes of lent memory; "
                            f"{self.ledger.pool.total_free()} are free at the donors")
            else:
                cand = Candidate(ns, ns.free_indices()[:job.gpus])
                if job.cpu_only and not self.passes.fits_resources(rec, cand, ctx):
                    out[nid] = (f"needs {job.cpus:g} cores and {job.memory_bytes} bytes; "
                                f"{max(0.0, ns.node.cores - ns.demand_cpus):g} cores and "
                                f"{max(0, int(ns.node.memory_bytes - ns.demand_memory))} bytes are not promised")
                elif not self.passes.fits_resources(rec, cand, ctx):
                    out[nid] = "not enough CPU or memory for the job's minimum"
                else:
                    reasons = [r for f in self.filters if (r := f.filter(rec, cand, ctx))]
                    out[nid] = reasons[0] if reasons else "no GPU it may share"
        return out

    def allocation_of(self, job_id: str) -> dict[str, Allocation]:
        return dict(self.job(job_id).allocation)

    # ------------------------------------------------------------ events

    def _apply(self, ev: Event, out: list[Decision]) -> bool:
        """Apply one event; returns True when it asks for a full (preemptive) pass."""
        if isinstance(ev, JobArrived):
            job = Job.from_dict(ev.job.to_dict())
            if job.id in self.records:
                raise SchedulerError(f"event {ev.stimulus_id}: duplicate job id {job.id!r}")
            job.state = JobState.QUEUED
            job.attained_service = max(0.0, job.attained_service)
            rec = JobRecord(job=job, queued_since=ev.now)
            why = self._never_fits(job)
            if not why and self.ledger.quota is not None:
                why = queued_reason(job, self.ledger.quota, self.ledger.owners)
            self.records[job.id] = rec
            if why:
                job.state = JobState.FAILED
                rec.finished_at = ev.now
                out.append(Reject(ev.stimulus_id, job.id, why))
                return False
            self.ledger.enqueue(rec)
            return False
        if isinstance(ev, Tick):
            return True
        if isinstance(ev, (JobFinished, JobCancelled)):
            rec = self.job(ev.job)
            if not rec.job.state.active:
                raise SchedulerError(f"event {ev.stimulus_id}: job {ev.job!r} already {rec.job.state.value}")
            if isinstance(ev, JobFinished) and ev.node and (
                    rec.job.state is not JobState.RUNNING or ev.node not in {sh.node for sh in rec.shards}):
                raise SchedulerError(f"event {ev.stimulus_id}: job {ev.job!r} does not run on node {ev.node!r}")
            if isinstance(ev, JobCancelled):
                self.ledger.end(rec, JobState.FAILED, ev.stimulus_id, out, ev.reason)
            else:  # it exited where it ran; a job spread over nodes may still run on the others
                self.ledger.end(rec, JobState.FAILED if ev.failed else JobState.DONE, ev.stimulus_id, out, ev.reason,
                                stop=len(rec.shards) > 1)
            return False
        if isinstance(ev, PlacementFailed):
            rec = self.job(ev.job)
            if rec.job.state is not JobState.RUNNING or rec.external:
                raise SchedulerError(f"event {ev.stimulus_id}: job {ev.job!r} is not running")
            if ev.place_id and ev.place_id != rec.placed_by:
                raise SchedulerError(f"event {ev.stimulus_id}: job {ev.job!r} was placed again since {ev.place_id}")
            shared = self.ledger.co_residents(rec)
            if shared:
                for other in shared:
                    self.ledger.incompatible.add(frozenset((rec.job.job_type, self.records[other].job.job_type)))
            self.ledger.stop(rec, ev.stimulus_id, out, f"start failed: {ev.reason}" if ev.reason else "start failed")
            self.watch.on_placement_failed(rec.job.id, ev.now)
            return False
        if isinstance(ev, JobStarted):
            rec = self.job(ev.job)
            if (rec.job.state is not JobState.RUNNING or rec.external or ev.node not in {sh.node for sh in rec.shards}
                    or (ev.place_id and ev.place_id != rec.placed_by)):
                raise SchedulerError(f"event {ev.stimulus_id}: job {ev.job!r} is not placed on node {ev.node!r}"
                                     + (f" by {ev.place_id}" if ev.place_id else ""))
            self.watch.on_started(ev.job, ev.node)
            return False
        if isinstance(ev, JobBound):
            self._bind(ev, out)
            return False
        if isinstance(ev, NodeReport):
            self._report(ev)
            ns = self.nodes[ev.node.id]
            if ev.node.lendable_bytes != self.ledger.pool.capacity.get(ev.node.id, 0):
                self.ledger.donor_changed(ev.node.id, ev.node.lendable_bytes, ev.stimulus_id, out)
            self.watch.on_report(ev.node.id, ev.running, ns.jobs, ev.now)
            if ev.running is not None:
                # A job the node runs where the core did not place it (the node was taken for lost,
                # the core was rebuilt): stopped there, whatever the job's state elsewhere.
                for jid in self.watch.orphans_to_release(ev.node.id, ev.running, set(ns.jobs)):
                    rec = self.records.get(jid)
                    if rec is not None and not rec.external:
                        out.append(Release(ev.stimulus_id, jid, (ev.node.id,), rec.job.state,
                                           f"node {ev.node.id} runs it where it was not placed"))
            return False
        if isinstance(ev, NodeLost):
            ns = self.nodes.get(ev.node)
            if ns is None:
                raise SchedulerError(f"event {ev.stimulus_id}: unknown node {ev.node!r}")
            if ns.alive:
                for jid in list(ns.jobs):
                    rec = self.records[jid]
                    if rec.external:  # its engine reschedules it, not the core
                        self.ledger.end(rec, JobState.FAILED, ev.stimulus_id, out, f"node {ev.node} lost", stop=False)
                    else:
                        self.ledger.stop(rec, ev.stimulus_id, out, f"node {ev.node} lost", lost=ev.node)
                self.ledger.set_alive(ns, False)
            if self.ledger.pool.capacity.get(ev.node):  # a donor: what it lent is gone
                self.ledger.donor_changed(ev.node, 0, ev.stimulus_id, out)
            return False
        if isinstance(ev, DonorReclaimed):
            ns = self.nodes.get(ev.node)
            if ns is None:
                raise SchedulerError(f"event {ev.stimulus_id}: unknown donor {ev.node!r}")
            if isinstance(ev.bytes, bool) or not isinstance(ev.bytes, int) or ev.bytes < 0:
                raise SchedulerError(f"event {ev.stimulus_id}: reclaimed bytes must be an integer >= 0, "
                                     f"got {ev.bytes!r}")
            left = max(0, ns.node.lendable_bytes - ev.bytes)
            ns.node = dataclasses.replace(ns.node, lendable_bytes=left)
            if ns.alive:
                self.ledger.donor_changed(ev.node, left, ev.stimulus_id, out)
            return False
        raise SchedulerError(f"event {getattr(ev, 'stimulus_id', '?')}: unknown event type {type(ev).__name__}")

    def _never_fits(self, job: Job) -> str:
        """Why ``job`` can never run on this cluster ("" when it may): more GPUs than the cluster
        has, or a CPU-only job larger than every node it has seen."""
        led = self.ledger
        if job.gpus > led.max_node_gpus and led.max_node_gpus and job.gpus > self.total_gpus:
            return f"needs {job.gpus} GPUs, the cluster has {self.total_gpus}"
        if led.quota is not None:
            why = never_reason(job, led.quota)
            if why:
                return why
        if job.remote_memory_bytes:
            if job.cpu_only:
                return "a CPU-only job cannot borrow lent memory (remote_memory_bytes)"
            if not getattr(self.allocator, "lends", False):
                return (f"needs {job.remote_memory_bytes} bytes of lent memory; profile {self.profile.name!r} "
                        f"does not hand lent memory out (use an allocator that does, e.g. 'lent')")
            if self.nodes and job.remote_memory_bytes > led.pool.total_capacity():
                return (f"needs {job.remote_memory_bytes} bytes of lent memory; the donors lend at most "
                        f"{led.pool.total_capacity()}")
        if job.cpu_only and self.nodes:
            cores, mem = led.max_node_cores, led.max_node_memory
            if job.cpus > cores + 1e-9 or job.memory_bytes > mem:
                return f"needs {job.cpus:g} cores and {job.memory_bytes} bytes; the largest node has {cores} and {mem}"
        return ""

    def _bind(self, ev: JobBound, out: list[Decision]) -> None:
        """Account for a job another engine runs on ``ev.node`` (see :class:`JobBound`)."""
        job = Job.from_dict(ev.job.to_dict())
        if job.id in self.records:
            raise SchedulerError(f"event {ev.stimulus_id}: duplicate job id {job.id!r}")
        ns = self.nodes.get(ev.node)
        if ns is None or not ns.alive:
            raise SchedulerError(f"event {ev.stimulus_id}: node {ev.node!r} is {'offline' if ns else 'unknown'}")
        if job.gpus > ns.node.gpus:
            raise SchedulerError(f"event {ev.stimulus_id}: job {job.id!r} needs {job.gpus} GPUs, node {ev.node} has "
                                 f"{ns.node.gpus}")
        gpus = tuple(ev.gpus)
        if len(gpus) != job.gpus or any(not 0 <= g < ns.node.gpus for g in gpus) or len(set(gpus)) != len(gpus):
            # The engine did not say which: free ones first, then the least shared.
            gpus = tuple(sorted(range(ns.node.gpus), key=lambda g: (len(ns.residents[g]), g))[:job.gpus])
        residents = tuple(dict.fromkeys(o for g in gpus for o in ns.residents[g]))
        job.state = JobState.QUEUED
        rec = JobRecord(job=job, queued_since=ev.now, external=True)
        self.records[job.id] = rec
        self.ledger.start(rec, Candidate(ns, gpus, residents), ev.stimulus_id, out, announce=False)
        self.watch.on_bound(job.id, ev.now, ev.hold_s)

    def _report(self, ev: NodeReport) -> None:
        ns = self.nodes.get(ev.node.id)
        if ns is None:
            ns = self.ledger.add_node(ev.node)
        else:
            if ev.node.gpus != ns.node.gpus and ns.jobs:
                raise SchedulerError(f"event {ev.stimulus_id}: node {ev.node.id} changed its GPU count while running jobs")
            if ev.node.gpus != ns.node.gpus:
                self.ledger.remove_node(ns)
                ns = self.ledger.add_node(ev.node)
            else:
                self.ledger.retype(ns, ev.node)
            if not ns.alive:
                self.ledger.set_alive(ns, True)
        ns.gpu_util = tuple(ev.gpu_util)
        ns.cpu_percent = ev.cpu_percent
        ns.memory_available_bytes = ev.memory_available_bytes
        for jid, sample in ev.jobs.items():
            rec = self.records.get(jid)
            if rec is None or rec.job.state is not JobState.RUNNING:
                continue
            others = tuple(self.records[o].job.job_type for o in self.ledger.co_residents(rec))
            if sample.speed is not None:
                rec.speed = sample.speed
            self.predictors.observe(rec.job.job_type, others, sample)
