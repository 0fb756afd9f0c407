"""From the core's decisions to ``scontrol`` command lines.

:func:`plan` compares what the core wants (each job's state, shards and allocation in
:class:`~scheduler.state.SchedulerState`) with what Slurm shows (a :class:`~scheduler.slurm.book.Snapshot`)
and returns the :class:`Action` that closes each gap.  It is level-triggered: after a crash of the
shell, or an action Slurm refused, the next call produces what is still missing and nothing that
is already done, which is why no job is released twice.

* The core runs a job that Slurm holds: **release** it: ``scontrol update JobId=.. NodeList=..
  NumNodes=.. NumCPUs=.. [CPUsPerTask=..] MinMemoryNode=.. Gres=.. AdminComment=.. Comment=..
  StartTime=now``, then ``scontrol release``.  Which GPUs is the core's choice (``AdminComment``
  "dlshare n1=2", read by ``deploy/slurm/dlshare-taskprolog.sh``).  Slurm only counts them: the
  partition's nodes declare each GPU as ``gpu_slots`` count-only ``gpu`` GRES, so a job that joins
  another on its GPU (co-location) holds a slot of its own and Slurm starts it; the sharing is
  declared, not hidden.  CPUs and memory are the core's allocation, rounded down and
  clamped to what Slurm has free on the node (Slurm cannot resize a running job, so a newcomer gets
  what the running jobs leave).
* The core waits a job that Slurm runs (a preemption, a lost node): **requeue** it held
  (``scontrol requeuehold``).
* The core waits a job that Slurm has pending but not held (requeued by Slurm, released by its
  user): **hold** it again.
* A running job that shares a GPU: **extend** its time limit (``scontrol update JobId=.. TimeLimit=..``)
  by its predicted slowdown there (:func:`shared_time_limit`), so that a job slowed by a partner dlshare
  chose is not killed at the ``--time`` its user set for running alone.  A newcomer placed on a shared
  GPU gets its longer limit in the release itself.  Limits only grow while a job runs (a shorter one
  could end it at once); a job dlshare gives back (``--release-held``) gets its own limit again.
* A job the core cannot place now, or ever, or that dlshare cannot read: a **note** in its comment
  (`` | dlshare: waiting (Resources): ...``, the core's reason), visible in ``squeue -o "%i %k"``.

Pure: no I/O; ``now`` is handed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scheduler.model import JobState, Shard
from scheduler.slurm.book import Book, Snapshot, Tracked
from scheduler.slurm.comment import with_status
from scheduler.slurm.squeue import GresRequest, SlurmJob

MiB = 1 << 20
# The longest a shared GPU may stretch a job's time limit, and the least: sharing that the core admits
# keeps every job at >= half its speed by prediction (the co-location filter's floor), and a pair
# time-sliced on one GPU without any gain runs each at half speed; the limit covers at least that, and a
# worse prediction up to 4x.  A job killed at its limit loses all it has done; one that overruns a
# generous limit only holds its slot longer, so the rule errs long.
SHARED_LIMIT_MIN_FACTOR = 2.0
SHARED_LIMIT_MAX_FACTOR = 4.0


@dataclass(frozen=True)
class Action:
    """One intent for one job, as the ``scontrol`` command lines that carry it out (in order)."""

    kind: str  # release | requeue | hold | extend | note
    job: str
    commands: tuple[tuple[str, ...], ...]
    key: str  # the intent (the same key is not sent again within retry_s)
    nodes: tuple[str, ...] = ()
    status: str = ""
    admin: str = ""


@dataclass
class Free:
    """CPUs and memory (MiB) Slurm has free per node, as this plan hands them out."""

    cpus: dict[str, float] = field(default_factory=dict)
    mem: dict[str, float] = field(default_factory=dict)


def binding(shards: tuple[Shard, ...]) -> str:
    """The AdminComment that binds the job's tasks to the core's GPUs: ``dlshare n1=0,1 n2=3``."""
    return "dlshare " + " ".join(f"{sh.node}={','.join(map(str, sh.gpus))}" for sh in shards)


def gres_text(reqs: tuple[GresRequest, ...]) -> str:
    return ",".join(str(g) for g in reqs)


def shared_time_limit(core: Any, rec: Any, limit_min: int | None) -> int | None:
    """The time limit (minutes) a job with ``--time`` = ``limit_min`` needs while the core has it on a
    GPU shared with others: ``limit_min`` / s, where s is the lowest of its predicted speed beside its
    partners on any of its GPUs and its last measured speed, stretched by at least
    ``SHARED_LIMIT_MIN_FACTOR`` and at most ``SHARED_LIMIT_MAX_FACTOR``.  None when the job shares no GPU
    or has no limit."""
    if not limit_min:
        return None
    speed = 1.0
    shared = False
    for sh in rec.shards:
        ns = core.nodes.get(sh.node)
        if ns is None:
            continue
        for g in sh.gpus:
            others = [core.records[o].job for o in ns.residents[g] if o != rec.job.id and o in core.records]
            if not others:
                continue
            shared = True
            s = core.predictors.colocated_speeds(rec.job.job_type, [o.job_type for o in others], rec.job, others)[0]
            if s == s:  # an unknown pair (NaN) leaves the floor's factor
                speed = min(speed, s)
    if not shared:
        return None
    measured = getattr(rec, "speed", 1.0)
    if 0.0 < measured < speed:
        speed = measured
    factor = min(SHARED_LIMIT_MAX_FACTOR, max(SHARED_LIMIT_MIN_FACTOR, 1.0 / max(speed, 1e-9)))
    return int(math.ceil(limit_min * factor))


def extend_commands(job_id: str, limit_min: int) -> tuple[tuple[str, ...], ...]:
    return (("scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit_min}"),)


def release_commands(job_id: str, nodes: tuple[str, ...], gres: str | None, clear_per_job: bool, num_cpus: int,
                     cpus_per_task: int | None, memory_mb: int, admin: str, comment: str,
                     held: bool, time_limit_min: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The ``scontrol`` lines that place a held job and let it go."""
    upd = ["scontrol", "update", f"JobId={job_id}", f"NodeList={','.join(nodes)}", f"NumNodes={len(nodes)}",
           f"NumCPUs={num_cpus}"]
    if cpus_per_task is not None:
        upd.append(f"CPUsPerTask={cpus_per_task}")
    upd.append(f"MinMemoryNode={memory_mb}")
    if gres is not None:
        upd.append(f"Gres={gres}")
    if clear_per_job:
        upd.append("TresPerJob=")
    if time_limit_min is not None:
        upd.append(f"TimeLimit={time_limit_min}")
    upd += [f"AdminComment={admin}", f"Comment={comment}", "StartTime=now"]
    out = [tuple(upd)]
    if held:
        out.append(("scontrol", "release", job_id))
    return tuple(out)


