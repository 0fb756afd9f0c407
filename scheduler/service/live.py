"""The live loop: the asyncio shell around the pure scheduler core.

:class:`SchedulerService` owns the MQTT connection to the node daemons and the
loop that feeds the core.  It holds its parts:

* ``translator`` (:class:`~scheduler.service.translate.Translator`): node
  messages -> core events (telemetry, Last Wills, job exits);
* ``carrier`` (:class:`~scheduler.service.decisions.DecisionCarrier`): each
  batch through ``SchedulerState.handle_batch``, logged with its decisions
  before anything leaves, then the decisions -> rows and node commands;
* ``commands`` (:class:`~scheduler.service.commands.NodeCommands`): the
  command path to nodes (QoS 1, replies correlated by id);
* ``recovery`` (:class:`~scheduler.service.recovery.Recovery`): the core from
  its snapshot and log at start, and the re-sending of what was never acked;
* ``journal`` (:class:`~scheduler.service.journal.Journal`): the core's log and
  its snapshots, compacted every ``snapshot_events`` events.

Every placement, allocation, backoff and vanished-job finding is the core's
(its plugins and :mod:`scheduler.watch`, on the events' times): this shell only
translates.  Its clock is injected (``clock``); the core sees it only as the
``now`` of events, and ``Tick`` events answer the core's ``Wakeup`` decisions.

Threads.  The loop runs on one thread; the HTTP API may run on another
(``dlshare sched`` does, so that node replies and telemetry never wait behind
HTTP work).  The API reaches the loop only through :meth:`call` (run a function
on the loop's thread and await its result) and :meth:`call_soon`; it inserts
accepted jobs itself (its own SQLite connection, group commit) and hands them
over with :meth:`accepted`.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from scheduler import (
    Event, JobArrived, JobBound, JobCancelled, JobFinished, JobState, NodeLost, NodeReport, Profile, SchedulerState, Tick,
    Wakeup, WatchRules, load_profile, snapshot,
)
from scheduler.model import Job
from scheduler.service.commands import NodeCommands
from scheduler.service.core_log import core_job
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.decisions import DecisionCarrier
from scheduler.service.history import ClusterHistory, point
from scheduler.service.journal import Journal
from scheduler.service.metrics import SchedulerMetrics
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.nodes import LiveNode
from scheduler.service.pending import PendingJobs, philly_prior
from scheduler.service.recovery import Recovery
from scheduler.service.stats import ServiceStats
from scheduler.service.rows import JobRow, Owner, WaitingLimits
from scheduler.service.store import JobStore
from scheduler.service.translate import Translator
from scheduler.service.views import cluster_view

if TYPE_CHECKING:  # pragma: no cover
    from nodesvc.bus.mqtt import Bus
    from scheduler.service.k8s_api import KubeBinder

log = logging.getLogger("dlshare.sched.live")

# The live cluster's clock-driven rules (scheduler.watch): a failed start waits 0.5 s, doubling to 30 s;
# a started job its node has not listed for 15 s (three of the daemon's 5 s telemetry periods) vanished.
LIVE_RULES = WatchRules(backoff_s=0.5, backoff_max_s=30.0, vanish_after_s=15.0)
# Commands (QoS 1) on their way to the broker at once: paho's default of 20 made a burst's 500th
# `run` wait for 480 acknowledgements before it left.
COMMANDS_IN_FLIGHT = 1000


class SchedulerService:
    """The live loop (see the module docstring).

    ``profile``: a packaged name, a TOML path or a :class:`Profile`; ``predictors``: the
    bundle for a fresh core, or a function that makes it (only called when no usable
    snapshot exists: training takes seconds); ``core``: a ready core instead (tests);
    ``rules``: the :class:`WatchRules` (default :data:`LIVE_RULES`); ``snapshot_events``:
    events between snapshots (the most a restart replays); ``snapshot_core_s``: also snapshot once
    the core spent this long on the batches since the last one (a restart replays about that much
    work, whatever the events' mix); ``snapshot_s``: at most this long between snapshots while
    events come; ``limits``: the admission limits per user and account;
    ``default_user``: the user a job without an owner runs as (jobs from before owners were kept,
    and in-process submissions without one): the bootstrap token's user.  ``reasons_s``,
    ``forecast_s``, ``prior``, ``reason_event_gap_s``: how often waiting jobs are explained and their
    starts estimated, the duration prior's maker, and the least time between two events of a job whose
    reason changed its numbers only (:mod:`scheduler.service.pending`); ``history_step_s``,
    ``history_keep_s``: the cluster's history (:mod:`scheduler.service.history`)."""

    def __init__(self, store: JobStore, profile: str | Path | Profile = "dlshare", broker_url: str | None = None,
                 service_id: str = "sched", tick_s: float = 2.0, command_timeout_s: float = 10.0,
                 node_timeout_s: float = 30.0, report_s: float = 10.0,
                 clock: Callable[[], float] = time.time, core: SchedulerState | None = None,
                 predictors: Any = None, rules: WatchRules | None = None, snapshot_events: int = 2000,
                 snapshot_s: float = 120.0, snapshot_core_s: float = 1.0, limits: WaitingLimits = WaitingLimits(),
                 default_user: str = "",
                 reasons_s: float = 1.0, forecast_s: float = 10.0, prior: Callable[[], Any] = philly_prior,
                 reason_event_gap_s: float = 300.0,
                 history_step_s: float = 10.0, history_keep_s: float = 86400.0, url: str = "") -> None:
        self.store = store
        self.journal = Journal(store)
        self.profile_obj = core.profile if core is not None else (
            profile if isinstance(profile, Profile) else load_profile(profile))
        self.profile = self.profile_obj.name
        self.rules = core.watch.rules if core is not None else (rules if rules is not None else LIVE_RULES)
        self.broker_url = broker_url
        self.service_id = service_id
        self.tick_s = tick_s
        self.command_timeout_s = command_timeout_s
        self.node_timeout_s = node_timeout_s
        self.report_s = report_s
        self.url = url  # where its HTTP API listens, for `dlshare status` (its retained state says it)
        self._said: tuple[int, int] | None = None  # the job counts its state message last carried
        self._said_at = 0.0
        self._publishing: set[asyncio.Task] = set()
        self.clock = clock
        self.snapshot_events = snapshot_events
        self.snapshot_s = snapshot_s
        self.snapshot_core_s = snapshot_core_s
        self.limits = limits
        self.default_user = default_user
        self.nodes: dict[str, LiveNode] = {}  # the live node table
        self.aggregation: dict[str, dict[str, Any]] = {}  # aggregation server -> its last telemetry
        self.bus: Bus | None = None
        self.k8s_binder: KubeBinder | None = None
        self.k8s_hold_s: float | None = 120.0  # a bound pod's hold (None: until PodSync sees the pod end)
        self.k8s_order = False  # the extender imposes the core's order on kube-scheduler (k8s.order_refusal)
        self.k8s_waiting: dict[str, Any] = {}  # PodSync's last list: the dlshare pods not bound yet
        self.batch_window_s = 0.01  # gather the events of this long into one core batch under load
        self.batch_max_events = 1000  # a core batch takes at most this many events (the rest: the next one)
        self.batch_max_lost = 10  # ... and at most this many lost nodes (a requeue storm goes in slices)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats = ServiceStats()
        self.commands = NodeCommands(command_timeout_s)
        self._wake = asyncio.Event()
        self._events: list[Event] = []  # for the core's next batch
        self._wakeups: list[float] = []  # the Tick times the core asked for (a heap)
        self._bus_stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_service = 0.0
        self._last_snapshot = clock()
        self._snapshotting = False
        self._snapshot_write: asyncio.Future | None = None
        self._submissions: list[tuple[str | None, dict[str, Any], Owner, asyncio.Future]] = []
        self._committing = False

        def fresh() -> SchedulerState:
            if core is not None:
                return core
            p = predictors() if callable(predictors) and not hasattr(predictors, "observe") else predictors
            return SchedulerState(self.profile_obj, predictors=p, rules=self.rules)

        self.recovery = Recovery(self)
        self.core: SchedulerState = self.recovery.restore(fresh)
        self.journal.set_meta("profile", str(profile) if core is None and not isinstance(profile, Profile)
                              else self.profile)
        self.journal.set_meta("rules", json.dumps(asdict(self.rules), sort_keys=True))
        self.carrier = DecisionCarrier(store, self.journal, self.core, self.commands, clock, self.now, self.post,
                                       self._observe, default_user=default_user)
        self.translator = Translator(self, self.post)
        self.recovery.reconcile()
        self.stats.restore = self.recovery.report
        self.pending = PendingJobs(store, reasons_s=reasons_s, forecast_s=forecast_s, prior=prior,
                                   event_gap_s=reason_event_gap_s)
        self.history = ClusterHistory(store, history_step_s, history_keep_s)
        self.metrics = SchedulerMetrics(self.profile, _version())
        self._last_batch_s = 0.0

    # --- time, events and threads -----------------------------------------------------------

    def now(self) -> float:
        return max(self.clock(), self.core.now)

    def post(self, ev: Event) -> None:
        """Queue a core event for the next batch (on the loop's thread)."""
        self._events.append(ev)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _on_loop(self) -> bool:
        if self.loop is None:
            return True
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop's thread (awaited if it is a coroutine function) and return
        its result; from the loop's own thread, or before the loop runs, it is called directly."""
        if self._on_loop():
            res = fn(*args)
            return await res if inspect.isawaitable(res) else res

        async def run() -> Any:
            res = fn(*args)
            return await res if inspect.isawaitable(res) else res

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop's thread soon (directly when already there)."""
        if self._on_loop():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # --- API side ---------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any], owner: Owner = Owner()) -> tuple[JobRow, bool]:
        """Persist a validated spec as a queued job of ``owner`` (on the loop's thread); raises
        ConflictError or QuotaError."""
        job_id = spec.pop("id", None)
        row, created = self.store.add_job(job_id, spec, owner, self.limits)
        if created:
            self.accepted([row])
        return row, created

    async def submit_async(self, spec: dict[str, Any], owner: Owner = Owner()) -> tuple[JobRow, bool]:
        """:meth:`submit` for the API's thread, with group commit: submissions that arrive while a
        commit runs share the next transaction (and its fsync), which runs off the event loop."""
        fut = asyncio.get_running_loop().create_future()
        self._submissions.append((spec.pop("id", None), spec, owner, fut))
        if not self._committing:
            self._committing = True
            asyncio.get_running_loop().create_task(self._commit_submissions())
        res = await fut
        if isinstance(res, Exception):
            raise res
        return res

    async def _commit_submissions(self) -> None:
        try:
            while self._submissions:
                batch, self._submissions = self._submissions, []
                try:
                    results = await asyncio.to_thread(self.store.add_jobs,
                                                      [(jid, spec, owner) for jid, spec, owner, _ in batch], self.limits)
                except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                    for _, _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                created = [res[0] for res in results if not isinstance(res, Exception) and res[1]]
                if created:
                    self.call_soon(self.accepted, created, time.time())
                for (_, _, _, fut), res in zip(batch, results):
                    if not fut.done():
                        fut.set_result(res)
        finally:
            self._committing = False

    def accepted(self, rows: list[JobRow], committed: float | None = None) -> None:
        """Jobs committed to the table (at ``committed``, wall clock): they arrive at the core (on
        the loop's thread)."""
        t = time.time()
        for row in rows:
            self.carrier.track(row.id, committed=committed or t, queued=t)
            self.post(JobArrived(_eid(), self.now(), core_job(row, self.now())))
        self.metrics.submitted.inc(len(rows))

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRow | None:
        """Cancel a job (on the loop's thread): the row says so durably, then the core ends it
        and releases it where it runs."""
        job = self.store.get_job(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return job
        self.store.update_job(job_id, event="cancelled", node=job.allocation.node if job.allocation else None,
                              state="cancelled", reason=reason, finished_at=self.clock(),
                              allocation=None, durable=True, only_active=True)
        self.post(JobCancelled(_eid(), self.now(), job_id, reason))
        return self.store.get_job(job_id)

    def bind(self, job: Job, node: str, uid: str = "") -> str:
        """Kubernetes bound ``job`` (a pod) to ``node``: a core event, logged and replayed like any
        other.  Returns an error ("" when taken)."""
        if not self.node_online(node):
            return f"node {node} has no online dlshare node daemon"
        self.store.log_event("k8s_bind", node=node, data={"pod": job.id, "uid": uid, "cpus": job.cpus,
                                                           "memory_bytes": job.memory_bytes, "gpus": job.gpus})
        self.post(JobBound(_eid(), self.now(), job, node, (), self.k8s_hold_s))
        return ""

    def node_online(self, node: str) -> bool:
        view, ns = self.nodes.get(node), self.core.nodes.get(node)
        return view is not None and view.status == "online" and ns is not None and ns.alive

    def cluster(self) -> dict[str, Any]:
        return cluster_view(self.core, self.nodes.values(), self.aggregation.values(), self.store.count_by_state(),
                            self.profile, self.clock())

    def metrics_view(self) -> bytes:
        """``GET /metrics``: the gauges from the cluster now (on the loop's thread), then every series."""
        self.metrics.snapshot(self.cluster(), self.core, self.pending, self.now())
        return self.metrics.render()

    def history_view(self, since: float, max_points: int) -> dict[str, Any]:
        return self.history.columns(since, max_points)

    def stats_view(self) -> dict[str, Any]:
        out = self.stats.to_json()
        out.update(queued_events=len(self._events), commands_in_flight=self.commands.correlator.in_flight,
                   core={"jobs": len(self.core.records), "waiting": len(self.core.waiting),
                         "running": len(self.core.running), "nodes": len(self.core.nodes)},
                   last_batch=self.carrier.batch, events_since_snapshot=self.carrier.events_logged,
                   k8s_waiting_pods=len(self.k8s_waiting))
        return out

    # --- MQTT -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.broker_url:
            from nodesvc.bus.mqtt import Bus

            self.bus = Bus(
                self.broker_url, f"dlshare-sched-{self.service_id}-{uuid.uuid4().hex[:6]}",
                subscriptions=[(messages.topic("node", "+", leaf), 1) for leaf in ("telemetry", "state", "reply", "events")]
                + [(messages.topic("agg", "+", "telemetry"), 0), (messages.topic("agg", "+", "state"), 1)],
                handler=self.on_message, on_connect=self._on_connect, max_inflight=COMMANDS_IN_FLIGHT,
                will=(messages.topic("sched", self.service_id, "state"), messages.encode({"status": "offline"}), 1, True))
            self.commands.bus = self.bus
            self._bus_stop = asyncio.Event()
            self._tasks.append(asyncio.create_task(self.bus.run(self._bus_stop), name="sched-bus"))
        self._tasks.append(asyncio.create_task(self._loop(), name="sched-loop"))

    async def stop(self) -> None:
        if self.bus is not None and self._bus_stop is not None:
            await self.bus.publish(messages.topic("sched", self.service_id, "state"),
                                   messages.encode({"status": "offline", "ts": self.clock()}), 1, True)
            self._bus_stop.set()
        for t in self._tasks:
            t.cancel()
        if self._snapshot_write is not None:  # the store closes after this: let the write end first
            await asyncio.gather(self._snapshot_write, return_exceptions=True)
        await self.commands.close()
        self.carrier.flush_acks()  # the acknowledgements of this last turn, before the store closes
        # Their ends, errors included, are the shutdown; a cancel of stop() itself still propagates.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _state(self) -> bytes:
        """The retained state message: online, its profile, its API's URL and its jobs right now."""
        self._said = (len(self.core.waiting), len(self.core.running))
        doc = {"status": "online", "ts": self.clock(), "profile": self.profile,
               "jobs": {"waiting": self._said[0], "running": self._said[1]}}
        if self.url:
            doc["url"] = self.url
        return messages.encode(doc)

    async def _on_connect(self, bus) -> None:
        await bus.publish(messages.topic("sched", self.service_id, "state"), self._state(), 1, True)
        self.recovery.resume()
        self.wake()

    async def on_message(self, topic: str, payload: bytes) -> None:
        try:
            kind, ident, leaf = messages.parse_topic(topic)
        except PayloadError as exc:
            log.warning("ignoring message: %s", exc)
            return
        try:
            if kind == "agg":
                if leaf == "telemetry":
                    self.aggregation[ident] = {**messages.decode(payload), "_seen": self.clock()}
                elif leaf == "state" and (not payload or messages.decode(payload).get("status") == "offline"):
                    self.aggregation.pop(ident, None)
            elif kind != "node":
                return
            elif leaf == "telemetry":
                self.translator.on_telemetry(messages.parse_telemetry(payload))
            elif leaf == "state":
                self.translator.on_node_state(ident, messages.decode(payload) if payload else {"status": "offline"})
            elif leaf == "reply":
                self.commands.resolve(messages.decode(payload))
            elif leaf == "events":
                self.translator.on_event(ident, messages.decode(payload))
        except PayloadError as exc:
            log.warning("bad %s payload from %s/%s: %s", leaf, kind, ident, exc)

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        if self.bus is not None:  # decisions made before the first connect could not be carried out
            await self.bus.connected.wait()
        while True:
            timeout = self.tick_s
            if self._wakeups:
                timeout = max(0.0, min(timeout, self._wakeups[0] - self.clock()))
            if self.pending.busy:  # a start-estimate replay under way: its next slice soon
                timeout = min(timeout, 0.01)
            expect = time.monotonic() + timeout
            try:
                # Not ``wait_for``: on 3.11 it returns, swallowing the cancel, when stop() cancels
                # this task in the step the wake-up lands, and the loop then never ends.
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                self.stats.loop_lag.add(max(0.0, time.monotonic() - expect))
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)  # one scheduling pass for a burst, not one per event
            self._wake.clear()
            try:
                self.round()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("scheduling round failed")

    def round(self) -> None:
        """One pass: stale nodes, due Ticks, one core batch, service accounting, a snapshot when due."""
        now = self.clock()
        part = self.stats.part
        t0 = time.perf_counter()
        self.translator.check_stale(now)
        t1 = time.perf_counter()
        part("stale", t1 - t0)
        due = False
        while self._wakeups and self._wakeups[0] <= now:
            heapq.heappop(self._wakeups)
            due = True
        if due:
            self._events.append(Tick(_eid(), self.now()))
        if self._events:
            batch = self._take_batch()
            decisions = self.carrier.run_batch(batch)
            for d in decisions:
                if isinstance(d, Wakeup) and d.at not in self._wakeups:
                    heapq.heappush(self._wakeups, d.at)
            self.translator.exiting.clear()
            self._batch_done(batch, decisions)
            if self._events:  # the rest of a storm: its next slice at once
                self._wake.set()
        t2 = time.perf_counter()
        part("batch", t2 - t1)
        if now - self._last_service >= 5.0:
            self._last_service = now
            self._account()
            t3 = time.perf_counter()
            part("account", t3 - t2)
            t2 = t3
        self._watch_queue(now)
        self._say_counts(now)
        t3 = time.perf_counter()
        part("queue", t3 - t2)
        if self.maybe_snapshot(now):
            part("snapshot", time.perf_counter() - t3)

    def _take_batch(self) -> list[Event]:
        """The core's next batch from the queued events, in their order: a node's reports superseded
        by a later one of the same node are dropped (each carries the node's whole state: only the
        latest matters), and a storm is cut in slices (at most ``batch_max_events`` events and
        ``batch_max_lost`` lost nodes a batch; the rest waits, in order, for the next round).
        The log holds the batches as the core saw them, so a replay cuts them the same way."""
        events = self._events
        latest: dict[str, int] = {}
        for i, ev in enumerate(events):
            if isinstance(ev, NodeReport):
                latest[ev.node.id] = i
        if len(latest) < sum(1 for ev in events if isinstance(ev, NodeReport)):
            kept = []
            for i, ev in enumerate(events):
                if isinstance(ev, NodeReport) and latest[ev.node.id] != i:
                    self.translator.published.pop(ev.stimulus_id, None)
                    self.stats.coalesced += 1
                    continue
                kept.append(ev)
            events = kept
        cut, lost = len(events), 0
        for i, ev in enumerate(events):
            if i >= self.batch_max_events:
                cut = i
                break
            if isinstance(ev, NodeLost):
                lost += 1
                if lost > self.batch_max_lost:
                    cut = i
                    break
        self._events = events[cut:]
        return events[:cut]

    def _batch_done(self, batch: list[Event], decisions: list[Any]) -> None:
        """Metrics of a batch, and the run times of the jobs it finished (the estimates' prior)."""
        try:
            self.metrics.batch(batch, decisions, self.core, self._last_batch_s)
            for ev in batch:
                rec = self.core.records.get(getattr(ev, "job", "")) if isinstance(ev, JobFinished) else None
                if rec is not None and rec.job.state is JobState.DONE and not rec.external:
                    self.pending.finished(rec)
        except Exception:  # noqa: BLE001 - figures must never stop the loop
            log.exception("accounting a batch's metrics failed")

    def _watch_queue(self, now: float) -> None:
        """Why the waiting jobs wait and when they should start; a history point when one is due."""
        try:
            self.pending.advance()
            self.pending.refresh(self.core, self.now())
            if self.history.due(now):
                t = self.now()
                waits = [t - r.job.arrival for r in self.core.waiting.values()]
                self.history.add(now, point(self.cluster(), waits))
        except Exception:  # noqa: BLE001 - the queue's figures must never stop the loop
            log.exception("explaining the queue failed")

    def _observe(self, events: list[Event], seconds: float) -> None:
        st = self.stats
        self._last_batch_s = seconds
        st.batch.add(seconds)
        st.batches += 1
        st.events += len(events)
        published = self.translator.published
        if published:
            t = self.clock()
            for ev in events:
                if isinstance(ev, NodeReport):
                    pub = published.pop(ev.stimulus_id, None)
                    if pub is not None:
                        st.telemetry_to_core(t - pub)

    # --- snapshots --------------------------------------------------------------------------

    def maybe_snapshot(self, now: float, force: bool = False) -> bool:
        """Snapshot the core and compact the log when ``snapshot_events`` events were logged since
        the last one, the core spent ``snapshot_core_s`` on them, or ``snapshot_s`` passed with any;
        the write runs off the loop."""
        n = self.carrier.events_logged
        if self._snapshotting or n == 0 or not (force or n >= self.snapshot_events
                                                 or self.carrier.core_s >= self.snapshot_core_s
                                                 or now - self._last_snapshot >= self.snapshot_s):
            return False
        t0 = time.perf_counter()
        self.core.compact()
        batch = self.carrier.batch
        data = snapshot.dump(self.core, {"batch": batch})
        header = snapshot.header(data)
        self.carrier.events_logged = 0
        self.carrier.core_s = 0.0
        self._last_snapshot = now
        dump_s = time.perf_counter() - t0

        def write() -> None:
            t1 = time.perf_counter()
            try:
                dropped = self.journal.write_snapshot(batch, data, header)
            except Exception:  # noqa: BLE001 - the log stays whole; the next snapshot tries again
                log.exception("writing the core snapshot after batch %d failed", batch)
                return
            finally:
                self._snapshotting = False
            self.stats.snapshot = {"batch": batch, "bytes": len(data), "events_dropped": dropped,
                                   "dump_ms": dump_s * 1e3, "write_ms": (time.perf_counter() - t1) * 1e3}

        self._snapshotting = True
        if self.loop is not None and self._on_loop():
            self._snapshot_write = self.loop.run_in_executor(None, write)
        else:
            write()
        return True

    # --- accounting ---------------------------------------------------------------------------

    def _say_counts(self, now: float) -> None:
        """Publish the state again when the job counts it carries changed, at most once a second, so
        `dlshare status` shows the queue without asking the API."""
        if self.bus is None or not self.bus.connected.is_set() or self.loop is None or now - self._said_at < 1.0:
            return
        if (len(self.core.waiting), len(self.core.running)) == self._said:
            return
        self._said_at = now
        task = self.loop.create_task(self.bus.publish(messages.topic("sched", self.service_id, "state"), self._state(),
                                                      1, True))
        self._publishing.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._publishing.discard)

    def _account(self) -> None:
        """Attained service of running jobs into the table (for the API), from the core, no scan:
        GPU-seconds, or CPU-seconds for a CPU-only job."""
        t = self.now()
        amounts: dict[str, float] = {}
        for jid, rec in self.core.running.items():
            if rec.external:
                continue
            if rec.job.cpu_only:
                amounts[jid] = sum(a.cpus for a in rec.allocation.values()) * max(0.0, t - (rec.run_since or t))
            else:
                amounts[jid] = rec.service(t)
        self.store.set_service(amounts)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dlshare")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout that was never installed
        return "0"


__all__ = ["LIVE_RULES", "SchedulerService"]
