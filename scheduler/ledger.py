"""The scheduler core's books: which jobs exist, which wait, which run where.

:class:`Ledger` holds the job records, the node states and the indexes the
scheduling passes search (the waiting order, the nodes by free GPUs, the GPUs a
newcomer could share), and the moves that keep them consistent: enqueue,
start, stop, end.  Each move that changes a node's jobs re-splits that node's
CPU cores and memory with the allocation plugin and reports the changes as
:class:`~scheduler.events.Allocate` decisions.

It decides nothing: :class:`~scheduler.passes.SchedulingPasses` picks what to
start and what to preempt, and :class:`~scheduler.state.SchedulerState`
applies events; both hold the same ledger.  Pure: no clock (``now`` is the
time of the event being handled), no I/O.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from typing import TYPE_CHECKING, Any

from scheduler.donors import DonorPool
from scheduler.events import Allocate, Decision, Place, Release
from scheduler.fairshare import FairShare, LentLimits, Owners, gpu_reason, lent_reason
from scheduler.framework import Allocator, Candidate, Context, NodeState, QueueSort
from scheduler.model import Allocation, Job, JobRecord, JobState, Node, Shard
from scheduler.profile import Profile
from scheduler.watch import Watch

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.predictors import Predictors


class SchedulerError(ValueError):
    """An event the core cannot apply (unknown job, duplicate id).  State is unchanged."""


JobClass = tuple[str, int, float, int]  # (job type, GPUs, CPUs, memory): jobs that place alike


def _lent_limited(quota: Any) -> bool:
    """Whether any owner in ``quota`` has a lent-memory limit."""
    tables = [quota.default_user, quota.default_account, *quota.users.values(), *quota.accounts.values()]
    return any(t.remote_memory_bytes is not None for t in tables)


class ShareClock:
    """The equal-share clocks: how many seconds of run time a max-min fair split of the cluster's
    GPUs between the active jobs has given a job of each size (Gavel's max-min fairness with
    time-slicing; the "independent" share of Themis's finish-time fairness).  Every active job is
    entitled to the same number of GPUs, the water level L, except that a job asking for fewer gets
    what it asks for and the rest is shared out among the others (so the shares sum to the
    capacity); a job of g GPUs given L of them runs min(1, L / g) of the time.  A job asking for no
    GPU runs all the time.  On a cluster of several GPU generations each GPU counts for what it is
    worth in reference GPUs (``Predictors.gpu_worth``: a K80 0.29 of a V100).

    A job's equal share since it arrived is the clock of its size now less that clock then
    (scheduler.plugins.tail.ShareBound).  Piecewise linear in the events' times: exact, no clock
    read.  One clock per GPU count that an active job asks for: a handful, updated at each change.

    (Until 2026-11-28 every job ran the same fraction of the time, capacity / GPUs asked for, which
    entitles a job of 8 GPUs to 8 times the GPUs of a 1-GPU job: in a crowd of small jobs a wide job
    was soon owed, and when promoted took whole nodes.)"""

    def __init__(self) -> None:
        self.since = 0.0
        self.capacity = 0.0  # GPUs of alive nodes (in reference GPUs)
        self.jobs: dict[int, int] = {}  # GPUs asked for -> active jobs asking for that many (> 0)
        self.values: dict[int, float] = {}  # GPUs asked for -> that size's clock at ``since``
        self.level = math.inf  # the water level L: GPUs each job is entitled to, at most

    @property
    def demand(self) -> int:
        """GPUs asked for by the active jobs it counts."""
        return sum(g * n for g, n in self.jobs.items())

    def _water_level(self) -> float:
        left, n = self.capacity, sum(self.jobs.values())
        for g in sorted(self.jobs):
            if g * n > left:  # the rest cannot all have g GPUs: they share what is left equally
                return max(left, 0.0) / n
            left -= g * self.jobs[g]
            n -= self.jobs[g]
        return math.inf  # room for everyone

    def rate(self, gpus: int) -> float:
        """Seconds of run time a second that a job asking for ``gpus`` GPUs is entitled to now."""
        return 1.0 if gpus <= 0 else min(1.0, self.level / gpus)

    def at(self, now: float, gpus: int) -> float:
        """The clock of jobs asking for ``gpus`` GPUs, at ``now`` (not before the last change).  A job
        asking for no GPU is entitled to all its time: its clock is ``now``."""
        if gpus <= 0:
            return now
        return self.values.get(gpus, 0.0) + max(0.0, now - self.since) * self.rate(gpus)

    def change(self, now: float, gpus: int = 0, jobs: int = 0, capacity: float = 0.0) -> None:
        """From ``now`` on, ``jobs`` more active jobs ask for ``gpus`` GPUs each (fewer where
        negative), and the cluster has ``capacity`` more."""
        for g in self.values:
            self.values[g] = self.at(now, g)
        self.since = max(self.since, now)
        self.capacity += capacity
        if jobs and gpus > 0:
            n = self.jobs.get(gpus, 0) + jobs
            if n > 0:
                self.jobs[gpus] = n
                self.values.setdefault(gpus, 0.0)
            else:  # no active job of this size is left: its clock is read by none
                self.jobs.pop(gpus, None)
                self.values.pop(gpus, None)
        self.level = self._water_level()


class Ledger:
    """The core's books (see the module docstring).  Its attributes are read by the
    passes and the state; only its own methods and the state's event handling change them."""

    def __init__(self, profile: Profile, order: QueueSort, allocator: Allocator, predictors: Predictors,
                 rng: random.Random, watch: Watch | None = None) -> None:
        self.profile = profile
        self.watch = watch or Watch()  # the deadlines (backoff, vanished jobs, holds)
        self.order = order
        self.allocator = allocator
        self.predictors = predictors
        self.rng = rng
        self.now = 0.0
        self.records: dict[str, JobRecord] = {}
        self.nodes: dict[str, NodeState] = {}
        self.waiting: dict[str, JobRecord] = {}  # queued or preempted, insertion-ordered
        self.running: dict[str, JobRecord] = {}
        self.wait_key: dict[str, Any] = {}  # a waiting job's order key (fixed while it waits)
        self.wait_order: list[tuple[Any, str]] = []  # (key, id) of waiting jobs, kept sorted
        self.job_class: dict[str, JobClass] = {}
        self.share_slots = 0  # GPUs a newcomer could join (see slot)
        self.by_free: dict[int, dict[str, None]] = {}  # free GPU count -> alive nodes (ordered set)
        self.total_gpus = 0  # on alive nodes
        self.free_gpus = 0
        self.max_node_gpus = 0
        self.max_node_cores = 0  # the largest node seen (for CPU-only jobs no node could ever take)
        self.max_node_memory = 0
        self.cpu_waiting = 0  # waiting CPU-only jobs (a pass with no free GPU still looks for them)
        self.incompatible: set[frozenset[str]] = set()  # pairs of job types that failed together
        self.pool = DonorPool()  # the donors' lent memory: capacity, promises, reclaims
        # Owners (Job.user, Job.account): decayed usage, GPUs in use, jobs waiting; fair share and quotas.
        self.owners = Owners(profile.fairshare.half_life_s)
        self.fair = FairShare(profile.fairshare, self.owners) if profile.fairshare.enabled else None
        self.quota = profile.quota if profile.quota.active else None
        self.lent_limits = (LentLimits(self.quota, self.records, self.pool)
                            if self.quota is not None and _lent_limited(self.quota) else None)
        self.share_clock = ShareClock()

    def context(self) -> Context:
        """What plugins may read now."""
        return Context(now=self.now, records=self.records, nodes=self.nodes, predictors=self.predictors,
                       rng=self.rng, total_gpus=self.total_gpus, free_gpus=self.free_gpus,
                       pool=self.pool if self.pool.active else None, quota=self.lent_limits,
                       share_clock=functools.partial(self.share_clock.at, self.now), running=self.running,
                       waiting=self.waiting)

    # ------------------------------------------------------------ owners: fair share and quotas

    def sort_key(self, rec: JobRecord, ctx: Context) -> Any:
        """The job's place in the order now: its owner's fair-share level (when the profile
        shares between users), then the order plugin's key."""
        key = self.order.key(rec, ctx)
        if self.fair is None:
            return key
        return (self.fair.level(rec.job, self.now), key)

    def wait_ids(self) -> list[str]:
        """Waiting job ids in the order they are tried: the order plugin's (fixed while a job
        waits), grouped by their owners' fair-share levels now."""
        ids = [jid for _, jid in self.wait_order]
        if self.fair is None:
            return ids
        levels = self.fair.levels(self.now)
        if len(set(levels.values())) <= 1:
            return ids
        records = self.records
        buckets: dict[tuple[int, int], list[str]] = {}
        for jid in ids:
            job = records[jid].job
            buckets.setdefault(levels.get((job.account, job.user), (0, 0)), []).append(jid)
        return [jid for lv in sorted(buckets) for jid in buckets[lv]]

    def quota_reason(self, job: Job) -> str:
        """Why ``job`` may not start now for its owners' limits ("" when it may)."""
        if self.quota is None:
            return ""
        why = gpu_reason(job, self.quota, self._in_use_of(job))
        if not why and self.lent_limits is not None:
            why = lent_reason(job, self.lent_limits)
        return why

    def _in_use_of(self, job: Job) -> Any:
        """GPUs in use per owner, not counting ``job``'s own (when it runs)."""
        gpus_by = self.owners.gpus_by
        own = job.gpus if job.state is JobState.RUNNING and job.id in self.running else 0
        return lambda key: gpus_by.get(key, 0) - own

    def job(self, job_id: str) -> JobRecord:
        try:
            return self.records[job_id]
        except KeyError:
            raise SchedulerError(f"unknown job {job_id!r}") from None

    # ------------------------------------------------------------ nodes

    def add_node(self, node: Node) -> NodeState:
        if node.id in self.nodes:
            raise SchedulerError(f"duplicate node {node.id!r}")
        ns = NodeState.fresh(node)
        self.nodes[node.id] = ns
        self.total_gpus += node.gpus
        self.free_gpus += node.gpus
        self.max_node_gpus = max(self.max_node_gpus, node.gpus)
        self.max_node_cores = max(self.max_node_cores, node.cores)
        self.max_node_memory = max(self.max_node_memory, node.memory_bytes)
        self.by_free.setdefault(node.gpus, {})[node.id] = None
        self.share_clock.change(self.now, capacity=self.gpu_worth(node))
        if node.lendable_bytes > 0:
            self.pool.set_capacity(node.id, node.lendable_bytes)
        return ns

    def gpu_worth(self, node: Node) -> float:
        """``node``'s GPUs in reference GPUs (its generation's worth; an untyped GPU counts 1)."""
        return node.gpus * (self.predictors.gpu_worth(node.gpu_type) if node.gpu_type else 1.0)

    def retype(self, ns: NodeState, node: Node) -> None:
        """``ns`` now reports ``node`` (same GPU count; its generation may have changed)."""
        if ns.alive and node.gpu_type != ns.node.gpu_type:
            self.share_clock.change(self.now, capacity=self.gpu_worth(node) - self.gpu_worth(ns.node))
        ns.node = node

    def remove_node(self, ns: NodeState) -> None:
        """Forget an idle node (it comes back with :meth:`add_node`, e.g. with another GPU count)."""
        self.set_alive(ns, False)
        del self.nodes[ns.node.id]

    def set_alive(self, ns: NodeState, alive: bool) -> None:
        if ns.alive == alive:
            return
        slots = sum(self.slot(res) for res in ns.residents)
        ns.alive = alive
        sign = 1 if alive else -1
        self.share_slots += sign * slots
        self.total_gpus += sign * ns.node.gpus
        self.free_gpus += sign * ns.free_gpus
        if alive:
            self.by_free.setdefault(ns.free_gpus, {})[ns.node.id] = None
        else:
            self.by_free.get(ns.free_gpus, {}).pop(ns.node.id, None)
        self.share_clock.change(self.now, capacity=sign * self.gpu_worth(ns.node))

    def _set_free(self, ns: NodeState, free: int) -> None:
        if ns.alive:
            self.by_free[ns.free_gpus].pop(ns.node.id, None)
            self.by_free.setdefault(free, {})[ns.node.id] = None
            self.free_gpus += free - ns.free_gpus
        ns.free_gpus = free

    # ------------------------------------------------------------ the waiting order

    def enqueue(self, rec: JobRecord) -> None:
        jid = rec.job.id
        self.waiting[jid] = rec
        rec.queued_since = self.now
        if rec.share_start is None:  # a new job: it asks for its GPUs until it is over
            self.share_clock.change(self.now, gpus=rec.job.gpus, jobs=1)
            rec.share_start = self.share_clock.at(self.now, rec.job.gpus)
        # A waiting job's service does not grow, so its key is fixed until it runs.
        key = self.order.key(rec, self.context())
        self.wait_key[jid] = key
        bisect.insort(self.wait_order, (key, jid))
        job = rec.job
        self.owners.waiting(job, +1)
        self.cpu_waiting += job.cpu_only
        self.job_class[jid] = (job.job_type, job.gpus, job.cpus, job.memory_bytes)

    def _dequeue(self, jid: str) -> None:
        rec = self.waiting.pop(jid, None)
        if rec is not None:
            self.owners.waiting(rec.job, -1)
            if rec.job.cpu_only:
                self.cpu_waiting -= 1
        key = self.wait_key.pop(jid, None)
        if key is not None:
            i = bisect.bisect_left(self.wait_order, (key, jid))
            if i < len(self.wait_order) and self.wait_order[i][1] == jid:
                del self.wait_order[i]

    # ------------------------------------------------------------ sharing

    def slot(self, res: list[str]) -> int:
        """1 when a GPU with these residents could take one more job, else 0."""
        if not res or len(res) >= self.profile.max_share or self.profile.share == "never":
            return 0
        limit = self.profile.share_max_gpus
        return int(all(self.records[o].job.gpus <= limit for o in res))

    def co_residents(self, rec: JobRecord) -> list[str]:
        """The other jobs on any GPU ``rec`` runs on."""
        seen: dict[str, None] = {}
        for sh in rec.shards:
            ns = self.nodes[sh.node]
            for g in sh.gpus:
                for o in ns.residents[g]:
                    if o != rec.job.id:
                        seen[o] = None
        return list(seen)

    # ------------------------------------------------------------ job moves

    def start(self, rec: JobRecord, cand: Candidate, stimulus_id: str, out: list[Decision],
              announce: bool = True) -> None:
        """Put ``rec`` on ``cand``; ``announce``: a :class:`Place` says so (not for a job another
        engine runs, which the core only accounts for)."""
        job = rec.job
        shards = [(cand.node, cand.gpus), *cand.more]
        resumed = job.state is JobState.PREEMPTED
        touched = []
        for ns, gpus in shards:
            newly = 0
            for g in gpus:
                if not ns.residents[g]:
                    newly += 1
                before = self.slot(ns.residents[g]) if ns.alive else 0
                ns.residents[g].append(job.id)
                self.share_slots += (self.slot(ns.residents[g]) if ns.alive else 0) - before
            ns.jobs[job.id] = len(gpus)
            if job.cpu_only:  # no GPU taken: the node keeps its place among the nodes with as many free
                ns.reserved_cpus += job.cpus
                ns.reserved_memory += job.memory_bytes
            else:
                self._set_free(ns, ns.free_gpus - newly)
            touched.append(ns)
        rec.shards = tuple(Shard(ns.node.id, tuple(gpus)) for ns, gpus in shards)
        rec.placed_by = stimulus_id
        self.owners.running(job, +1, self.now)  # before it leaves the waiting jobs: its owner stays active
        self._dequeue(job.id)
        self.running[job.id] = rec
        job.state = JobState.RUNNING
        rec.run_since = self.now
        rec.queueing_delay += self.now - rec.queued_since
        if rec.first_start is None:
            rec.first_start = self.now
        if announce:
            out.append(Place(stimulus_id, job.id, rec.shards, tuple(cand.residents), resumed))
        for ns in touched:
            self._reallocate(ns, stimulus_id, out)

    def _release(self, rec: JobRecord) -> list[NodeState]:
        job = rec.job
        touched = []
        for sh in rec.shards:
            ns = self.nodes[sh.node]
            freed = 0
            for g in sh.gpus:
                res = ns.residents[g]
                if job.id in res:
                    before = self.slot(res) if ns.alive else 0
                    res.remove(job.id)
                    self.share_slots += (self.slot(res) if ns.alive else 0) - before
                    if not res:
                        freed += 1
            if job.cpu_only:
                if ns.jobs.pop(job.id, None) is not None:
                    ns.reserved_cpus -= job.cpus
                    ns.reserved_memory -= job.memory_bytes
            else:
                ns.jobs.pop(job.id, None)
                self._set_free(ns, ns.free_gpus + freed)
            touched.append(ns)
        if rec.run_since is not None:
            job.attained_service += job.gpus * max(0.0, self.now - rec.run_since)
            rec.run_since = None
        if job.id in self.running:
            self.owners.running(job, -1, self.now)
        for nid in rec.allocation:
            self.pool.release((job.id, nid))
        rec.shards = ()
        rec.allocation = {}
        self.running.pop(job.id, None)
        return touched

    def _left_nodes(self, rec: JobRecord, lost: str | None) -> tuple[str, ...]:
        return tuple(dict.fromkeys(sh.node for sh in rec.shards if sh.node != lost and self.nodes[sh.node].alive))

    def stop(self, rec: JobRecord, stimulus_id: str, out: list[Decision], reason: str = "",
             announce: bool = True, lost: str | None = None) -> None:
        """Take a running job off its GPUs; it waits again, as preempted.  ``announce``: a
        :class:`Release` tells the nodes it leaves (alive ones, never ``lost``), for any
        stop but a preemption (which the passes announce with a ``Preempt``)."""
        left = self._left_nodes(rec, lost)
        touched = self._release(rec)
        self.watch.forget_run(rec.job.id)
        rec.job.state = JobState.PREEMPTED
        rec.preemptions += 1
        self.enqueue(rec)
        if announce:
            out.append(Release(stimulus_id, rec.job.id, left, JobState.PREEMPTED, reason))
        for ns in touched:
            if ns.alive:
                self._reallocate(ns, stimulus_id, out)

    def end(self, rec: JobRecord, state: JobState, stimulus_id: str, out: list[Decision], reason: str = "",
            stop: bool = True) -> None:
        """A job is over (``state`` done or failed), running or waiting.  A running one is
        released from its nodes (``stop``: its processes may still be there)."""
        if rec.job.state is JobState.RUNNING:
            left = self._left_nodes(rec, None)
            touched = self._release(rec)
            out.append(Release(stimulus_id, rec.job.id, left, state, reason, stop))
        else:
            touched = []
            self._dequeue(rec.job.id)
        self.watch.forget(rec.job.id)
        if rec.share_start is not None and rec.job.state.active:
            self.share_clock.change(self.now, gpus=rec.job.gpus, jobs=-1)
        rec.job.state = state
        rec.finished_at = self.now
        # Order plugins learn from GPU service, and only of jobs the core scheduled.
        if state is JobState.DONE and not rec.job.cpu_only and not rec.external:
            self.order.observe_finished(rec, self.context())
        for ns in touched:
            if ns.alive:
                self._reallocate(ns, stimulus_id, out)

    def _reallocate(self, ns: NodeState, stimulus_id: str, out: list[Decision]) -> None:
        ctx = self.context()
        dc = dm = 0.0
        for jid, n in ns.jobs.items():
            d = self.allocator.demand(self.records[jid], ns, n, ctx)
            dc += d.cpus
            dm += d.memory_bytes
        ns.demand_cpus, ns.demand_memory = dc, dm
        split = self.allocator.split(ns, ctx)
        nid = ns.node.id
        room = self._lent_room(split, nid) if self.lent_limits is not None else None
        for jid, alloc in split.items():
            rec = self.records[jid]
            holder = (jid, nid)
            if room is not None and alloc.remote_bytes:
                # Whatever the allocator planned, an owner never borrows beyond its quota.
                keys = [k for k, _ in self.lent_limits.keys(rec.job)]
                cap = min([room[k] for k in keys], default=alloc.remote_bytes)
                if alloc.remote_bytes > cap:
                    alloc = Allocation(alloc.cpus, alloc.memory_bytes, max(0, cap))
                for k in keys:
                    room[k] -= alloc.remote_bytes
            if alloc.remote_bytes or self.pool.held(holder):
                got = self.pool.grant(holder, alloc.remote_bytes, self.remote_demand(rec, alloc))
                if got != alloc.remote_bytes:
                    alloc = Allocation(alloc.cpus, alloc.memory_bytes, got)
            old: Allocation | None = rec.allocation.get(nid)
            if (old is None or abs(old.cpus - alloc.cpus) > 1e-9 or old.memory_bytes != alloc.memory_bytes
                    or old.remote_bytes != alloc.remote_bytes):
                rec.allocation[nid] = alloc
                out.append(Allocate(stimulus_id, jid, nid, alloc.cpus, alloc.memory_bytes, alloc.remote_bytes))

    def _lent_room(self, split: dict[str, Allocation], nid: str) -> dict[Any, int]:
        """Per owner with a lent-memory limit among the jobs of ``split``: what it may borrow on
        node ``nid`` (its limit less what its jobs borrow elsewhere)."""
        room: dict[Any, int] = {}
        for jid in split:
            for k, v in self.lent_limits.room(self.records[jid].job, exclude_node=nid).items():
                room.setdefault(k, v)
        return room

    # ------------------------------------------------------------ lent memory

    def remote_demand(self, rec: JobRecord, alloc: Allocation) -> float:
        """The remote read rate ``rec`` needs with ``alloc`` (bytes/s; see scheduler.remote_memory)."""
        from scheduler import remote_memory as rm

        sens = getattr(self.predictors, "sensitivity", None)
        job = rec.job
        if sens is None or not alloc.remote_bytes or not sens.knows(job.model, job.gpus):
            return 0.0
        speed = sens.speed(job.model, job.gpus, alloc.cpus, alloc.memory_bytes + alloc.remote_bytes)
        rate = rm.input_rate(sens, job.model, job.gpus, speed)
        return rm.remote_demand(rate, alloc.memory_bytes, alloc.remote_bytes)

    def donor_changed(self, donor: str, lendable: int, stimulus_id: str, out: list[Decision]) -> None:
        """Donor ``donor`` lends ``lendable`` bytes now (after a report, a reclaim or its loss):
        promises beyond it are taken back, and the nodes of the jobs that lost bytes are split
        again (they may top up from other donors).  No job is stopped for it."""
        losers = self.pool.set_capacity(donor, lendable)
        nodes = dict.fromkeys(nid for _, nid in losers)
        for nid in nodes:
            ns = self.nodes.get(nid)
            if ns is not None and ns.alive:
                self._reallocate(ns, stimulus_id, out)
        # A job elsewhere whose holder was taken back entirely keeps its (now stale) allocation
        # until its node is split again: the split above covers every loser's node.

    def offer_freed(self, stimulus_id: str, out: list[Decision]) -> None:
        """Lent bytes came free (a borrower left, a donor grew): split again the nodes whose
        jobs may borrow, so they can take them."""
        if not self.pool.freed:
            return
        self.pool.freed = False
        if not self.pool.active or self.pool.total_free() <= 0:
            return
        for ns in self.nodes.values():
            if ns.alive and ns.jobs and ns.node.gpus:
                self._reallocate(ns, stimulus_id, out)
