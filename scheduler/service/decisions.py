"""Carrying out the scheduler core's decisions: rows in the jobs table and commands to nodes.

:class:`DecisionCarrier` hands each batch of events to the core
(``SchedulerState.handle_batch``), logs the batch with every decision it
produced in one transaction before anything leaves (:mod:`~scheduler.service.journal`,
the log the service replays at start), and then translates each decision,
with no policy of its own:

* ``Place``: the job's row (running, its typed :class:`JobAllocation`) and one
  ``run`` per shard, which applies the allocation and starts the process group.
  A node's answer becomes ``JobStarted``; a refusal or a timeout
  ``PlacementFailed`` (the core backs the job off and requeues it).
* ``Preempt``: the row (preempted), then ``stop`` and ``release`` on its nodes.
* ``Release``: the row (queued again, or failed when the core found it gone),
  then ``stop`` (when asked) and ``release`` on the nodes it left.
* ``Allocate``: the row's cores and memory, and an ``allocate`` command (not for
  a job placed in the same batch: its ``run`` carries them).
* ``Reject``: the row (failed).

Jobs another engine runs (bound Kubernetes pods) get no command.  Commands
about one job run in order; their ids derive from the decision's id, so a
command re-sent after a restart is answered from the node's reply cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from nodesvc.bus.rpc import CommandError
from scheduler import (
    Allocate, Decision, Event, JobArrived, JobStarted, JobState, Place, PlacementFailed, Preempt, Reject, Release,
    SchedulerState, Wakeup,
)
from scheduler.codec import decision_to_dict
from scheduler.service.commands import NodeCommands
from scheduler.service.core_log import encode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.journal import Journal
from scheduler.service.rows import DecisionRow, JobAllocation
from scheduler.service.store import JobStore

log = logging.getLogger("dlshare.sched.live")
AGG_SECRET_ENV = "DLSHARE_AGG_SECRET"  # where aggregator.Client reads the secret (aggregator.protocol.SECRET_ENV)


def decision_ids(decisions: list[Decision]) -> list[str]:
    """Each decision's id in the decisions table and in its commands' ids: the same on a replay.
    An id that repeats in one batch (a job's allocation changed twice) gets ``#2``, ``#3``..."""
    out, seen = [], {}
    for d in decisions:
        kind = type(d).__name__.lower()
        if isinstance(d, Allocate):
            did = f"{d.stimulus_id}/{kind}/{d.job}/{d.node}"
        elif isinstance(d, Wakeup):
            did = f"{d.stimulus_id}/{kind}"
        else:
            did = f"{d.stimulus_id}/{kind}/{d.job}"
        n = seen[did] = seen.get(did, 0) + 1
        out.append(did if n == 1 else f"{did}#{n}")
    return out


class DecisionCarrier:
    """Feeds the core and carries out its decisions (see the module docstring).

    ``now`` is the service's clock as the core sees it; ``post`` queues an event
    for the core's next batch; ``observe(batch_events, seconds)`` hears of each batch."""

    def __init__(self, store: JobStore, journal: Journal, core: SchedulerState, commands: NodeCommands,
                 clock: Callable[[], float], now: Callable[[], float], post: Callable[[Event], None],
                 observe: Callable[[list[Event], float], None] | None = None, default_user: str = "") -> None:
        self.store = store
        self.journal = journal
        self.core = core
        self.commands = commands
        self.clock = clock
        self.now = now
        self.post = post
        self.observe = observe
        self.default_user = default_user  # who a job without an owner runs as
        self._agg_key: bytes | None = None
        self.batch = journal.last_batch()  # the number of the last logged batch
        self.events_logged = 0  # since the last snapshot (the service counts)
        self.core_s = 0.0  # the core's time on the batches since the last snapshot (what a restart replays)
        # job -> wall-clock times of the stages on its way to running (the ``started`` event
        # carries them): committed, queued (on the loop), batch (its arrival's core batch began),
        # decided (the placing batch began), logged (that batch's transaction committed), sent,
        # node, reply (see NodeCommands.send).  Only jobs accepted by this process are timed.
        self.stages: dict[str, dict[str, float]] = {}
        self._acks: list[tuple[str, str | None, str | None, dict[str, Any] | None]] = []  # see ack()
        self._ack_flush: Any = None  # the loop's handle of the flush to come

    def ack(self, did: str, job: str | None = None, node: str | None = None,
            started: dict[str, Any] | None = None) -> None:
        """Decision ``did`` was carried out (and, with ``started``, its job runs on ``node``: the
        ``started`` event with that data).  The rows change in one transaction with every other
        acknowledgement of this turn of the loop, not one each: under a burst, each transaction of
        the loop's would wait behind the API's fsync.  A crash before it commits leaves the
        decision pending, and a restart re-sends it under its id (the node answers from its reply
        cache), as a crash a moment before the acknowledgement would."""
        self._acks.append((did, job, node, started))
        if self._ack_flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (in-process use): at once
            self.flush_acks()
            return
        self._ack_flush = loop.call_soon(self.flush_acks)

    def flush_acks(self) -> None:
        self._ack_flush = None
        acks, self._acks = self._acks, []
        if not acks:
            return
        with self.store.tx():
            for did, job, node, started in acks:
                self.store.set_decision_state(did, "acked")
                if started is not None:
                    self.store.log_event("started", job=job, node=node, data=started)

    def time_stage(self, job: str, stage: str, t: float) -> None:
        st = self.stages.get(job)
        if st is not None:
            st.setdefault(stage, t)

    def track(self, job: str, **times: float) -> None:
        """Start timing ``job``'s stages (bounded: the oldest entries go first)."""
        self.stages[job] = dict(times)
        while len(self.stages) > 20000:
            self.stages.pop(next(iter(self.stages)))

    def run_batch(self, events: list[Event]) -> list[Decision]:
        """Hand ``events`` to the core as one batch, log them with the decisions in one
        transaction, then carry the decisions out.  Returns the decisions (the loop keeps
        the :class:`Wakeup` ones)."""
        t0 = time.perf_counter()
        wall0 = time.time()
        if self.stages:
            for ev in events:
                if isinstance(ev, JobArrived):
                    self.time_stage(ev.job.id, "batch", wall0)
        decisions, refused = self.core.handle_batch(events)
        self.core_s += time.perf_counter() - t0
        for sid, why in refused:
            log.info("core refused event %s: %s", sid, why)
        self.batch += 1
        ids = decision_ids(decisions)
        states = self._initial_states(decisions)
        dicts = [decision_to_dict(d) for d in decisions]
        rows = [DecisionRow(id=did, kind=type(d).__name__.lower(), job=getattr(d, "job", None),
                            node=getattr(d, "node", None) if isinstance(d, Allocate) else None,
                            data=data, state=state, batch=self.batch)
                for d, did, state, data in zip(decisions, ids, states, dicts) if state is not None]
        allocs = {(d.job, d.node): d for d in decisions if isinstance(d, Allocate)}
        # The batch's log and every row it changes: one transaction, before any command leaves.
        with self.store.tx():
            self.journal.record_batch(self.batch, [(ev.stimulus_id, encode_event(ev)) for ev in events], dicts, rows)
            for d, state in zip(decisions, states):
                if state is not None and not isinstance(d, Allocate):
                    self.carry_out_rows(d, allocs)
            self.store.set_allocations([(d.job, d.node, d.cpus, d.memory_bytes, d.remote_memory_bytes)
                                        for (job, node), d in allocs.items()
                                        if not any(isinstance(p, Place) and p.job == job for p in decisions)])
        self.events_logged += len(events)
        if self.stages:
            wall1 = time.time()
            for d in decisions:
                if isinstance(d, Place) and d.job in self.stages:
                    self.time_stage(d.job, "decided", wall0)
                    self.time_stage(d.job, "logged", wall1)
        if self.observe is not None:
            self.observe(events, time.perf_counter() - t0)
        for d, did, state in zip(decisions, ids, states):
            if state == "pending":
                self.commands.spawn(self.carry_out(d, did), key=d.job)
        return decisions

    def _initial_states(self, decisions: list[Decision]) -> list[str | None]:
        """Per decision: "pending" (commands to send), "done" (a row to change, nothing to send)
        or None (a Wakeup: the loop's)."""
        placed = {(s.node, d.job) for d in decisions if isinstance(d, Place) for s in d.shards}
        last_alloc = {(d.job, d.node): i for i, d in enumerate(decisions) if isinstance(d, Allocate)}
        out: list[str | None] = []
        for i, d in enumerate(decisions):
            rec = self.core.records.get(getattr(d, "job", ""))
            external = rec is not None and rec.external
            if isinstance(d, Wakeup):
                out.append(None)
            elif isinstance(d, Allocate):
                send = not external and (d.node, d.job) not in placed and last_alloc[(d.job, d.node)] == i
                out.append("pending" if send else "done")
            elif isinstance(d, (Place, Preempt)):
                out.append("done" if external else "pending")
            elif isinstance(d, Release):
                out.append("pending" if d.nodes and not external else "done")
            else:
                out.append("done")
        return out

    # --- rows ---------------------------------------------------------------------------------

    def carry_out_rows(self, d: Decision, allocs: dict[tuple[str, str], Allocate]) -> None:
        """The jobs table's side of a decision (bound pods have no row: nothing changes).  An
        ``Allocate``'s row change is made for the whole batch at once (``set_allocations``)."""
        if isinstance(d, Reject):
            self.store.update_job(d.job, event="rejected", state="failed", reason=d.reason, finished_at=self.clock(),
                                  only_active=True)
        elif isinstance(d, Place):
            self.mark_placed(d, allocs)
        elif isinstance(d, Preempt):
            row = self.store.get_job(d.job)
            if row is not None and row.state == "running":
                self.store.update_job(d.job, event="preempted", node=d.nodes[0] if d.nodes else None,
                                      event_data={"why": d.reason}, state="preempted", reason=d.reason,
                                      allocation=None, only_active=True)
        elif isinstance(d, Release):
            self._released(d)

    def mark_placed(self, d: Place, allocs: dict[tuple[str, str], Allocate]) -> None:
        row = self.store.get_job(d.job)
        if row is None:
            return
        al = allocs.get((d.job, d.node))
        rec = self.core.records.get(d.job)
        core_alloc = rec.allocation.get(d.node) if rec is not None and rec.placed_by == d.stimulus_id else None
        spec = row.spec
        cpus = al.cpus if al else core_alloc.cpus if core_alloc else float(spec.get("cpus") or 1.0)
        mem = al.memory_bytes if al else core_alloc.memory_bytes if core_alloc else int(spec.get("memory_bytes") or 0)
        remote = al.remote_memory_bytes if al else core_alloc.remote_bytes if core_alloc else 0
        alloc = JobAllocation(node=d.node, gpus=tuple(d.gpus), cpus=cpus, memory_bytes=mem, remote_memory_bytes=remote,
                              shards=tuple((s.node, tuple(s.gpus)) for s in d.shards),
                              colocated_with=tuple(d.colocated_with), requested_cpus=float(spec.get("cpus") or 0.0),
                              requested_memory_bytes=int(spec.get("memory_bytes") or 0))
        self.store.update_job(d.job, event="placed", node=d.node,
                              event_data={"gpus": list(d.gpus), "cpus": cpus, "memory_bytes": mem,
                                          "remote_memory_bytes": remote,
                                          "colocated_with": list(d.colocated_with), "resumed": d.resumed,
                                          "nodes": [s.node for s in d.shards], "decision": decision_ids([d])[0]},
                              state="running", allocation=alloc, started_at=self.clock(), attempts=row.attempts + 1,
                              reason=("co-located with " + ", ".join(d.colocated_with)) if d.colocated_with else None,
                              only_active=True)

    def _released(self, d: Release) -> None:
        if d.state in (JobState.RUNNING, JobState.QUEUED):
            return  # a node ran it where it was not placed: only that node changes
        if d.state is JobState.PREEMPTED:  # its node was lost or its start failed: waiting again
            row = self.store.get_job(d.job)
            if row is not None and row.state == "running":
                self.store.update_job(d.job, event="requeued", node=row.allocation.node if row.allocation else None,
                                      event_data={"why": d.reason}, state="queued", reason=d.reason, allocation=None,
                                      only_active=True)
            return
        # Ended.  An exit or a cancel already wrote the row; this is the core's own finding
        # (vanished, a bound pod's hold ended): say so where a row still runs.
        rec = self.core.records.get(d.job)
        self.store.update_job(d.job, event="ended", event_data={"why": d.reason}, state=d.state.value,
                              reason=d.reason or None, finished_at=self.clock(), allocation=None,
                              attained_service=rec.job.attained_service if rec is not None else 0.0, only_active=True)

    # --- commands -----------------------------------------------------------------------------

    async def carry_out(self, d: Any, did: str, replay: bool = False) -> None:
        try:
            if isinstance(d, Place):
                await self._start(d, did, replay)
                return
            if isinstance(d, (Preempt, Release)):
                nodes = d.nodes
                stop = d.stop if isinstance(d, Release) else True
                for node in nodes:
                    await self.commands.stop_and_release(d.job, node, f"{did}/{node}", stop=stop)
            elif isinstance(d, Allocate):
                await self.commands.send(d.node, "allocate", {"job": d.job, "cpus": max(0.01, d.cpus),
                                                              "memory_bytes": max(1 << 20, d.memory_bytes)},
                                         f"{did}/allocate")
            self.ack(did)
        except CommandError as exc:
            self.store.set_decision_state(did, "failed", {"error": str(exc)})
            log.warning("decision %s failed: %s", did, exc)

    def agg_secret(self, job: str) -> str:
        """The job's aggregation secret (``DLSHARE_AGG_SECRET``): an HMAC of its id under the
        service's key, so every rank, and every re-send after a restart, gets the same one, and
        nobody who lacks the key can compute another job's."""
        if self._agg_key is None:
            self._agg_key = self.store.service_key("agg")
        return hmac.new(self._agg_key, job.encode(), hashlib.sha256).hexdigest()[:32]

    async def _start(self, d: Place, did: str, replay: bool) -> None:
        rec = self.core.records.get(d.job)
        row = self.store.get_job(d.job)
        if rec is None or rec.placed_by != d.stimulus_id or rec.shards != d.shards or row is None \
                or row.state != "running":
            # Moved on meanwhile (cancelled, preempted, its node lost): nothing to start.
            self.store.set_decision_state(did, "done", {"skipped": "the job no longer runs there"})
            return
        try:
            for rank, s in enumerate(d.shards):
                al = rec.allocation.get(s.node)
                a = row.allocation
                cpus = al.cpus if al else (a.cpus if a else float(row.spec.get("cpus") or 1.0))
                mem = al.memory_bytes if al else (a.memory_bytes if a else int(row.spec.get("memory_bytes") or 0))
                # Every rank gets the job's aggregation secret, unless the spec brought its own.
                env = {AGG_SECRET_ENV: self.agg_secret(d.job), **(row.spec.get("env") or {}), "DLSHARE_JOB_ID": d.job,
                       "DLSHARE_RANK": str(rank), "DLSHARE_WORLD_SIZE": str(len(d.shards))}
                if s.gpus:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, s.gpus))
                # `run` with the allocation applies it (cgroups) and starts the process group in one command.
                run = {"job": d.job, "cpus": max(0.01, float(cpus)), "memory_bytes": max(1 << 20, int(mem)),
                       "argv": row.spec["command"], "env": env, "gpus": list(s.gpus), "run_id": d.stimulus_id}
                owner = row.user or self.default_user
                if owner:  # the node runs it as this user (none: as the node daemon's own user)
                    run["user"] = owner
                if al is not None and al.remote_bytes > 0:  # lent memory: the daemon exports the budget
                    run["remote_memory_bytes"] = int(al.remote_bytes)  # (DLSHARE_REMOTE_MEMORY_BYTES)
                if row.spec.get("cwd"):
                    run["cwd"] = row.spec["cwd"]
                await self.commands.send(s.node, "run", run, f"{did}/{s.node}/run", stages=self.stages.get(d.job))
                self.post(JobStarted(_eid(), self.now(), d.job, s.node, d.stimulus_id))
        except CommandError as exc:
            self.store.set_decision_state(did, "failed", {"error": str(exc)})
            log.warning("decision %s failed: %s", did, exc)
            self.post(PlacementFailed(_eid(), self.now(), d.job, str(exc), d.stimulus_id))
            return
        data: dict[str, Any] = {"decision": did}
        st = self.stages.pop(d.job, None)
        if st is not None:
            data["stages"] = {k: round(v, 6) for k, v in st.items()}
        self.ack(did, d.job, d.node, data)

