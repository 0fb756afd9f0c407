"""What the Slurm shell knows about each job, and Slurm's queue turned into the core's events.

:class:`Book` holds one :class:`Tracked` per job of the partition that dlshare has seen: the request
as first seen (so it can be restored), the fields read from its comment or name, the problem that
keeps it out of the core (a bad comment, no GPUs asked for), and the Slurm restart count at dlshare's
last release (so a requeue by Slurm itself is told apart from dlshare's own preemption).

:func:`observe` compares one :class:`Snapshot` of Slurm with the book and the core's state and
returns the events that bring the core up to date, in order: nodes first (registration, loss,
return), then jobs (arrivals, finishes, cancellations, requeues by Slurm).  It changes only the book
(new jobs tracked, and :attr:`Book.warnings`, lines for the shell to log); the caller hands the
events to the core.

A job reaches the core with its Slurm owner (``user_name`` within ``account``), so the profile's
``[fairshare]`` and ``[quota]`` apply as in the simulator and the service.  The core keeps the owner a
job arrived with: an owner Slurm shows differently later (an account changed with ``scontrol update``,
a job journaled before dlshare read owners) is logged once, not followed.

Pure: no I/O, no clock (``now`` is handed in).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nodesvc.bus.ids import stimulus_id
from scheduler.model import Job, JobState, Node
from scheduler.slurm import core_io
from scheduler.slurm.comment import CommentError, JobFields, job_fields, user_part
from scheduler.slurm.squeue import GresRequest, SlurmJob, SlurmNode

MiB = 1 << 20


@dataclass(frozen=True)
class Snapshot:
    """One look at Slurm: the partition's jobs and nodes, and when it was taken (shell clock)."""

    jobs: tuple[SlurmJob, ...]
    nodes: tuple[SlurmNode, ...]
    taken_at: float


@dataclass(frozen=True)
class Original:
    """A job's request as dlshare first saw it (restored when dlshare is taken out)."""

    gres_per_node: tuple[GresRequest, ...]
    gres_per_job: tuple[GresRequest, ...]
    gres_per_task: tuple[GresRequest, ...]
    cpus: int
    memory_mb: int | None
    required_nodes: tuple[str, ...]
    node_count: int = 1
    tasks: int = 1
    time_limit_min: int | None = None  # --time in minutes as submitted (None: none)

    def to_dict(self) -> dict[str, Any]:
        return {"gres_per_node": [str(g) for g in self.gres_per_node], "gres_per_job": [str(g) for g in self.gres_per_job],
                "gres_per_task": [str(g) for g in self.gres_per_task], "cpus": self.cpus,
                "memory_mb": self.memory_mb, "required_nodes": list(self.required_nodes),
                "node_count": self.node_count, "tasks": self.tasks, "time_limit_min": self.time_limit_min}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Original":
        from scheduler.slurm.squeue import parse_gres

        return cls(parse_gres(",".join(d.get("gres_per_node", []))), parse_gres(",".join(d.get("gres_per_job", []))),
                   parse_gres(",".join(d.get("gres_per_task", []))), int(d.get("cpus", 1)),
                   None if d.get("memory_mb") is None else int(d["memory_mb"]), tuple(d.get("required_nodes", [])),
                   int(d.get("node_count", 1)), int(d.get("tasks", 1)),
                   None if d.get("time_limit_min") is None else int(d["time_limit_min"]))

    @classmethod
    def of(cls, j: SlurmJob) -> "Original":
        return cls(j.gres_per_node, j.gres_per_job, j.gres_per_task, j.cpus, j.memory_mb, j.required_nodes,
                   j.node_count, j.tasks, j.time_limit_min)

    def gpu_type(self) -> str:
        for g in (*self.gres_per_node, *self.gres_per_job, *self.gres_per_task):
            if g.name == "gpu" and g.type:
                return g.type
        return ""

    def other_gres(self) -> tuple[GresRequest, ...]:
        """Per-node GRES other than GPUs (kept as asked whatever dlshare does with the GPUs)."""
        return tuple(g for g in self.gres_per_node if g.name != "gpu")


@dataclass
class Tracked:
    job_id: str
    original: Original
    fields: JobFields | None = None
    problem: str = ""  # why the job is not handed to the core; shown on the job
    comment_seen: str = ""  # the user part of the comment last parsed (a fix by the user is noticed)
    in_core: bool = False
    foreign: bool = False  # found running without dlshare having released it
    released_restart: int | None = None  # Slurm restart count at dlshare's last release
    released_at: float | None = None
    placed_at: float | None = None  # when the core decided the current placement
    running_seen_at: float | None = None
    status: str = ""  # the status dlshare last wrote on the job
    rejected: str = ""  # the core's reason when it rejected the job (it can never run here)
    action_key: str = ""  # the last action sent for this job, and when (no repeat within retry_s)
    action_at: float = float("-inf")
    owner_warned: bool = False  # the owner Slurm shows differs from the core's: logged once (not journaled)

    def to_record(self) -> dict[str, Any]:
        """What the journal keeps of a newly seen job (the rest is rebuilt from events and Slurm)."""
        f = self.fields
        return {"t": "job", "id": self.job_id, "original": self.original.to_dict(), "problem": self.problem,
                "comment": self.comment_seen, "foreign": self.foreign,
                "fields": None if f is None else {"model": f.model, "batch_size": f.batch_size,
                                                  "batch_sizes": list(f.batch_sizes),
                                                  "gpu_memory_bytes": f.gpu_memory_bytes}}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Tracked":
        f = rec.get("fields")
        fields = None if not f else JobFields(str(f["model"]), int(f.get("batch_size", 0)),
                                              tuple(int(x) for x in f.get("batch_sizes", ())),
                                              int(f.get("gpu_memory_bytes", 0)))
        return cls(str(rec["id"]), Original.from_dict(rec["original"]), fields, problem=str(rec.get("problem", "")),
                   comment_seen=str(rec.get("comment", "")), foreign=bool(rec.get("foreign", False)))