def requeue_commands(job_id: str, comment: str) -> tuple[tuple[str, ...], ...]:
    return (("scontrol", "requeuehold", job_id), ("scontrol", "update", f"JobId={job_id}", f"Comment={comment}"))


def hold_commands(job_id: str, comment: str) -> tuple[tuple[str, ...], ...]:
    return (("scontrol", "hold", job_id), ("scontrol", "update", f"JobId={job_id}", f"Comment={comment}"))


def note_commands(job_id: str, comment: str) -> tuple[tuple[str, ...], ...]:
    return (("scontrol", "update", f"JobId={job_id}", f"Comment={comment}"),)


def _gib(mb: float) -> str:
    return f"{mb / 1024:.0f} GiB" if mb >= 1024 else f"{mb:.0f} MiB"


def free_resources(book: Book, core: Any, snap: Snapshot, leaving: set[str]) -> Free:
    """What Slurm has free per node once the jobs in ``leaving`` are requeued, counting the jobs dlshare
    released that Slurm has not started yet as taken."""
    free = Free()
    for n in snap.nodes:
        free.cpus[n.name] = float(n.cpus)
        free.mem[n.name] = float(n.memory_mb)
    for j in snap.jobs:
        if j.job_id in leaving:
            continue
        if j.running:
            where = j.nodes
        elif j.pending and not j.held and j.job_id in book.jobs and j.required_nodes:
            where = j.required_nodes  # released by dlshare, about to start there
        else:
            continue
        for nid in where:
            if nid in free.cpus:
                free.cpus[nid] -= j.cpus / max(1, len(where))
                free.mem[nid] -= j.memory_mb or 0
    return free


