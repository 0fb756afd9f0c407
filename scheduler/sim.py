"""Discrete-event, trace-driven simulator around the real scheduler core.

The simulator owns the ground truth (how fast each job really runs) and the
clock; :class:`~scheduler.state.SchedulerState` with the chosen profile makes
every decision, exactly as it does in the live service.

Ground truth (:mod:`scheduler.groundtruth`, with the cluster):

* A job alone on its GPUs progresses at 1 isolated-second per second (the
  trace's duration is its run time alone at its GPU count, on V100s); on
  another GPU generation (a typed cluster, ``6x4@v100,6x4@k80``) at its
  throughput there over its V100 throughput (Gavel's); a gang at its slowest part.
* Two jobs sharing a GPU run at Gavel's measured pair throughputs (that generation's),
  each divided by its throughput alone.  A pair Gavel measured as 0 (does not
  fit) fails to start: the core gets :class:`PlacementFailed`.  Pairs Gavel
  never measured (models outside its table) time-slice at 0.5 each.
* CPU/memory: a model with a Synergy profile runs at its profiled speed for
  the cores and memory it was given (1.0 at the GPU-proportional share of
  Synergy's servers); other models are insensitive.
* Every resume of a preempted job costs it ``restart_overhead_s`` (30 s by default) of run time on
  its GPUs: a checkpoint, a release, a placement and a restart.
* Telemetry reaches the core as :class:`NodeReport` samples
  ``report_delay_s`` after a job starts: its speed when it shares a GPU, its
  utilisation when it runs alone (Lucid's solo profile of the same model
  family, :mod:`scheduler.predictors.lucid_proxy`; Gavel published none).
  That is the online path the live service feeds from telemetry.

Decisions use only what a live system would know: by default the predictors
hold the co-location model trained on Lucid's runs (features: solo profiles)
and learn the pairs they see during the run; :func:`oracle_predictors` knows
every pair's true speeds instead, to measure what prediction costs.

Events are kept in one heap; the core is called once per distinct time with
all events of that time.  Finishing times are rescheduled (with a version
number) only for jobs whose speed changed.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.events import (
    Allocate, DonorReclaimed, JobArrived, JobFinished, JobSample, NodeReport, Place, PlacementFailed, Preempt, Reject, Tick, Wakeup,
)
from scheduler.groundtruth import GB, Cluster, GroundTruth
from scheduler.model import GiB, Job, JobState, Node
from scheduler.profile import Profile, load_profile
from scheduler.state import SchedulerState
from scheduler.trace import TraceJob

# What one preemption costs the preempted job (issue 23): a checkpoint, a release, a placement and a
# restart, tens of seconds of GPU time on its GPUs.  30 s is the stated default: above the live
# service's measured decision-to-running time (bench/RESULTS.md: 0.84 s p50 under Slurm, a 3.3 s p99 decision
# under a 16-client burst), and the order of a PyTorch checkpoint save plus a process and CUDA start.
# Every benchmark runs with it; ``restart_overhead_s`` (``dlshare sim --restart-overhead``) changes it.
RESTART_COST_S = 30.0
_ARRIVE, _FINISH, _TICK, _REPORT, _FAIL, _RECLAIM = range(6)


@dataclass
class _SimJob:
    job: Job
    remaining: float
    speed: float = 0.0
    last: float = 0.0
    version: int = 0
    finished: float | None = None
    cpus: float = 0.0
    memory: float = 0.0
    remote: float = 0.0  # lent memory (bytes) on its first node
    nodes: list[str] = field(default_factory=list)  # where it last ran


@dataclass
class SimResult:
    trace: str
    cluster: str
    profile: str
    seed: int
    jct_s: np.ndarray
    queueing_s: np.ndarray
    makespan_s: float
    gpu_util: float
    cpu_util: float
    mem_util: float
    preemptions: int
    failed: int
    events: int
    decisions: int
    wall_s: float
    slowdown: np.ndarray = field(default_factory=lambda: np.zeros(0))  # JCT / isolated duration, per job
    lent: dict[str, Any] = field(default_factory=dict)  # the donor pool's books at the end (with donors)
    lent_peak_bytes: int = 0  # the most lent memory promised at once
    job_ids: tuple[str, ...] = ()  # the finished jobs, in the order of jct_s (per-user figures join on it)
    restart_overhead_s: float = 0.0  # the cost of each resume the run was simulated with

    @property
    def worst_slowdown(self) -> float | None:
        return float(self.slowdown.max()) if len(self.slowdown) else None

    def metrics(self) -> dict[str, Any]:
        h = 3600.0
        jct = self.jct_s
        return {
            "trace": self.trace, "cluster": self.cluster, "policy": self.profile, "seed": self.seed,
            "jobs": int(len(jct)), "failed": self.failed,
            "avg_jct_h": float(jct.mean() / h) if len(jct) else None,
            "median_jct_h": float(np.median(jct) / h) if len(jct) else None,
            "p99_jct_h": float(np.percentile(jct, 99) / h) if len(jct) else None,
            "p99_slowdown": float(np.percentile(self.slowdown, 99)) if len(self.slowdown) else None,
            "worst_slowdown": self.worst_slowdown,
            "makespan_h": self.makespan_s / h,
            "avg_queueing_h": float(self.queueing_s.mean() / h) if len(self.queueing_s) else None,
            "gpu_util": self.gpu_util, "cpu_util": self.cpu_util, "mem_util": self.mem_util,
            "preemptions": self.preemptions,
            "preemptions_per_job": self.preemptions / max(1, len(jct) + self.failed),
            "restart_overhead_s": self.restart_overhead_s, "events": self.events, "decisions": self.decisions,
            "sim_wall_s": self.wall_s,
            **({"lent_peak_bytes": self.lent_peak_bytes, "lent_reclaimed_bytes": self.lent["reclaimed_bytes"]}
               if self.lent else {}),
        }


def _job_of(tj: TraceJob) -> Job:
    return Job(id=tj.id, model=tj.model, batch_size=tj.batch_size, gpus=tj.gpus, arrival=tj.arrival_s,
               duration=tj.duration_s, cpus=tj.cpus, memory_bytes=tj.memory_bytes, user=tj.user, account=tj.account)


def simulate(trace: Sequence[TraceJob], cluster: Cluster, profile: Profile | str | Path, *, seed: int = 0,
             predictors: Any = None, truth: GroundTruth | None = None, report_delay_s: float = 60.0,
             restart_overhead_s: float = RESTART_COST_S, progress: bool = False, trace_name: str = "",
             on_decision: Callable[[Any], None] | None = None, donors: Sequence[Node] = (),
             reclaims: Sequence[tuple[float, str, int]] = (), remote_link: Any = None,
             on_batch: Callable[[SchedulerState, float, list, list], None] | None = None) -> SimResult:
    """Run ``trace`` on ``cluster`` under ``profile``; seeded and reproducible.
    ``predictors``: default, what a live system knows (see the module docstring);
    ``"oracle"``: every pair's true speeds; or a :class:`Predictors` of your own.
    ``donors``: more nodes (CPU-only data-preparation nodes with ``lendable_bytes``) whose idle
    memory profiles with a lent-memory allocator (``lent``) hand out; ``reclaims``: (time, donor,
    bytes) at which a donor takes that much of its lendable memory back; ``remote_link``: a
    :class:`scheduler.remote_memory.RemoteLink` instead of the measured one.  ``on_batch(state, t,
    events, decisions)``: called after each batch the core handled (the core may be read, e.g. to
    forecast from it, never changed)."""
    from scheduler import data
    from scheduler.predictors import Predictors
    from scheduler.predictors.sensitivity import SensitivityModel

    t_wall = time.perf_counter()
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    typed = any(c.gpu_type for c in cluster.groups)
    if truth is None:
        gavel = data.gavel_throughputs()
        truth = GroundTruth(gavel["v100"], SensitivityModel.from_data(), _solo_profiles(), by_type=gavel if typed else None)
    if predictors is None:
        predictors = Predictors(sensitivity=SensitivityModel.from_data(), colocation=_colocation(),
                                type_speeds=_type_speeds() if typed else None)
    elif predictors == "oracle":
        predictors = oracle_predictors(truth)
    state = SchedulerState(prof, [*cluster.make_nodes(), *donors], predictors=predictors, rng=random.Random(seed))
    pool = state.ledger.pool
    if remote_link is not None:
        pool.link = remote_link
    heap: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, payload))
        seq += 1

    jobs: dict[str, _SimJob] = {}
    for tj in trace:
        push(tj.arrival_s, _ARRIVE, tj)
    for at, donor, nbytes in reclaims:
        push(at, _RECLAIM, (donor, int(nbytes)))
    total_gpus = cluster.total_gpus
    total_cores = cluster.total_cores
    total_mem = cluster.total_memory_gb * GB
    busy_area = cpu_area = mem_area = 0.0
    alloc_cpus = alloc_mem = 0.0
    first = trace[0].arrival_s if trace else 0.0
    last_t = first
    n_events = n_decisions = 0
    finished = 0
    tick_pending: set[float] = set()
    lent_peak = 0
    report_pending: set[str] = set()
    bar = _progress(len(trace)) if progress else None

    def speed_of(sj: _SimJob) -> float | None:
        rec = state.records[sj.job.id]
        s = None
        for sh in rec.shards:  # a gang runs at its slowest part
            ns = state.nodes[sh.node]
            gtype = ns.node.gpu_type
            here = truth.type_factor(sj.job, gtype)
            for g in sh.gpus:
                res = ns.residents[g]
                if len(res) > 1:
                    others = [jobs[o].job for o in res if o != sj.job.id]
                    if len(others) == 1:
                        p = truth.pair(sj.job, others[0], gtype)
                        if p is None:
                            return None
                        here = min(here, truth.type_factor(sj.job, gtype) * p[0])
                    else:
                        here = min(here, truth.type_factor(sj.job, gtype) / len(res))
            s = here if s is None else min(s, here)
        s = 1.0 if s is None else s
        if sj.remote > 0 and rec.shards:
            holder = (sj.job.id, rec.shards[0].node)
            return s * truth.resource_factor(sj.job, sj.cpus, sj.memory, sj.remote, _supply(holder, sj))
        return s * truth.resource_factor(sj.job, sj.cpus, sj.memory)

    def _supply(holder: tuple[str, str], sj: _SimJob) -> float:
        from scheduler import remote_memory as rm

        sample = rm.SAMPLE_BYTES.get(sj.job.model, rm.DEFAULT_SAMPLE_BYTES)
        return min(pool.supply(holder), pool.link.stream_bytes_per_s(sample, sj.cpus))

    def settle(sj: _SimJob, t: float) -> None:
        if sj.speed > 0:
            sj.remaining -= sj.speed * (t - sj.last)
        sj.last = t

    def reschedule(sj: _SimJob, t: float, speed: float) -> None:
        settle(sj, t)
        sj.speed = speed
        sj.version += 1
        if speed > 0:
            push(t + max(0.0, sj.remaining) / speed, _FINISH, (sj.job.id, sj.version))

    while heap:
        t = heap[0][0]
        batch = []
        while heap and heap[0][0] == t:
            _, _, kind, payload = heapq.heappop(heap)
            if kind == _ARRIVE:
                job = _job_of(payload)
                tel = truth.solo_telemetry(job)
                if tel is not None:  # the footprint a launcher declares (or the first run measures)
                    job.gpu_memory_bytes = int(tel.gmem_mib * (1 << 20))
                jobs[job.id] = _SimJob(job, payload.duration_s, last=t)
                batch.append(JobArrived(f"arrive:{job.id}", t, job))
            elif kind == _FINISH:
                jid, ver = payload
                sj = jobs[jid]
                if ver != sj.version or sj.finished is not None:
                    continue
                settle(sj, t)
                if sj.remaining > 1e-6 * max(1.0, sj.job.duration or 1.0):
                    reschedule(sj, t, sj.speed)
                    continue
                sj.finished = t
                sj.speed = 0.0
                sj.version += 1
                batch.append(JobFinished(f"finish:{jid}", t, jid))
            elif kind == _TICK:
                tick_pending.discard(t)
                batch.append(Tick(f"tick:{t:.3f}", t))
            elif kind == _RECLAIM:
                donor, nbytes = payload
                batch.append(DonorReclaimed(f"reclaim:{donor}:{t:.3f}", t, donor, nbytes))
            elif kind == _FAIL:
                jid = payload
                if state.records[jid].job.state is JobState.RUNNING and jobs[jid].speed == 0.0:
                    batch.append(PlacementFailed(f"fail:{jid}:{t:.3f}", t, jid, "out of GPU memory"))
            elif kind == _REPORT:
                nid = payload
                report_pending.discard(nid)
                ns = state.nodes[nid]
                samples = {}
                for jid in ns.jobs:
                    sj = jobs[jid]
                    if sj.speed > 0:
                        rf = (truth.resource_factor(sj.job, sj.cpus, sj.memory, sj.remote,
                                                    _supply((jid, nid), sj)) if sj.remote > 0
                              else truth.resource_factor(sj.job, sj.cpus, sj.memory))
                        speed = sj.speed / rf if rf > 0 else sj.speed
                        tel = truth.solo_telemetry(sj.job)
                        alone = all(len(ns.residents[g]) == 1 for g in range(len(ns.residents)) if jid in ns.residents[g])
                        if alone and tel is not None:
                            samples[jid] = JobSample(sm_percent=tel.sm_percent, mem_percent=tel.mem_percent, speed=speed)
                        else:
                            samples[jid] = JobSample(speed=speed)
                if samples:
                    batch.append(NodeReport(f"report:{nid}:{t:.3f}", t, ns.node, jobs=samples))
        if not batch:
            continue
        busy_area += (total_gpus - state.free_gpus) * (t - last_t)
        cpu_area += alloc_cpus * (t - last_t)
        mem_area += alloc_mem * (t - last_t)
        last_t = t
        n_events += len(batch)
        decisions = state.handle(*batch)
        n_decisions += len(decisions)
        if on_batch is not None:
            on_batch(state, t, batch, decisions)
        touched: dict[str, None] = {}
        placed_now: set[str] = set()
        lent_changed = False
        for ev in batch:
            if isinstance(ev, JobFinished):
                sj = jobs[ev.job]
                alloc_cpus -= sj.cpus
                alloc_mem -= sj.memory
                sj.cpus = sj.memory = sj.remote = 0.0
                finished += 1
                if bar:
                    bar[0].update(bar[1], advance=1)
            if isinstance(ev, (JobFinished, PlacementFailed)):
                for nid in jobs[ev.job].nodes:
                    touched[nid] = None
        for d in decisions:
            if on_decision is not None:
                on_decision(d)
            if isinstance(d, Place):
                placed_now.add(d.job)
                sj = jobs[d.job]
                sj.nodes = [s.node for s in d.shards]
                if d.resumed and restart_overhead_s:
                    sj.remaining += restart_overhead_s
                for s in d.shards:
                    touched[s.node] = None
                for s in d.shards:  # telemetry: solo utilisation, or the speeds of a shared GPU
                    if s.node not in report_pending:
                        report_pending.add(s.node)
                        push(t + report_delay_s, _REPORT, s.node)
            elif isinstance(d, Preempt):
                sj = jobs[d.job]
                alloc_cpus -= sj.cpus
                alloc_mem -= sj.memory
                sj.cpus = sj.memory = sj.remote = 0.0
                reschedule(sj, t, 0.0)
                for nid in sj.nodes:
                    touched[nid] = None
            elif isinstance(d, Allocate):
                sj = jobs[d.job]
                alloc_cpus += d.cpus - sj.cpus
                alloc_mem += d.memory_bytes - sj.memory
                if d.remote_memory_bytes or sj.remote:
                    lent_changed = True
                sj.cpus, sj.memory, sj.remote = d.cpus, float(d.memory_bytes), float(d.remote_memory_bytes)
                touched[d.node] = None
            elif isinstance(d, Wakeup):
                if d.at not in tick_pending:
                    tick_pending.add(d.at)
                    push(d.at, _TICK, None)
            elif isinstance(d, Reject):
                jobs[d.job].finished = t
        if lent_changed:  # a donor's borrowers changed: every borrower's share of it may have
            lent_peak = max(lent_peak, sum(sum(h.values()) for h in pool.holds.values()))
            for holder in pool.holds:
                touched[holder[1]] = None
        for nid in touched:
            ns = state.nodes[nid]
            for jid in ns.jobs:
                sj = jobs[jid]
                if sj.finished is not None:
                    continue
                sp = speed_of(sj)
                if sp is None:  # the pair does not fit on the device: the newcomer fails to start
                    reschedule(sj, t, 0.0)  # the resident stalls only until the failure is handled
                    if jid in placed_now:
                        push(t, _FAIL, jid)
                elif abs(sp - sj.speed) > 1e-12:
                    reschedule(sj, t, sp)
        if bar and n_events % 2000 == 0:
            bar[0].refresh()
    if bar:
        bar[0].stop()
    done = [sj for sj in jobs.values() if sj.finished is not None and state.records[sj.job.id].job.state is JobState.DONE]
    jct = np.asarray([sj.finished - sj.job.arrival for sj in done], dtype=float)
    iso = np.asarray([sj.job.duration or 0.0 for sj in done], dtype=float)
    slowdown = jct[iso > 0] / iso[iso > 0]
    queueing = np.asarray([state.records[sj.job.id].queueing_delay for sj in done], dtype=float)
    makespan = (max(sj.finished for sj in done) - first) if done else 0.0
    span = max(makespan, 1e-9)
    return SimResult(
        trace=trace_name, cluster=str(cluster), profile=prof.name, seed=seed, jct_s=jct, queueing_s=queueing,
        makespan_s=makespan, gpu_util=busy_area / (total_gpus * span), cpu_util=cpu_area / (total_cores * span),
        mem_util=mem_area / (total_mem * span),
        preemptions=sum(r.preemptions for r in state.records.values()), failed=len(jobs) - len(done),
        events=n_events, decisions=n_decisions, wall_s=time.perf_counter() - t_wall, slowdown=slowdown,
        lent=pool.stats() if pool.capacity else {}, lent_peak_bytes=lent_peak,
        job_ids=tuple(sj.job.id for sj in done), restart_overhead_s=restart_overhead_s,
    )


def _solo_profiles() -> Any:
    from scheduler.predictors.lucid_proxy import GavelSoloProfiles

    try:
        return GavelSoloProfiles.from_data()
    except (OSError, ValueError):  # no Lucid data: jobs report no solo utilisation
        return None


def _type_speeds() -> Any:
    from scheduler.predictors import gavel_type_speeds

    return gavel_type_speeds()


def _colocation() -> Any:
    from scheduler import data
    from scheduler.predictors import LazyCoLocation

    try:
        data.path("lucid/colocation.csv"), data.path("lucid/solo.csv")
    except OSError:  # no Lucid data: unknown pairs fall back on the prior
        return None
    return LazyCoLocation()  # trained on first use: FIFO and friends never pay for it


def oracle_predictors(truth: GroundTruth) -> Any:
    """Predictors that know every pair's true speeds (Gavel's measurements) from
    the start: the yardstick for what prediction costs."""
    from scheduler.predictors import Predictors
    from scheduler.predictors.sensitivity import SensitivityModel

    class Oracle(Predictors):
        def colocated_speeds(self, new_type, resident_types, new_job=None, residents=()):
            if new_job is not None and len(residents) == 1:
                p = truth.pair(new_job, residents[0])
                return [0.0, 0.0] if p is None else [p[0], p[1]]
            return super().colocated_speeds(new_type, resident_types, new_job, residents)

    return Oracle(sensitivity=SensitivityModel.from_data(), type_speeds=_type_speeds() if truth.by_type else None)


def _progress(total: int) -> tuple[Any, Any] | None:
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError:  # pragma: no cover
        return None
    p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 transient=True)
    task = p.add_task("simulating", total=total)
    p.start()
    return p, task


def synthetic_trace(n_jobs: int, total_gpus: int, load: float = 0.8, seed: int = 0) -> list[TraceJob]:
    """A synthetic Philly-like trace: job types and GPU counts drawn like
    vc_0e4a51's, durations from the Philly runtime distribution, arrivals
    uniform over the span that offers ``load`` of the cluster's GPUs.  Durations
    are clipped to 1 min .. a quarter of that span, so the offered work really
    lands inside it (otherwise the heavy tail runs on long after the arrivals
    stop and the cluster never queues)."""
    from scheduler import data

    rng = np.random.default_rng(seed)
    base = [tj for tj in _mix()]
    runtimes = data.philly_runtimes()
    picks = rng.integers(0, len(base), n_jobs)
    raw = rng.choice(runtimes, n_jobs)
    gpus = np.asarray([base[i][2] for i in picks])
    hi = 10 * 86400.0
    for _ in range(8):  # fixed point: span depends on the clipped work
        durs = np.clip(raw, 60.0, hi)
        span = float((durs * gpus).sum()) / (load * total_gpus)
        hi = max(3600.0, span / 4.0)
    durs = np.clip(raw, 60.0, hi)
    span = float((durs * gpus).sum()) / (load * total_gpus)
    arrivals = np.sort(rng.uniform(0.0, span, n_jobs))
    out = []
    for k in range(n_jobs):
        model, bs, g = base[picks[k]]
        out.append(TraceJob(str(k), float(arrivals[k]), model, bs, g, 0, float(durs[k])))
    return out


def _mix() -> list[tuple[str, int, int]]:
    from scheduler import data
    from scheduler.trace import load_trace

    try:
        return [(t.model, t.batch_size, t.gpus) for t in load_trace(data.path("philly/vc_0e4a51.csv"))]
    except Exception:  # noqa: BLE001 - fall back on a fixed mix when the trace is absent
        return [("ResNet-18", 32, 1), ("Transformer", 128, 1), ("LM", 20, 4), ("ResNet-50", 64, 2)]


__all__ = ["RESTART_COST_S", "Cluster", "GroundTruth", "SimResult", "oracle_predictors", "simulate", "synthetic_trace", "GiB"]