@dataclass
class Book:
    partition: str
    respect_requests: bool = False  # hand the job's own CPU/memory request to the core as its minimum
    gpu_slots: int = 1  # count-only gpu GRES per physical GPU on the partition's nodes (README, "Slurm")
    start_timeout_s: float = 120.0  # a released job Slurm has not started by then is placed again
    jobs: dict[str, Tracked] = field(default_factory=dict)
    seq: int = 0  # events made so far (part of every stimulus id)
    new: list[Tracked] = field(default_factory=list)  # tracked since the shell last journaled them
    warnings: list[str] = field(default_factory=list)  # for the shell to log (odd owners), then clear

    def sid(self, kind: str, what: str, now: float) -> str:
        self.seq += 1
        return stimulus_id(f"slurm:{kind}:{what}")

    def track(self, j: SlurmJob, now: float) -> Tracked:
        t = Tracked(j.job_id, Original.of(j))
        self.jobs[j.job_id] = t
        self._parse(t, j)
        self.new.append(t)
        if j.owner_note:
            self.warnings.append(f"job {j.job_id}: {j.owner_note}")
        return t

    def _parse(self, t: Tracked, j: SlurmJob) -> None:
        t.comment_seen = user_part(j.comment)
        t.problem = ""
        try:
            t.fields = job_fields(j.comment, j.name)
        except CommentError as exc:
            t.fields = None
            t.problem = f"bad job fields: {exc}"
            return
        if any(g.name == "shard" for g in (*j.gres_per_node, *j.gres_per_job, *j.gres_per_task)):
            t.problem = "asks for gres/shard: in this partition dlshare decides GPU sharing; ask for gpu"
        elif any(g.name == "gpu" for g in j.gres_per_task):
            t.problem = "asks for GPUs per task: ask for --gres=gpu:N (per node) or --gpus=N"
        elif gpus_of(t) < 1:
            t.problem = "asks for no GPU: dlshare schedules GPU jobs; submit CPU-only work to another partition"

    def reparse(self, t: Tracked, j: SlurmJob) -> None:
        """Parse again when the user changed the comment of a job not yet in the core (a fix)."""
        if not t.in_core and user_part(j.comment) != t.comment_seen:
            self._parse(t, j)

    def job_of(self, t: Tracked, j: SlurmJob) -> Job:
        f = t.fields
        assert f is not None
        o = t.original
        return Job(id=t.job_id, model=f.model, batch_size=f.batch_size, gpus=gpus_of(t),
                   cpus=float(o.cpus) if self.respect_requests else 0.0,
                   memory_bytes=(o.memory_mb or 0) * MiB if self.respect_requests else 0,
                   arrival=max(0.0, j.submit_time), gpu_memory_bytes=f.gpu_memory_bytes,
                   user=j.user, account=j.account)

    def check_owner(self, t: Tracked, j: SlurmJob, job: Job) -> None:
        """Note (once per job) that Slurm now shows another owner than the core counts the job under."""
        if t.owner_warned or (j.user, j.account) == (job.user, job.account):
            return
        t.owner_warned = True
        self.warnings.append(
            f"job {j.job_id}: Slurm shows user {j.user!r} account {j.account!r}, but dlshare counts it under "
            f"user {job.user!r} account {job.account!r} (its owner when it reached dlshare) until it ends")


def gpus_of(t: Tracked) -> int:
    o = t.original
    per_job = sum(g.count for g in o.gres_per_job if g.name == "gpu")
    if per_job:
        return per_job
    per_node = sum(g.count for g in o.gres_per_node if g.name == "gpu")
    if per_node:
        return per_node * max(1, o.node_count)
    return sum(g.count for g in o.gres_per_task if g.name == "gpu") * max(1, o.tasks)


