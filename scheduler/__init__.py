"""dlshare's interference-aware scheduler: a pure core, plugins, predictors and a simulator.

What it may import (floor 1 of the floor plan; ``lint-imports`` checks it)
==========================================================================
The core (``model``, ``events``, ``ledger``, ``state``, ``passes``, ``watch``, ``framework``, ``fairshare``,
``plugins``, ``predictors``, ``profile``, ``sim``, ``trace``, ``codec``, ``replay``, ``snapshot``, ``waiting``,
``forecast``) imports the standard
library, numpy, scikit-learn (and torch for ``predictors.utilisation.graph_features``) and its
own modules, in one direction: ``state`` holds a ``ledger.Ledger`` and a
``passes.SchedulingPasses`` (and the ledger a ``watch.Watch``); plugins import ``framework``,
never the reverse.  It does no I/O
and reads no clock: never ``nodesvc``, ``rdma``, ``aggregator``, ``scheduler.service`` or
``scheduler.cli``.  The libraries beside it, ``data`` and ``fetch`` (the shared data sets) and
``client`` (the HTTP API's client, httpx), may do I/O but import no shell either.
:mod:`scheduler.service` (floor 2) and :mod:`scheduler.cli` (floor 3) import this package; it
never imports them.

Public API (import from ``scheduler``)
======================================

Model (:mod:`scheduler.model`)
    ``Job(id, model, batch_size=0, gpus=1, cpus=0.0, memory_bytes=0, priority=0, arrival=0.0,
    attained_service=0.0, state=JobState.QUEUED, duration=None, features=None, gpu_memory_bytes=0,
    batch_sizes=(), remote_memory_bytes=0, user="", account="")``
    (``gpus=0``: a CPU-only data-preparation job, which must ask for ``cpus > 0`` and gets what it asks for;
    ``user``/``account``: its owner, for fair share and quotas, :mod:`scheduler.fairshare`);
    ``JobState`` (queued, running, preempted, done, failed); ``Node(id, gpus, cores, memory_bytes,
    lendable_bytes=0, gpu_memory_bytes=32 GiB)``; ``Shard(node, gpus)``; ``Allocation(cpus, memory_bytes)``;
    ``JobRecord`` (the core's per-job bookkeeping: ``shards``, ``allocation``, ``queueing_delay``...).
    ``cpus``/``memory_bytes`` of 0 mean "let the allocation plugin decide".

Events (:mod:`scheduler.events`): frozen dataclasses whose first fields are ``stimulus_id: str`` and
``now: float`` (seconds, the caller's clock), the project's one event convention
    ``JobArrived(stimulus_id, now, job)``, ``JobFinished(stimulus_id, now, job, failed=False, reason="")``,
    ``JobCancelled(stimulus_id, now, job, reason)``, ``PlacementFailed(stimulus_id, now, job, reason)``,
    ``Tick(stimulus_id, now)``, ``NodeReport(stimulus_id, now, node, gpu_util=(), cpu_percent=None,
    memory_available_bytes=None, jobs={job: JobSample(sm_percent, mem_percent, speed)}, running=None)``
    (the first report of a node registers it; ``running`` lists the jobs the node runs),
    ``NodeLost(stimulus_id, now, node)``, ``JobStarted(stimulus_id, now, job, node)`` (the node
    confirmed a start), ``JobBound(stimulus_id, now, job, node, gpus=(), hold_s=None)`` (another
    engine, Kubernetes, runs the job there: accounted for, never started),
    ``DonorReclaimed(stimulus_id, now, node, bytes)`` (a donor took lent memory back).

Decisions, each with the ``stimulus_id`` of the event that produced it
    ``Place(stimulus_id, job, shards, colocated_with=(), resumed=False)`` (``.node``/``.gpus`` give the
    first shard), ``Preempt(stimulus_id, job, reason)``, ``Allocate(stimulus_id, job, node, cpus,
    memory_bytes, remote_memory_bytes=0)`` (``remote_memory_bytes``: lent by donors), ``Reject(stimulus_id, job, reason)``, ``Release(stimulus_id, job, nodes, state,
    reason, stop)`` (the job left those nodes: stop and free it there; it is now ``state``),
    ``Wakeup(stimulus_id, at)`` (send a ``Tick`` at ``at``).

Core (:mod:`scheduler.state`)
    ``SchedulerState(profile, nodes=(), *, predictors=None, rng=random.Random(seed), rules=None)``
    (``rules``: :class:`scheduler.watch.WatchRules`, the clock-driven rules of a live cluster: start
    backoff, vanished jobs; off by default);
    ``state.handle(*events) -> list[Decision]`` (raises ``SchedulerError``, a ``ValueError``, for an
    event it cannot apply, leaving the state unchanged for that event);
    ``state.handle_batch(events) -> (decisions, refused)`` (a live shell's call: refused events are
    skipped and listed, the rest applied, one pass); ``state.compact()`` (forget finished jobs);
    read-only views of its
    books (``state.ledger``, a :class:`scheduler.ledger.Ledger`): ``state.records``
    (id -> JobRecord), ``state.nodes`` (id -> NodeState), ``state.waiting``, ``state.running``,
    ``state.now``, ``state.total_gpus``, ``state.free_gpus``;
    ``state.queue()`` (waiting jobs in start order), ``state.candidates(job, node_ids=None)``
    (feasible placements with weighted scores 0-100 x weight, best first; changes nothing: for
    the Kubernetes extender's filter/prioritize), ``state.explain(job, node_ids=None)``
    (node -> reason for each node that cannot take the job: the extender's ``FailedNodes``; the
    owner's quota, on every node, when that is what holds it), ``state.quota_reason(job)``,
    ``state.fair_share()`` (per owner: decayed usage, shares, Slurm's factor, the level the order uses).

    A live shell does: on submit ``JobArrived``; on a node's telemetry ``NodeReport``; on
    a ``run`` acknowledged ``JobStarted``; on a job exit ``JobFinished``; on the Last Will
    ``NodeLost``; on a ``Wakeup(at)`` a timer that sends ``Tick`` at ``at``; and it carries out
    ``Place`` (run), ``Preempt`` (stop, then the job is queued again by the core), ``Release``
    (stop and release), ``Allocate`` (node ``allocate`` command). ``Place`` is followed by the
    ``Allocate`` decisions for that node in the same list.

Profiles (:mod:`scheduler.profile`)
    ``load_profile(name_or_toml_path) -> Profile`` (packaged: ``packaged_profiles()``:
    fifo, srtf, las, tiresias, gittins, spread, gandiva, horus, iadeep, synergy, dlshare);
    ``ProfileError``. Plugins: :mod:`scheduler.framework` (the interfaces: ``QueueSort``, a base
    class, and ``Filter``/``Score``/``Allocator``; ``register``) and :mod:`scheduler.plugins`
    (the built-ins; ``build``, ``available``).

Predictors (:mod:`scheduler.predictors`)
    ``Predictors`` (the bundle the plugins read; ``Predictors.from_data()`` trains the interference
    model and loads the Synergy tables; ``observe`` is the online path from ``NodeReport`` samples),
    ``predictors.interference.InterferencePredictor`` (+ ``cross_validate``),
    ``predictors.utilisation.UtilisationPredictor`` / ``graph_features(module, example)`` (torch.fx),
    ``predictors.sensitivity.SensitivityModel``; each with ``fit``/``predict``/``update`` or
    ``add_profile``.

Waiting jobs (:mod:`scheduler.waiting`, :mod:`scheduler.forecast`): read the core, change nothing
    ``waiting.why_waiting(state, job_id) -> WaitReason(code, message, nodes)`` (Slurm-style codes:
    ``Resources``, ``Priority``, ``Gang``, ``LentMemory``, ``QuotaLimit``, ``Backoff``, ``NoNodes``,
    ``Placement``), ``waiting.explain_queue(state)`` (the queue in order, and each job's reason);
    ``forecast.forecast(state, DurationPrior(samples)) -> Forecast`` (when each waiting job would
    start: a copy of the core run forward through the same plugins, running jobs ending when the
    duration prior expects them to).

Simulator (:mod:`scheduler.sim`, :mod:`scheduler.trace`)
    ``trace.load_trace(path) -> list[TraceJob]`` (``TraceError`` names the row),
    ``sim.Cluster.parse("16x4")``, ``sim.simulate(trace, cluster, profile, seed=0) -> SimResult``
    (``.metrics()``: JCT mean/median/p99, makespan, queueing delay, GPU/CPU/memory utilisation),
    ``sim.synthetic_trace(n_jobs, total_gpus, load, seed)``.

Codec (:mod:`scheduler.codec`)
    ``event_to_dict``/``event_from_dict`` (``CodecError`` names the bad field) and
    ``decision_to_dict``/``decision_from_dict``: JSON-ready forms for event logs, replay and the API.

Data (:mod:`scheduler.data`): ``data_dir()``, ``path(rel)``; ``dlshare data fetch`` fills the cache.
"""

from scheduler.events import (
    Allocate, Decision, DonorReclaimed, Event, JobArrived, JobBound, JobCancelled, JobFinished, JobSample, JobStarted, NodeLost,
    NodeReport, Place, PlacementFailed, Preempt, Reject, Release, Tick, Wakeup,
)
from scheduler.model import Allocation, Job, JobRecord, JobState, Node, Shard
from scheduler.predictors import Predictors
from scheduler.profile import Profile, ProfileError, load_profile, packaged_profiles
from scheduler.state import SchedulerError, SchedulerState
from scheduler.watch import WatchRules

__all__ = [
    "Allocate", "Allocation", "Decision", "DonorReclaimed", "Event", "Job", "JobArrived", "JobBound", "JobCancelled", "JobFinished",
    "JobRecord", "JobSample", "JobStarted", "JobState", "Node", "NodeLost", "NodeReport", "Place", "PlacementFailed",
    "Preempt", "Predictors", "Profile", "ProfileError", "Reject", "Release", "SchedulerError", "SchedulerState",
    "Shard", "Tick", "Wakeup", "WatchRules", "load_profile", "packaged_profiles",
]
