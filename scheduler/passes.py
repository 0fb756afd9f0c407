"""Scheduling passes of the core: placement and preemption.

Split out of :mod:`scheduler.state` by responsibility: ``state`` applies
events, :mod:`scheduler.ledger` keeps the books (jobs, nodes, indexes) and
carries out the moves; this module decides.  :class:`SchedulingPasses` holds
the ledger and the profile's plugins, and nothing else of the state's.

* Candidates: exclusive placements come from the free-GPU buckets, fullest
  first, up to Kubernetes' adaptive ``percentageOfNodesToScore``; shared ones
  (when the profile allows) from GPUs with room; the resource check uses the
  allocator's per-node demand sums; filters then run, and scores are
  normalised to 0-100 per plugin and weighted.
* ``_fill`` starts waiting jobs in key order (equivalence classes and a scan
  limit bound its cost); ``_preemptive_pass`` picks the jobs that should hold
  the GPUs and preempts the fewest, lowest-ranked victims where needed.
"""

from __future__ import annotations

import math
from scheduler.events import Decision, Preempt, Wakeup
from scheduler.fairshare import Owners, gpu_reason
from scheduler.framework import Allocator, Candidate, Context, Filter, NodeState, QueueSort, Score
from scheduler.ledger import JobClass, Ledger
from scheduler.model import JobRecord, JobState
from scheduler.profile import Profile


