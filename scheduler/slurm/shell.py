"""``dlshare slurm``: the shell that lets dlshare's core schedule the GPU jobs of a Slurm partition.

One loop, one step per poll (:meth:`SlurmShell.step`):

1. read Slurm (``squeue --json``, ``sinfo --json``: :class:`~scheduler.slurm.runner.SlurmCLI`);
2. turn what changed into core events (:func:`~scheduler.slurm.book.observe`), journal them, and hand
   them to the core one at a time (the same ``SchedulerState`` and plugins as the simulator and the
   service); a due :class:`Wakeup` becomes a ``Tick``;
3. fsync the journal, then carry out what the core wants through ``scontrol``
   (:func:`~scheduler.slurm.plan.plan`): release placed jobs, requeue preempted ones held, hold jobs
   that escaped, write reasons on jobs that wait.

Slurm stays the authority on what runs: the shell never starts a process, and it reads back what
Slurm did rather than assuming it.  After a crash, :meth:`SlurmShell.recover` replays the journal into
a fresh core (the same events give the same state), and the next step reconciles that state with
Slurm: jobs that ended or arrived meanwhile become events, and only what Slurm does not show yet is
done again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler import SchedulerError, SchedulerState
from scheduler.codec import event_from_dict, event_to_dict
from scheduler.events import Place, Preempt, Reject, Wakeup
from scheduler.slurm import core_io
from scheduler.slurm.book import Book, Snapshot, Tracked, forget_done, observe
from scheduler.slurm.shell_log import VERSION, ShellLog, ShellLogError
from scheduler.slurm.plan import Action, plan
from scheduler.slurm.runner import SlurmCLI, SlurmUnavailable

log = logging.getLogger("dlshare.slurm")


@dataclass
class Stats:
    """Counts for status lines and the benchmark."""

    polls: int = 0
    events: int = 0
    refused: int = 0  # events the core refused (logged, state unchanged)
    decisions: int = 0
    places: int = 0
    preempts: int = 0
    actions: dict[str, int] = field(default_factory=dict)  # carried out, by kind
    failed_actions: int = 0
    unavailable: int = 0  # polls that found slurmctld not answering
    latency_s: list[float] = field(default_factory=list)  # decision -> seen running

    def to_dict(self) -> dict[str, Any]:
        return {"polls": self.polls, "events": self.events, "refused": self.refused, "decisions": self.decisions,
                "places": self.places, "preempts": self.preempts, "actions": dict(self.actions),
                "failed_actions": self.failed_actions, "unavailable": self.unavailable,
                "latency_s": list(self.latency_s)}


class SlurmShell:
    """See the module docstring.  ``clock`` is wall time (core time is Slurm's epoch seconds)."""

    def __init__(self, core: SchedulerState, partition: str, journal: str | Path, cli: SlurmCLI | None = None, *,
                 poll_s: float = 1.0, retry_s: float = 10.0, status_s: float = 10.0, respect_requests: bool = False,
                 gpu_slots: int = 2, clock: Callable[[], float] = time.time, fsync: bool = True,
                 predictors: str = "", telemetry: Any = None, telemetry_s: float = 30.0,
                 start_timeout_s: float = 120.0) -> None:
        self.core = core
        self.partition = partition
        self.cli = cli or SlurmCLI()
        self.journal = ShellLog(journal, fsync=fsync)
        self.book = Book(partition, respect_requests=respect_requests, gpu_slots=gpu_slots,
                         start_timeout_s=start_timeout_s)
        prof = core.profile
        if prof.share != "never" and prof.max_share > gpu_slots:
            log.warning("slurm: profile %s co-locates up to %d jobs per GPU but the nodes declare %d GPU slots per "
                        "GPU: Slurm will not start a co-located job beyond that", prof.name, prof.max_share, gpu_slots)
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.status_s = status_s
        self.clock = clock
        self.predictors = predictors
        self.stats = Stats()
        self.telemetry = telemetry  # a TelemetryFeed (dlshare node beside slurmd), or None
        self.telemetry_s = telemetry_s
        self._fed: dict[str, float] = {}  # node -> receive time of the telemetry last fed
        self._fed_at: dict[str, float] = {}  # node -> core time it was fed
        self.wakeup_at = math.inf
        self._last_explain = -math.inf
        self.last_snapshot: Snapshot | None = None

    # ------------------------------------------------------------------ recovery

    def recover(self) -> int:
        """Replay the journal into the (fresh) core; returns the events replayed."""
        records = self.journal.load()
        if not records:
            self.journal.append({"t": "hdr", "v": VERSION, "partition": self.partition,
                                 "profile": self.core.profile.name, "predictors": self.predictors,
                                 "gpu_slots": self.book.gpu_slots})
            self.journal.sync()
            return 0
        hdr = records[0]
        if hdr.get("t") != "hdr" or hdr.get("v") != VERSION:
            raise ShellLogError(f"{self.journal.path}: not a dlshare slurm journal (version {VERSION})")
        for key, want in (("partition", self.partition), ("profile", self.core.profile.name),
                          ("predictors", self.predictors), ("gpu_slots", self.book.gpu_slots)):
            if hdr.get(key, "") != want:
                raise ShellLogError(f"{self.journal.path} was written for {key} {hdr.get(key)!r}, not {want!r}: "
                                   "replaying it would not rebuild the same state (use another journal)")
        n = 0
        for rec in records[1:]:
            kind = rec["t"]
            if kind == "job":
                self.book.jobs[str(rec["id"])] = Tracked.from_record(rec)
            elif kind == "rel":
                t = self.book.jobs.get(str(rec["id"]))
                if t is not None:
                    t.released_restart = int(rec["restart"])
                    t.released_at = float(rec.get("at", 0.0)) or None
            elif kind == "ev":
                ev = event_from_dict(rec["ev"])
                self._feed(ev, replay=True)
                n += 1
        self.book.seq = n
        log.info("slurm: replayed %d events from %s (%d jobs known, %d nodes)", n, self.journal.path,
                 len(self.book.jobs), len(self.core.nodes))
        return n

    # ------------------------------------------------------------------ one step

    def _feed(self, ev: Any, replay: bool = False) -> list[Any]:
        try:
            decisions = self.core.handle(ev)
        except SchedulerError as exc:
            if not replay:
                log.warning("slurm: core refused %s: %s", core_io.event_id(ev), exc)
            self.stats.refused += not replay
            return []
        job = getattr(ev, "job", None)
        if job is not None and not isinstance(job, str):  # JobArrived: the job is the core's now
            t = self.book.jobs.get(job.id)
            if t is not None:
                t.in_core = True
        for d in decisions:
            if isinstance(d, Wakeup):
                self.wakeup_at = min(self.wakeup_at, d.at) if self.wakeup_at > self.core.now else d.at
            elif isinstance(d, Reject):
                t = self.book.jobs.get(d.job)
                if t is not None:
                    t.rejected = d.reason
            elif isinstance(d, Place):
                t = self.book.jobs.get(d.job)
                if t is not None:
                    t.placed_at = ev.now
                    t.running_seen_at = None
        if not replay:
            self.stats.events += 1
            self.stats.decisions += len(decisions)
            self.stats.places += sum(isinstance(d, Place) for d in decisions)
            self.stats.preempts += sum(isinstance(d, Preempt) for d in decisions)
        return decisions

    def now(self) -> float:
        return max(self.clock(), self.core.now)

    def step(self) -> list[Action]:
        """One poll (see the module docstring); returns the actions carried out."""
        self.stats.polls += 1
        try:
            snap = self.cli.snapshot(self.partition, self.clock())
        except SlurmUnavailable as exc:
            self.stats.unavailable += 1
            log.warning("slurm: %s; trying again in %gs", exc, self.poll_s)
            return []
        self.last_snapshot = snap
        now = max(snap.taken_at, self.core.now)
        for j in snap.jobs:  # decision -> running, for jobs the core placed
            t = self.book.jobs.get(j.job_id)
            if t is not None and j.running and t.placed_at is not None and t.running_seen_at is None:
                t.running_seen_at = snap.taken_at
                self.stats.latency_s.append(max(0.0, snap.taken_at - t.placed_at))
        events = observe(self.book, self.core, snap, now)
        for w in self.book.warnings:
            log.warning("slurm: %s", w)
        self.book.warnings.clear()
        if self.telemetry is not None:
            events += self._telemetry_events(events, now)
        if now >= self.wakeup_at:
            self.wakeup_at = math.inf
            events.append(core_io.tick(self.book.sid("tick", "", now), now))
        for t in self.book.new:
            self.journal.append(t.to_record())
        self.book.new.clear()
        for ev in events:
            self.journal.append({"t": "ev", "ev": event_to_dict(ev)})
        self.journal.sync()  # the core sees nothing that a restart would not see again
        for ev in events:
            self._feed(ev)
        explain = now - self._last_explain >= self.status_s
        if explain:
            self._last_explain = now
        actions = plan(self.book, self.core, snap, now, retry_s=self.retry_s, explain=explain)
        rel = [a for a in actions if a.kind == "release"]
        if rel:
            jobs = {j.job_id: j for j in snap.jobs}
            for a in rel:
                self.journal.append({"t": "rel", "id": a.job, "restart": jobs[a.job].restart_count, "key": a.key,
                                     "at": now})
            self.journal.sync()
        done = []
        for a in actions:
            if self._carry_out(a, now, {j.job_id: j for j in snap.jobs}):
                done.append(a)
        forget_done(self.book, self.core, (j.job_id for j in snap.jobs))
        return done

    def _telemetry_events(self, events: list[Any], now: float) -> list[Any]:
        """Node reports from the latest telemetry, at most one per node every ``telemetry_s``."""
        nodes = [getattr(ev, "node", None) for ev in events]
        touched = {n.id if hasattr(n, "id") else n for n in nodes if n is not None}
        out = []
        for node, (fields, at) in sorted(self.telemetry.take(self._fed).items()):
            ns = self.core.nodes.get(node)
            if ns is None or not ns.alive or node in touched:
                continue  # unknown, lost, or reported by Slurm in this very step (its resources win)
            if now - self._fed_at.get(node, -math.inf) < self.telemetry_s:
                continue
            out.append(core_io.node_report(self.book.sid("telemetry", node, now), now, ns.node, **fields))
            self._fed[node], self._fed_at[node] = at, now
        return out

    def _carry_out(self, a: Action, now: float, jobs: dict[str, Any]) -> bool:
        t = self.book.jobs[a.job]
        t.action_key, t.action_at = a.key, now
        for argv in a.commands:
            r = self.cli.run(argv)
            if not r.ok:
                self.stats.failed_actions += 1
                log.warning("slurm: job %s: %s failed (exit %s): %s", a.job, " ".join(argv[:2]), r.returncode,
                            r.stderr[:300])
                return False
        self.stats.actions[a.kind] = self.stats.actions.get(a.kind, 0) + 1
        if a.kind != "extend":  # an extension writes no comment: the status on the job stays
            t.status = a.status or t.status
        if a.kind == "release":
            t.released_restart = jobs[a.job].restart_count
            t.released_at = now
            log.info("slurm: released job %s: %s", a.job, a.status)
        elif a.kind in ("requeue", "hold"):
            log.info("slurm: %s job %s: %s", a.kind, a.job, a.status)
        elif a.kind == "extend":
            log.info("slurm: job %s: %s", a.job, a.status)
        return True

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event | None = None, max_steps: int | None = None) -> None:
        """Poll until ``stop`` is set (or ``max_steps`` polls ran)."""
        stop = stop or threading.Event()
        steps = 0
        while not stop.is_set():
            t0 = time.monotonic()
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            wait = self.poll_s - (time.monotonic() - t0)
            if self.wakeup_at < math.inf:
                wait = min(wait, self.wakeup_at - self.clock())
            stop.wait(max(0.0, wait))
        self.close()

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.stop()
        self.journal.close()


def release_held(cli: SlurmCLI, partition: str, journal: str | Path) -> tuple[int, int]:
    """Take dlshare out of ``partition``: give every held or dlshare-placed pending job its own request
    back (from the journal) and release it, so Slurm's own scheduler runs the queue.  Run it after
    stopping ``dlshare slurm`` and removing the hold (job_submit.lua).  Returns (released, failed)."""
    from scheduler.slurm.plan import restore_commands

    originals = {}
    for rec in ShellLog(journal).load():
        if rec.get("t") == "job":
            originals[str(rec["id"])] = Tracked.from_record(rec).original
    snap = cli.snapshot(partition, time.time())
    done = failed = 0
    for j in snap.jobs:
        if not j.pending or not (j.held or j.job_id in originals):
            continue
        for argv in restore_commands(j, originals.get(j.job_id)):
            r = cli.run(argv)
            if not r.ok:
                log.warning("slurm: job %s: %s: %s", j.job_id, " ".join(argv[:2]), r.stderr[:300])
                failed += 1
                break
        else:
            done += 1
    return done, failed