def waiting_status(core: Any, rec: Any) -> str:
    """Why a waiting job is not running, in a few words: the core's own reason
    (:func:`scheduler.waiting.why_waiting`, as the scheduler service gives it), with its code as
    squeue shows a reason: ``waiting (Resources): needs 4 GPUs; 2 free``."""
    from scheduler.waiting import why_waiting

    if rec.job.state is JobState.PREEMPTED:
        head = f"preempted {rec.preemptions}x, waiting"
    else:
        head = "waiting"
    try:
        why = why_waiting(core, rec.job.id)
    except Exception:  # noqa: BLE001 - an explanation is a courtesy; never fail the plan for it
        return head
    return f"{head} ({why.code}): {why.message}"


def _release(book: Book, core: Any, t: Tracked, j: SlurmJob, rec: Any, free: Free) -> Action:
    shards = tuple(rec.shards)
    nodes = tuple(sh.node for sh in shards)
    shared_with: list[str] = []
    for sh in shards:
        ns = core.nodes[sh.node]
        for g in sh.gpus:
            shared_with += [o for o in ns.residents[g] if o != t.job_id and o not in shared_with]
    o = t.original
    gres: str | None = None  # GPUs are counted by Slurm as the job asked; only a spread job is re-cut per node
    clear_per_job = False
    if len(shards) > 1:
        per_node = max(len(sh.gpus) for sh in shards)
        gres = gres_text((GresRequest("gpu", o.gpu_type(), per_node), *o.other_gres()))
        clear_per_job = any(g.name == "gpu" for g in o.gres_per_job)
    cpus = 0
    mem = math.inf
    for sh in shards:
        a = rec.allocation.get(sh.node)
        want_c = a.cpus if a is not None else o.cpus / max(1, len(shards))
        want_m = a.memory_bytes / MiB if a is not None else float(o.memory_mb or 1024)
        c = max(1, min(int(math.floor(want_c + 1e-6)), int(math.floor(free.cpus.get(sh.node, want_c) + 1e-6))))
        m = max(1, min(int(want_m), int(free.mem.get(sh.node, want_m))))
        free.cpus[sh.node] = free.cpus.get(sh.node, 0.0) - c
        free.mem[sh.node] = free.mem.get(sh.node, 0.0) - m
        cpus += c
        mem = min(mem, m)
    cpt = None
    if len(shards) == 1:  # Slurm keeps NumCPUs = tasks x CPUsPerTask: set both
        tasks = max(1, o.tasks)
        cpus = max(tasks, cpus - cpus % tasks)
        cpt = cpus // tasks
    where = ", ".join(f"{sh.node} GPU {','.join(map(str, sh.gpus))}" for sh in shards)
    limit = shared_time_limit(core, rec, o.time_limit_min)
    status = f"placed on {where}" + (f" shared with {','.join(shared_with)}" if shared_with else "") + \
        f" ({cpus} CPUs, {_gib(mem)}" + (f", time limit {limit} min while shared" if limit else "") + ")"
    comment = with_status(j.comment, status)
    admin = binding(shards)
    cmds = release_commands(t.job_id, nodes, gres, clear_per_job, cpus, cpt, int(mem), admin, comment, j.held,
                            limit if limit is not None and limit > (j.time_limit_min or 0) else None)
    return Action("release", t.job_id, cmds, f"release:{admin}:{j.restart_count}", nodes, status, admin)


def _hold_or_note(j: SlurmJob, status: str, first: list[Action], notes: list[Action]) -> None:
    """A pending job dlshare will not run: hold it with the reason in its comment, or, held already,
    only bring the comment up to date."""
    comment = with_status(j.comment, status)
    if not j.held:
        first.append(Action("hold", j.job_id, hold_commands(j.job_id, comment), f"hold:{j.restart_count}",
                            status=status))
    elif comment != j.comment:
        notes.append(Action("note", j.job_id, note_commands(j.job_id, comment), f"note:{status}", status=status))