def core_node(n: SlurmNode, gpu_slots: int = 1) -> Node:
    """The core's node: Slurm's GPU GRES count is ``gpu_slots`` slots per physical GPU."""
    return Node(n.name, gpus=n.gpus // max(1, gpu_slots), cores=n.cpus, memory_bytes=n.memory_mb * MiB)


def _ours_running_on(core: Any, node: str) -> bool:
    ns = core.nodes.get(node)
    return bool(ns is not None and ns.jobs)


def observe(book: Book, core: Any, snap: Snapshot, now: float) -> list[Any]:
    """The events that bring ``core`` (a :class:`~scheduler.state.SchedulerState`) up to date with
    ``snap`` (see the module docstring)."""
    events: list[Any] = []
    lost_now: set[str] = set()
    seen_nodes: set[str] = set()
    for n in snap.nodes:
        if book.partition not in n.partitions:
            continue
        seen_nodes.add(n.name)
        ns = core.nodes.get(n.name)
        # A drained node leaves the core once dlshare's jobs there are done; a down one at once.
        lost = n.down or (not n.usable and not _ours_running_on(core, n.name))
        if ns is None:
            if not lost and n.gpus >= book.gpu_slots:
                events.append(core_io.node_report(book.sid("node", n.name, now), now, core_node(n, book.gpu_slots)))
        elif ns.alive and lost:
            events.append(core_io.node_lost(book.sid("lost", n.name, now), now, n.name))
            lost_now.add(n.name)
        elif not lost and (not ns.alive or _resources_changed(ns.node, n, book.gpu_slots)):
            events.append(core_io.node_report(book.sid("node", n.name, now), now, core_node(n, book.gpu_slots)))
    for nid, ns in core.nodes.items():
        if ns.alive and nid not in seen_nodes:  # left the partition (or the cluster)
            events.append(core_io.node_lost(book.sid("lost", nid, now), now, nid))
            lost_now.add(nid)

    seen: set[str] = set()
    for j in snap.jobs:
        if j.partition != book.partition and book.partition not in j.partition.split(","):
            continue
        seen.add(j.job_id)
        t = book.jobs.get(j.job_id)
        if t is None:
            if j.terminal:
                continue  # ended before dlshare ever saw it: never ours
            t = book.track(j, now)
            if j.running:
                t.foreign = True  # started without dlshare (no job_submit.lua, no --hold): left alone
                continue
            if not t.problem:
                events.append(core_io.arrived(book.sid("arrive", j.job_id, now), now, book.job_of(t, j)))
                t.in_core = True
            continue
        if not t.in_core:
            if j.terminal or (t.foreign and j.running):
                continue
            t.foreign = False  # a foreign job back in the queue is dlshare's from now on
            book.reparse(t, j)
            if not t.problem and t.fields is not None and not j.running:
                events.append(core_io.arrived(book.sid("arrive", j.job_id, now), now, book.job_of(t, j)))
                t.in_core = True
            continue
        rec = core.records.get(j.job_id)
        if rec is None:
            continue
        state = rec.job.state
        if state.active and not j.terminal:
            book.check_owner(t, j, rec.job)
        if j.terminal:
            if state is JobState.RUNNING:
                failed = j.state != "COMPLETED"
                events.append(core_io.finished(book.sid("finish", j.job_id, now), now, j.job_id, failed,
                                               "" if not failed else f"{j.state.lower()} in Slurm ({j.reason})"))
            elif state.active:
                events.append(core_io.cancelled(book.sid("cancel", j.job_id, now), now, j.job_id,
                                                f"{j.state.lower()} in Slurm while waiting"))
        elif (state is JobState.RUNNING and j.pending and t.released_restart is not None
              and j.restart_count > t.released_restart
              and not any(sh.node in lost_now for sh in rec.shards)):
            events.append(core_io.placement_failed(book.sid("requeued", j.job_id, now), now, j.job_id,
                                                   f"requeued by Slurm ({j.reason})"))
        elif (state is JobState.RUNNING and j.pending and not j.held and t.released_at is not None
              and t.released_restart == j.restart_count and now - t.released_at > book.start_timeout_s):
            # Released, but Slurm does not start it (its view of the node differs from the core's):
            # the placement failed; the core places it again (or it waits, held again).
            events.append(core_io.placement_failed(book.sid("unstarted", j.job_id, now), now, j.job_id,
                                                   f"Slurm did not start it within {book.start_timeout_s:g}s "
                                                   f"({j.reason})"))
            t.released_restart = t.released_at = None
    for jid, t in book.jobs.items():
        if jid in seen or not t.in_core:
            continue
        rec = core.records.get(jid)
        if rec is None or not rec.job.state.active:
            continue
        if rec.job.state is JobState.RUNNING:
            events.append(core_io.finished(book.sid("gone", jid, now), now, jid, False, "gone from Slurm"))
        else:
            events.append(core_io.cancelled(book.sid("gone", jid, now), now, jid, "gone from Slurm"))
    return events


def _resources_changed(old: Node, n: SlurmNode, gpu_slots: int) -> bool:
    return old != core_node(n, gpu_slots)


def forget_done(book: Book, core: Any, snap_ids: Iterable[str]) -> None:
    """Drop jobs Slurm no longer lists and the core no longer needs (keeps the book small)."""
    present = set(snap_ids)
    for jid in [j for j in book.jobs if j not in present]:
        rec = core.records.get(jid)
        if rec is None or not rec.job.state.active:
            del book.jobs[jid]