class SchedulingPasses:
    """Decides what starts and what is preempted (see the module docstring)."""

    def __init__(self, ledger: Ledger, profile: Profile, order: QueueSort, filters: list[Filter],
                 scores: list[tuple[Score, float]], allocator: Allocator) -> None:
        self.ledger = ledger
        self.profile = profile
        self.order = order
        self.filters = filters
        self.scores = scores
        self.allocator = allocator
        self.wakeup_at: float | None = None  # the Tick last asked for

    def _score_limit(self) -> int:
        n = len(self.ledger.nodes)
        pct = self.profile.nodes_to_score_percent
        if pct <= 0:  # Kubernetes' adaptive percentageOfNodesToScore: 50% - n/125, at least 5%
            if n <= 100:
                return n
            pct = max(5.0, 50.0 - n / 125.0)
        return max(100, math.ceil(n * pct / 100.0))

    def share_ok(self, rec: JobRecord) -> bool:
        return self.profile.share != "never" and 0 < rec.job.gpus <= self.profile.share_max_gpus

    def candidates(self, rec: JobRecord, ctx: Context, limit: bool = True,
                   allowed: set[str] | None = None) -> list[Candidate]:
        g = rec.job.gpus
        cands: list[Candidate] = []
        cap = self._score_limit() if limit else 1 << 60
        if g == 0:
            return self._cpu_candidates(rec, ctx, cap, allowed)
        if g <= self.ledger.max_node_gpus:
            for free in range(g, self.ledger.max_node_gpus + 1):
                bucket = self.ledger.by_free.get(free)
                if not bucket:
                    continue
                for nid in bucket:
                    if allowed is not None and nid not in allowed:
                        continue
                    cands.append(Candidate(self.ledger.nodes[nid], ()))  # GPUs picked once a node wins
                    if len(cands) >= cap:
                        break
                if len(cands) >= cap:
                    break
        elif g <= self.ledger.free_gpus:
            # Spans nodes: take whole free nodes, emptiest first, then the remainder; all of one GPU
            # generation (a gang runs at its slowest part; Gavel, too, gives a job one worker type).
            types = sorted({ns.node.gpu_type for ns in self.ledger.nodes.values() if ns.alive})
            for gtype in types:
                picked: list[tuple[NodeState, tuple[int, ...]]] = []
                need = g
                for free in range(self.ledger.max_node_gpus, 0, -1):
                    for nid in self.ledger.by_free.get(free, {}):
                        if allowed is not None and nid not in allowed:
                            continue
                        ns = self.ledger.nodes[nid]
                        if ns.node.gpu_type != gtype:
                            continue
                        take = min(need, free)
                        picked.append((ns, tuple(i for i, r in enumerate(ns.residents) if not r)[:take]))
                        need -= take
                        if need == 0:
                            break
                    if need == 0:
                        break
                if need == 0:
                    cands.append(Candidate(picked[0][0], picked[0][1], (), tuple(picked[1:])))
        share = self.share_ok(rec) and (self.profile.share == "always" or not cands)
        if share:
            incompatible = self.ledger.incompatible
            jt = rec.job.job_type
            for ns in self.ledger.nodes.values():
                if not ns.alive or (allowed is not None and ns.node.id not in allowed):
                    continue
                seen: set[tuple[str, ...]] = set()
                for i, res in enumerate(ns.residents):
                    if not res or len(res) >= self.profile.max_share:
                        continue
                    types = tuple(sorted(self.ledger.records[o].job.job_type for o in res))
                    if types in seen:
                        continue
                    seen.add(types)
                    if any(frozenset((jt, t)) in incompatible for t in types):
                        continue
                    if any(self.ledger.records[o].job.gpus > self.profile.share_max_gpus for o in res):
                        continue
                    cands.append(Candidate(ns, (i,), tuple(res)))
        out = []
        memo = self._demand_memo(rec)
        for c in cands:
            if self.fits_resources(rec, c, ctx, memo) and all(f.filter(rec, c, ctx) is None for f in self.filters):
                out.append(c)
        return out

    def _demand_memo(self, rec: JobRecord) -> dict | None:
        """A cache of ``rec``'s demand per node shape, for one search over many nodes (see
        ``Allocator.demand_by_shape``); None when the allocator does not allow it or the job
        already sits on nodes (its share there depends on them)."""
        if rec.job.state is JobState.RUNNING or not getattr(self.allocator, "demand_by_shape", False):
            return None
        return {}

    def _cpu_candidates(self, rec: JobRecord, ctx: Context, cap: int, allowed: set[str] | None) -> list[Candidate]:
        """A CPU-only job: alive nodes where its cores and memory fit, fewest free GPUs first (it
        takes no GPU, so it leaves the nodes whose GPUs are free to GPU jobs), up to ``cap``."""
        out: list[Candidate] = []
        memo = self._demand_memo(rec)
        for free in range(0, self.ledger.max_node_gpus + 1):
            for nid in self.ledger.by_free.get(free, ()):
                if allowed is not None and nid not in allowed:
                    continue
                c = Candidate(self.ledger.nodes[nid], ())
                if self.fits_resources(rec, c, ctx, memo) and all(f.filter(rec, c, ctx) is None for f in self.filters):
                    out.append(c)
                    if len(out) >= cap:
                        return out
        return out

    def fits_resources(self, rec: JobRecord, cand: Candidate, ctx: Context, memo: dict | None = None) -> bool:
        if rec.job.remote_memory_bytes and rec.job.remote_memory_bytes > self.ledger.pool.total_free():
            return False  # waits until the donors have its lent memory free
        first = rec.job.gpus if not cand.gpus else len(cand.gpus)
        for ns, n in ((cand.node, first), *((m, len(g)) for m, g in cand.more)):
            if memo is None:
                need = self.allocator.demand(rec, ns, n, ctx)
            else:
                node = ns.node
                shape = (node.gpus, node.cores, node.memory_bytes, ns.reserved_cpus, ns.reserved_memory, n)
                need = memo.get(shape)
                if need is None:
                    need = memo[shape] = self.allocator.demand(rec, ns, n, ctx)
            if (ns.demand_cpus + need.cpus > ns.node.cores + 1e-9
                    or ns.demand_memory + need.memory_bytes > ns.node.memory_bytes):
                return False
        return True

    def rank(self, rec: JobRecord, cands: list[Candidate], ctx: Context) -> list[tuple[Candidate, float]]:
        if not cands:
            return []
        total = [0.0] * len(cands)
        for plugin, weight in self.scores:
            raw = [plugin.score(rec, c, ctx) for c in cands]
            lo, hi = min(raw), max(raw)
            span = hi - lo
            for i, r in enumerate(raw):
                total[i] += weight * (100.0 * (r - lo) / span if span > 0 else 100.0)
        ranked = sorted(range(len(cands)), key=lambda i: -total[i])  # stable: ties keep candidate order
        return [(cands[i], total[i]) for i in ranked]

    def eligible(self, rec: JobRecord) -> bool:
        """May ``rec`` be placed now (no backoff after a failed start still runs)?"""
        return self.ledger.watch.eligible(rec.job.id, self.ledger.now)

    def _try_place(self, rec: JobRecord, ctx: Context, stimulus_id: str, out: list[Decision]) -> bool:
        cands = self.candidates(rec, ctx)
        if not cands:
            return False
        best = self.rank(rec, cands, ctx)[0][0]
        if not best.gpus:
            best = Candidate(best.node, best.node.free_indices()[:rec.job.gpus], (), best.more)
        self.ledger.start(rec, best, stimulus_id, out)
        return True

    # ------------------------------------------------------------ passes

    def schedule(self, stimulus_id: str, full: bool, out: list[Decision]) -> None:
        if self.ledger.fair is not None:
            self.ledger.fair.update(self.ledger.now)  # the owners' fair-share levels for this pass
        if self.order.preemptive and full and (self.ledger.waiting or self.ledger.running):
            self._preemptive_pass(stimulus_id, out)
        else:
            self._fill(stimulus_id, out)
        self._maybe_wakeup(stimulus_id, out)

    def _fill(self, stimulus_id: str, out: list[Decision]) -> None:
        if not self.ledger.waiting:
            return
        ctx = self.ledger.context()
        share_possible = self.profile.share != "never"
        # Equivalence classes (as kube-scheduler caches them): once a (type, GPUs)
        # job found no place, its twins will not either until something is placed.
        failed: set[JobClass] = set()
        misses = 0
        led = self.ledger
        # GPU jobs and CPU-only jobs queue for different things: a GPU job that must wait for
        # GPUs holds back the GPU jobs behind it (without backfill), never the CPU-only ones.
        gpu_blocked = False
        quota = led.quota is not None
        ahead = 0  # GPUs of the waiting jobs tried before this one that still wait
        for jid in led.wait_ids():
            if not gpu_blocked and led.free_gpus == 0 and (not share_possible or led.share_slots == 0):
                gpu_blocked = True
            if gpu_blocked and led.cpu_waiting == 0:
                break
            if misses >= self.profile.scan_limit:  # like Slurm's bf_max_job_test
                break
            rec = led.waiting.get(jid)
            if rec is None:
                continue
            job = rec.job
            if quota and led.quota_reason(job):
                continue  # its owner is at a limit: it waits, and holds no one else back
            if not job.cpu_only:
                if gpu_blocked:
                    continue
                if led.free_gpus < job.gpus and not self.share_ok(rec):
                    ahead += job.gpus
                    if not self.profile.backfill:
                        gpu_blocked = True
                    continue
            if not self.eligible(rec):
                ahead += job.gpus
                continue
            cls = led.job_class[jid]
            if cls in failed:
                ahead += job.gpus
                continue
            ctx.ahead_gpus = ahead
            placed = self._try_place(rec, ctx, stimulus_id, out)
            if not placed:
                ahead += job.gpus
            if placed:
                failed.clear()
                misses = 0
            else:
                failed.add(cls)
                misses += 1
                if not self.profile.backfill and not job.cpu_only:
                    gpu_blocked = True

    def _pinned(self, rec: JobRecord) -> bool:
        """A running job no pass may preempt: run by another engine, younger than ``min_run_s``,
        or preempted ``max_preemptions`` times already (it runs to its end)."""
        if rec.external:
            return True
        prof = self.profile
        if prof.min_run_s and rec.run_since is not None and self.ledger.now - rec.run_since < prof.min_run_s:
            return True
        return prof.max_preemptions is not None and rec.preemptions >= prof.max_preemptions

    def _preemptive_pass(self, stimulus_id: str, out: list[Decision]) -> None:
        ctx = self.ledger.context()
        led = self.ledger
        # CPU-only jobs hold no GPU: they are neither admitted here nor preempted (the fill below starts them).
        # Running jobs no pass may preempt (bound pods, young jobs, jobs out of preemptions) hold their
        # GPUs whatever their rank: they are admitted first, and the rest share what they leave.
        pinned = [r for r in led.running.values() if not r.job.cpu_only and self._pinned(r)]
        pinned_ids = {r.job.id for r in pinned}
        active = [r for r in (*led.running.values(), *led.waiting.values())
                  if not r.job.cpu_only and r.job.id not in pinned_ids
                  and (r.job.state is JobState.RUNNING or self.eligible(r))]
        active.sort(key=lambda r: led.sort_key(r, ctx))
        rem = led.total_gpus - sum(r.job.gpus for r in pinned)
        admitted: set[str] = set(pinned_ids)
        taken = None
        if led.quota is not None:  # GPUs admitted per owner, the pinned jobs' first
            taken = {}
            for r in pinned:
                for k in Owners.keys(r.job):
                    taken[k] = taken.get(k, 0) + r.job.gpus
        for r in active:
            if rem <= 0:
                break
            if r.job.gpus <= rem:
                if taken is not None:
                    if gpu_reason(r.job, led.quota, lambda k: taken.get(k, 0)):
                        continue  # its owner's quota is spent on jobs ahead of it
                    for k in Owners.keys(r.job):
                        taken[k] = taken.get(k, 0) + r.job.gpus
                admitted.add(r.job.id)
                rem -= r.job.gpus
        victims = [r for r in reversed(active) if r.job.id not in admitted and r.job.state is JobState.RUNNING]
        rank = {v.job.id: i for i, v in enumerate(victims)}  # 0 = worst ranked
        ahead = 0  # GPUs of the waiting jobs ranked ahead that still wait
        for r in active:
            if r.job.state is JobState.RUNNING:
                continue
            if r.job.id not in admitted:
                ahead += r.job.gpus
                continue
            if led.quota is not None and led.quota_reason(r.job) and not self._make_quota_room(r, rank, stimulus_id,
                                                                                              out):
                ahead += r.job.gpus
                continue
            ctx = self.ledger.context()
            ctx.ahead_gpus = ahead
            if not self._try_place(r, ctx, stimulus_id, out):
                if rank and self._make_room(r, rank, stimulus_id, out, ahead):
                    ctx = self.ledger.context()
                    ctx.ahead_gpus = ahead
                    self._try_place(r, ctx, stimulus_id, out)
            if r.job.state is not JobState.RUNNING:
                ahead += r.job.gpus
        # Work conservation: anything else that fits (or may share) starts now.
        self._fill(stimulus_id, out)

    def _preempt(self, jid: str, rec: JobRecord, rank: dict[str, int], stimulus_id: str, out: list[Decision]) -> None:
        """Preempt victim ``jid`` for ``rec`` (and take it out of ``rank``)."""
        vr = self.ledger.records[jid]
        rank.pop(jid, None)
        if vr.job.state is JobState.RUNNING:
            nodes = tuple(dict.fromkeys(sh.node for sh in vr.shards))
            self.ledger.stop(vr, stimulus_id, out, announce=False)
            out.append(Preempt(stimulus_id, jid, f"for {rec.job.id}", nodes))

    def _external_gpus(self) -> dict[tuple[str, str], int]:
        """GPUs per owner held by jobs another engine runs (never preempted, always counted)."""
        out: dict[tuple[str, str], int] = {}
        for r in self.ledger.running.values():
            if r.external:
                for k in Owners.keys(r.job):
                    out[k] = out.get(k, 0) + r.job.gpus
        return out

    def _make_quota_room(self, rec: JobRecord, rank: dict[str, int], stimulus_id: str, out: list[Decision]) -> bool:
        """``rec`` was admitted but its owner's running jobs that were not (``rank``: the victims,
        0 = worst) still hold its GPU quota: preempt the fewest, lowest-ranked of them that make
        room.  Preempts nothing when they cannot, or when the limit in the way is not on GPUs."""
        led = self.ledger
        in_use = led.owners.gpus_by
        # The owners whose GPU limit is in the way: only their jobs can make room.
        keys = {(kind, name) for kind, name, lim in led.quota.limits(rec.job)
                if lim.gpus is not None and in_use.get((kind, name), 0) + rec.job.gpus > lim.gpus}
        mine = sorted((jid for jid in rank if led.records[jid].job.state is JobState.RUNNING
                       and keys & set(Owners.keys(led.records[jid].job))), key=rank.__getitem__)
        freed: dict[tuple[str, str], int] = {}
        chosen: list[str] = []
        for jid in mine:
            if not gpu_reason(rec.job, led.quota, lambda k: in_use.get(k, 0) - freed.get(k, 0)):
                break
            chosen.append(jid)
            vj = led.records[jid].job
            for k in Owners.keys(vj):
                freed[k] = freed.get(k, 0) + vj.gpus
        if gpu_reason(rec.job, led.quota, lambda k: in_use.get(k, 0) - freed.get(k, 0)):
            return False
        for jid in chosen:
            self._preempt(jid, rec, rank, stimulus_id, out)
        return not led.quota_reason(rec.job)

    def _filters_pass(self, rec: JobRecord, ns: NodeState, ctx: Context) -> bool:
        """The profile's filters would let ``rec`` run alone on ``ns`` (its GPU type, say)."""
        cand = Candidate(ns, ())
        return all(f.filter(rec, cand, ctx) is None for f in self.filters)

    def _make_room(self, rec: JobRecord, rank: dict[str, int], stimulus_id: str, out: list[Decision],
                   ahead: int | None = None) -> bool:
        """Preempt the fewest, lowest-ranked victims that free a place for ``rec``.
        ``rank`` maps still-running victims to their rank (0 = worst); preempted
        ones are removed from it."""
        g = rec.job.gpus
        live = [jid for jid in rank if self.ledger.records[jid].job.state is JobState.RUNNING]
        if not live:
            return False
        victim_nodes: dict[str, None] = {}
        for jid in live:
            for sh in self.ledger.records[jid].shards:
                victim_nodes[sh.node] = None
        per_node: list[tuple[NodeState, int, list[str]]] = []
        ctx = self.ledger.context()
        ctx.ahead_gpus = ahead
        for nid in victim_nodes:
            ns = self.ledger.nodes[nid]
            if not ns.alive or not self._filters_pass(rec, ns, ctx):
                continue  # preempting there would free GPUs the job may not take
            reclaim = ns.free_gpus
            need_v: dict[str, None] = {}
            for res in ns.residents:
                if res and all(o in rank for o in res):
                    reclaim += 1
                    for o in res:
                        need_v[o] = None
            if need_v:
                per_node.append((ns, reclaim, sorted(need_v, key=rank.__getitem__)))

        def preempt(jid: str) -> None:
            self._preempt(jid, rec, rank, stimulus_id, out)

        if g <= self.ledger.max_node_gpus:
            plans = [(len(vs), -min(rank[v] for v in vs), i) for i, (ns, reclaim, vs) in enumerate(per_node)
                     if reclaim >= g]
            if not plans:
                return False
            node, _, chosen = per_node[min(plans)[2]]
            for v in chosen:
                if node.free_gpus >= g:
                    break
                preempt(v)
            return node.free_gpus >= g
        # Spans nodes: free nodes first, then the nodes with the most reclaimable GPUs, all of one
        # GPU generation (the first, in name order, where the victims free enough).
        per_node.sort(key=lambda p: -p[1])
        for gtype in sorted({ns.node.gpu_type for ns in self.ledger.nodes.values() if ns.alive}):
            mine = [p for p in per_node if p[0].node.gpu_type == gtype]
            got = sum(ns.free_gpus for ns in self.ledger.nodes.values() if ns.alive and ns.node.gpu_type == gtype
                      and ns.free_gpus and (not self.filters or self._filters_pass(rec, ns, ctx)))
            got -= sum(ns.free_gpus for ns, _, _ in mine)
            chosen_nodes = []
            for ns, reclaim, vs in mine:
                if got >= g:
                    break
                got += reclaim
                chosen_nodes.append(vs)
            if got < g:
                continue
            for vs in chosen_nodes:
                for v in vs:
                    preempt(v)
            return True
        return False

    def _maybe_wakeup(self, stimulus_id: str, out: list[Decision]) -> None:
        if not self.order.preemptive or not self.ledger.waiting:
            return
        ctx = self.ledger.context()
        at = math.inf
        if self.order.uniform_wakeup:
            # Every running job's key changes on the same quantum: one look suffices,
            # and a wakeup already pending in the future cannot be beaten.
            if self.wakeup_at is not None and self.wakeup_at > self.ledger.now:
                return
            first = next((r for r in self.ledger.running.values() if not r.job.cpu_only), None)
            if first is not None:
                at = self.order.next_change(first, ctx) or math.inf
        else:
            for r in self.ledger.running.values():
                if r.job.cpu_only:
                    continue
                t = self.order.next_change(r, ctx)
                if t is not None and t < at:
                    at = t
        if self.profile.min_run_s:  # also wake when a protected job may be preempted
            for r in self.ledger.running.values():
                if r.job.cpu_only:
                    continue
                t = (r.run_since or 0.0) + self.profile.min_run_s
                if self.ledger.now < t < at:
                    at = t
        if at == math.inf:
            return
        at = max(at, self.ledger.now + 1e-6)
        if self.wakeup_at is None or self.wakeup_at <= self.ledger.now or at < self.wakeup_at - 1e-9:
            self.wakeup_at = at
            out.append(Wakeup(stimulus_id, at))