def plan(book: Book, core: Any, snap: Snapshot, now: float, *, retry_s: float = 10.0, explain: bool = False,
         max_notes: int = 20) -> list[Action]:
    """The actions that make Slurm match the core (see the module docstring), in the order to run
    them: requeues and holds first (they free resources), then releases, then notes."""
    first: list[Action] = []
    releases: list[tuple[Tracked, SlurmJob, Any]] = []
    notes: list[Action] = []
    leaving: set[str] = set()
    for j in snap.jobs:
        t = book.jobs.get(j.job_id)
        if t is None or j.terminal or t.foreign:
            continue
        if not t.in_core:
            if t.problem and j.pending:
                _hold_or_note(j, f"not scheduled: {t.problem}", first, notes)
            continue
        rec = core.records.get(j.job_id)
        if rec is None:
            continue
        state = rec.job.state
        if state is JobState.RUNNING:
            if j.pending and (j.held or t.released_restart != j.restart_count):
                releases.append((t, j, rec))
            elif j.running and j.time_limit_min is not None:
                limit = shared_time_limit(core, rec, t.original.time_limit_min)
                if limit is not None and limit > j.time_limit_min:
                    first.append(Action("extend", j.job_id, extend_commands(j.job_id, limit), f"extend:{limit}",
                                        status=f"time limit {limit} min while it shares a GPU "
                                               f"(asked {t.original.time_limit_min})"))
        elif state.active:  # queued or preempted in the core
            if j.running:
                status = f"preempted, waiting (run {rec.preemptions})" if state is JobState.PREEMPTED else "requeued"
                comment = with_status(j.comment, status)
                first.append(Action("requeue", j.job_id, requeue_commands(j.job_id, comment),
                                    f"requeue:{j.restart_count}", status=status))
                leaving.add(j.job_id)
            elif j.pending and not j.held:
                status = "held again by dlshare: waiting"
                first.append(Action("hold", j.job_id, hold_commands(j.job_id, with_status(j.comment, status)),
                                    f"hold:{j.restart_count}", status=status))
            elif explain:
                status = waiting_status(core, rec)
                comment = with_status(j.comment, status)
                if comment != j.comment:  # Slurm's copy is the truth (a restart writes nothing new)
                    notes.append(Action("note", j.job_id, note_commands(j.job_id, comment), f"note:{status}",
                                        status=status))
        elif state is JobState.FAILED and t.rejected and j.pending:
            _hold_or_note(j, f"cannot run: {t.rejected}", first, notes)
    free = free_resources(book, core, snap, leaving)
    out = first + [_release(book, core, t, j, rec, free) for t, j, rec in releases] + notes[:max_notes]
    return [a for a in out if not _recent(book.jobs[a.job], a, now, retry_s)]


def _recent(t: Tracked, a: Action, now: float, retry_s: float) -> bool:
    return t.action_key == a.key and now - t.action_at < retry_s


def restore_commands(j: SlurmJob, original: Any | None) -> tuple[tuple[str, ...], ...]:
    """The ``scontrol`` lines that give a held job back its own request (``original``, a
    :class:`~scheduler.slurm.book.Original`, when dlshare recorded one) and release it: what
    ``dlshare slurm --release-held`` does when dlshare is taken out of a partition."""
    from scheduler.slurm.comment import user_part

    upd = ["scontrol", "update", f"JobId={j.job_id}", "AdminComment=", f"Comment={user_part(j.comment)}"]
    if original is not None:
        upd += [f"NodeList={','.join(original.required_nodes)}", f"NumNodes={max(1, original.node_count)}",
                f"NumCPUs={original.cpus}"]
        if original.tasks >= 1 and original.cpus % max(1, original.tasks) == 0:
            upd.append(f"CPUsPerTask={original.cpus // max(1, original.tasks)}")
        if original.memory_mb:
            upd.append(f"MinMemoryNode={original.memory_mb}")
        if original.time_limit_min:
            upd.append(f"TimeLimit={original.time_limit_min}")
        upd.append(f"Gres={gres_text(original.gres_per_node)}")
        per_job = [g for g in original.gres_per_job if g.name == "gpu"]
        if per_job:
            upd.append(f"TresPerJob={gres_text(tuple(per_job))}")
    out = [tuple(upd)]
    if j.held:
        out.append(("scontrol", "release", j.job_id))
    return tuple(out)
