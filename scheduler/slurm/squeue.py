"""Slurm's JSON (``squeue --json``, ``sinfo --json``) as plain records.

:func:`parse_jobs` and :func:`parse_nodes` take the decoded JSON (or its text) and return
:class:`SlurmJob` and :class:`SlurmNode` records.  They accept what Slurm 22.05 (Debian 12) writes
and the later forms where a field changed shape (``gres/gpu`` for ``gres:gpu``; numbers wrapped as
``{"set": true, "number": N}``; states as lists).  Anything that is not the expected shape raises
:class:`SlurmJsonError` naming the job or node and the field, never anything else.

A job's owner (``user_name`` within ``account``; :func:`job_owner`) is the exception: it never
makes a job unreadable.  A missing or odd value falls back (to the numeric ``user_id``, as later
Slurm versions print a uid without a name; or to no account) and says so in ``SlurmJob.owner_note``,
which the shell logs, so one strange field cannot hold up the partition's queue.

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from scheduler.model import MAX_OWNER

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})
RUNNING = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING"})
PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
# Node flags under which a node takes no new work (22.05 writes them in state_flags; later versions in state).
_UNUSABLE_FLAGS = frozenset({"DRAIN", "FAIL", "MAINTENANCE", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN",
                             "REBOOT_ISSUED", "INVALID_REG", "FUTURE", "DOWN"})


class SlurmJsonError(ValueError):
    """Slurm JSON of an unexpected shape; the message names the record and field."""


@dataclass(frozen=True)
class GresRequest:
    """One generic-resource request: ``gres:gpu:a100:2`` -> name gpu, type a100, count 2."""

    name: str
    type: str
    count: int

    def __str__(self) -> str:
        return f"{self.name}:{self.type}:{self.count}" if self.type else f"{self.name}:{self.count}"


@dataclass(frozen=True)
class SlurmJob:
    """One job of ``squeue --json``, reduced to what dlshare uses."""

    job_id: str
    name: str
    partition: str
    state: str  # base state, upper case: PENDING, RUNNING, COMPLETED...
    reason: str
    priority: int  # 0 while held
    nodes: tuple[str, ...]  # where it runs (expanded)
    required_nodes: tuple[str, ...]
    node_count: int
    tasks: int
    cpus: int
    memory_mb: int | None  # per node, when known
    gres_per_node: tuple[GresRequest, ...]
    gres_per_job: tuple[GresRequest, ...]
    gres_per_task: tuple[GresRequest, ...]
    comment: str
    admin_comment: str
    submit_time: float
    start_time: float
    end_time: float
    exit_code: int
    restart_count: int
    user: str = ""  # Slurm's user_name ("": unknown, the core's anonymous user)
    account: str = ""  # Slurm's account ("": none)
    owner_note: str = ""  # why user/account are not what Slurm wrote (a fallback was used); "" when they are
    time_limit_min: int | None = None  # the job's --time in minutes (None: unlimited or not set)

    @property
    def held(self) -> bool:
        """Pending with priority 0: held (by the user, an admin, ``requeuehold`` or dlshare's job_submit.lua)."""
        return self.state in PENDING and self.priority == 0

    @property
    def pending(self) -> bool:
        return self.state in PENDING

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def gpus(self, name: str = "gpu") -> int:
        """Total ``name`` GRES the job asks for (per job, per node x nodes, or per task x tasks)."""
        per_job = sum(g.count for g in self.gres_per_job if g.name == name)
        if per_job:
            return per_job
        per_node = sum(g.count for g in self.gres_per_node if g.name == name)
        if per_node:
            return per_node * max(1, self.node_count)
        return sum(g.count for g in self.gres_per_task if g.name == name) * max(1, self.tasks)


@dataclass(frozen=True)
class SlurmNode:
    """One node of ``sinfo --json``."""

    name: str
    state: str  # base state, lower case: idle, mixed, allocated, down...
    flags: frozenset[str]
    cpus: int
    memory_mb: int
    gpus: int
    partitions: tuple[str, ...]
    alloc_cpus: int
    alloc_memory_mb: int
    reason: str

    @property
    def down(self) -> bool:
        return self.state in ("down", "future") or "DOWN" in self.flags

    @property
    def usable(self) -> bool:
        """Takes new work: up, not drained or failing (NOT_RESPONDING alone is not yet a loss)."""
        return self.state in ("idle", "mixed", "allocated", "completing") and not (self.flags & _UNUSABLE_FLAGS)


# ------------------------------------------------------------------ hostlists


_HOSTLIST_LIMIT = 1 << 16


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``n[1-3,05],gpu7`` -> (n1, n2, n3, n05, gpu7); keeps zero padding; ranges may repeat (``r[1-2]n[1-2]``)."""
    text = (text or "").strip()
    if not text or text in ("(null)", "None"):
        return ()
    out: list[str] = []
    for item in _split_top(text):
        names = [""]
        for lit, rng in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            if not lit and not rng:
                continue
            vals = _range(rng, text) if rng else [""]
            names = [n + lit + v for n in names for v in vals]
            if len(names) > _HOSTLIST_LIMIT:
                raise SlurmJsonError(f"hostlist {text!r}: more than {_HOSTLIST_LIMIT} names")
        out.extend(names)
    return tuple(dict.fromkeys(out))


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmJsonError(f"hostlist {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmJsonError(f"hostlist {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _range(rng: str, text: str) -> list[str]:
    vals: list[str] = []
    for part in rng.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise SlurmJsonError(f"hostlist {text!r}: bad range {part!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo) or int(hi) - int(lo) > _HOSTLIST_LIMIT:
            raise SlurmJsonError(f"hostlist {text!r}: bad range {part!r}")
        width = len(lo) if lo.startswith("0") else 0
        vals.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return vals


# ------------------------------------------------------------------ fields


def parse_gres(text: str) -> tuple[GresRequest, ...]:
    """``gres:gpu:2,gres:shard:1`` / ``gres/gpu:a100:2`` / ``gpu:4(S:0),shard:16`` -> requests."""
    out = []
    for item in _split_top(str(text or "")):
        item = re.sub(r"\([^()]*\)\s*\Z", "", item.strip())  # socket/index detail: gpu:4(S:0-1)
        if item.startswith(("gres:", "gres/")):
            item = item[5:]
        if not item or item in ("(null)", "N/A"):
            continue
        bits = item.split(":")
        if len(bits) == 1:
            name, typ, count = bits[0], "", "1"
        elif len(bits) == 2:
            name, typ, count = bits[0], "", bits[1]
        elif len(bits) == 3:
            name, typ, count = bits
        else:
            raise SlurmJsonError(f"gres {text!r}: cannot read {item!r}")
        if typ == "(null)":
            typ = ""
        if not re.fullmatch(r"\d{1,9}", count) or not re.fullmatch(r"[A-Za-z][\w.-]*", name):
            raise SlurmJsonError(f"gres {text!r}: cannot read {item!r}")
        out.append(GresRequest(name, typ, int(count)))
    return tuple(out)


def _num(rec: dict[str, Any], key: str, default: int | None = 0, where: str = "") -> int | None:
    v = rec.get(key, default)
    if isinstance(v, dict):  # later versions: {"set": true, "infinite": false, "number": N}
        if v.get("infinite"):
            return default
        v = v.get("number", default) if v.get("set", True) else default
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise SlurmJsonError(f"{where}: {key}: expected a number, got {v!r}")
    return int(v)


# Slurm's INFINITE (0xffffffff) and NO_VAL (0xfffffffe) as a 32-bit number of minutes.
_NO_LIMIT = 0xFFFFFFFE


def _time_limit(rec: dict[str, Any], where: str) -> int | None:
    """``time_limit`` in minutes; None for a job without one (UNLIMITED, unset, or Slurm's sentinels)."""
    v = _num(rec, "time_limit", None, where)
    if v is None or v <= 0 or v >= _NO_LIMIT:
        return None
    return v


def _text(rec: dict[str, Any], key: str, where: str) -> str:
    v = rec.get(key, "")
    if v is None:
        return ""
    if isinstance(v, list):  # later versions write some strings as lists
        if not all(isinstance(x, str) for x in v):
            raise SlurmJsonError(f"{where}: {key}: expected text, got {v!r}")
        return ",".join(v)
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise SlurmJsonError(f"{where}: {key}: expected text, got {v!r}")
    return str(v)


def _state(rec: dict[str, Any], key: str, where: str) -> tuple[str, frozenset[str]]:
    v = rec.get(key)
    if isinstance(v, str) and v:
        words = [v]
    elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        words = list(v)
    else:
        raise SlurmJsonError(f"{where}: {key}: expected a state, got {v!r}")
    return words[0], frozenset(w.upper() for w in words[1:])


def _load(data: Any, what: str) -> dict[str, Any]:
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise SlurmJsonError(f"{what}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SlurmJsonError(f"{what}: expected an object")
    errors = data.get("errors")
    if errors:  # e.g. slurmctld down: exit status 0, an error here and an empty list of jobs
        first = errors[0] if isinstance(errors, list) else errors
        if isinstance(first, dict):
            msg = f"{first.get('source', '')}: {first.get('error', '')} ({first.get('description', '')})"
        else:
            msg = str(first)
        raise SlurmJsonError(f"{what}: Slurm reports an error: {msg[:300]}")
    return data


NOBODY_UID = 65534
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _uid(rec: dict[str, Any]) -> int | None:
    v = rec.get("user_id")
    if isinstance(v, dict):  # later versions may wrap numbers
        v = v.get("number") if v.get("set", True) and not v.get("infinite") else None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 32:
        return None
    return v


def _name_problem(v: Any) -> str:
    """Why ``v`` is not usable as an owner name ("" when it is)."""
    if not isinstance(v, str):
        return f"not text: {type(v).__name__}"
    if len(v) > MAX_OWNER:
        return f"{len(v)} characters, more than {MAX_OWNER}"
    if _CONTROL.search(v):
        return "control characters"
    return ""


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def job_owner(rec: dict[str, Any]) -> tuple[str, str, str]:
    """``(user, account, note)`` of one ``squeue --json`` job record; never raises.

    The user is ``user_name`` (``user`` in sacct's shape).  When that is missing, empty, not
    usable as a name (not text, control characters, more than ``MAX_OWNER`` characters) or
    ``"nobody"`` for a uid that is not nobody's (Slurm 22.05 writes that when the uid has no name on
    the host running squeue), the user is the numeric ``user_id`` as text, as later Slurm versions
    print it; with no usable uid either, "" (the anonymous user).  The account is ``account``
    (Slurm keeps it in lower case); missing, empty or ``(null)`` is no account, and an unusable
    value is no account too.  ``note`` says what was replaced and by what ("" when nothing was).
    """
    notes = []
    uid = _uid(rec)
    key = "user_name" if "user_name" in rec or "user" not in rec else "user"
    raw = rec.get(key)
    name = raw.strip() if isinstance(raw, str) else raw
    if name is None:
        why = f"no {key}"
    elif name in ("", "(null)"):
        why = f"{key} is empty ({raw!r})"
    elif name == "nobody" and uid is not None and uid != NOBODY_UID:
        why = f"{key} 'nobody' for uid {uid} (the uid has no name on this host: is its user directory set up here?)"
    else:
        why = _name_problem(name)
        why = why and f"{key} {_short(raw)}: {why}"
    if not why:
        user = name
    elif uid is not None:
        user = str(uid)
        notes.append(f"{why}: counted as user {user!r} (its user_id)")
    else:
        user = ""
        notes.append(f"{why}, and no usable user_id ({_short(rec.get('user_id'))}): counted as the anonymous user")
    raw_acct = rec.get("account")
    acct = raw_acct.strip() if isinstance(raw_acct, str) else raw_acct
    if acct in (None, "", "(null)"):
        account = ""
    else:
        why = _name_problem(acct)
        account = "" if why else acct
        if why:
            notes.append(f"account {_short(raw_acct)} ({why}): counted as no account")
    return user, account, "; ".join(notes)


def parse_job(rec: Any) -> SlurmJob:
    if not isinstance(rec, dict):
        raise SlurmJsonError("job: expected an object")
    jid = rec.get("job_id")
    if isinstance(jid, bool) or not isinstance(jid, int) or jid <= 0:
        raise SlurmJsonError(f"job: job_id: expected a positive number, got {jid!r}")
    where = f"job {jid}"
    jid_s = str(jid)  # array tasks and heterogeneous components each have their own job_id too
    state, _ = _state(rec, "job_state", where)
    mem_node = _num(rec, "memory_per_node", None, where)
    mem_cpu = _num(rec, "memory_per_cpu", None, where)
    cpus = _num(rec, "cpus", 1, where) or 1
    nodes = expand_hostlist(_text(rec, "nodes", where))
    node_count = _num(rec, "node_count", 1, where) or max(1, len(nodes))
    if mem_node is None and mem_cpu is not None:
        mem_node = mem_cpu * max(1, cpus // max(1, node_count))
    try:
        gres_node = parse_gres(_text(rec, "tres_per_node", where))
        gres_job = parse_gres(_text(rec, "tres_per_job", where))
        gres_task = parse_gres(_text(rec, "tres_per_task", where))
        req_nodes = expand_hostlist(_text(rec, "required_nodes", where))
    except SlurmJsonError as exc:
        raise SlurmJsonError(f"{where}: {exc}") from None
    user, account, owner_note = job_owner(rec)
    exit_code = rec.get("exit_code", 0)
    if isinstance(exit_code, dict):  # later versions: {"status": [...], "return_code": {...}}
        exit_code = _num(exit_code, "return_code", 0, where)
    return SlurmJob(
        job_id=jid_s, name=_text(rec, "name", where), partition=_text(rec, "partition", where),
        state=state.upper(), reason=_text(rec, "state_reason", where), priority=_num(rec, "priority", 0, where) or 0,
        nodes=nodes, required_nodes=req_nodes, node_count=node_count,
        tasks=_num(rec, "tasks", 1, where) or 1, cpus=cpus, memory_mb=mem_node,
        gres_per_node=gres_node, gres_per_job=gres_job, gres_per_task=gres_task,
        comment=_text(rec, "comment", where), admin_comment=_text(rec, "admin_comment", where),
        submit_time=float(_num(rec, "submit_time", 0, where) or 0), start_time=float(_num(rec, "start_time", 0, where) or 0),
        end_time=float(_num(rec, "end_time", 0, where) or 0),
        exit_code=int(exit_code) if isinstance(exit_code, int) and not isinstance(exit_code, bool) else 0,
        restart_count=_num(rec, "restart_cnt", 0, where) or 0,
        user=user, account=account, owner_note=owner_note, time_limit_min=_time_limit(rec, where),
    )


def parse_jobs(data: Any) -> list[SlurmJob]:
    """Every job of ``squeue --json`` output (text or decoded)."""
    d = _load(data, "squeue --json")
    jobs = d.get("jobs")
    if not isinstance(jobs, list):
        raise SlurmJsonError("squeue --json: jobs: expected a list")
    return [parse_job(j) for j in jobs]


def parse_node(rec: Any) -> SlurmNode:
    if not isinstance(rec, dict):
        raise SlurmJsonError("node: expected an object")
    name = rec.get("name")
    if not isinstance(name, str) or not name:
        raise SlurmJsonError(f"node: name: expected text, got {name!r}")
    where = f"node {name}"
    state, flags = _state(rec, "state", where)
    extra = rec.get("state_flags") or []
    if not isinstance(extra, list) or not all(isinstance(f, str) for f in extra):
        raise SlurmJsonError(f"{where}: state_flags: expected a list of flags, got {extra!r}")
    flags = flags | frozenset(f.upper() for f in extra)
    try:
        gres = parse_gres(_text(rec, "gres", where))
    except SlurmJsonError as exc:
        raise SlurmJsonError(f"{where}: {exc}") from None
    parts = rec.get("partitions") or []
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise SlurmJsonError(f"{where}: partitions: expected a list of names")
    return SlurmNode(
        name=name, state=state.lower(), flags=flags, cpus=_num(rec, "cpus", 0, where) or 0,
        memory_mb=_num(rec, "real_memory", 0, where) or 0, gpus=sum(g.count for g in gres if g.name == "gpu"),
        partitions=tuple(parts), alloc_cpus=_num(rec, "alloc_cpus", 0, where) or 0,
        alloc_memory_mb=_num(rec, "alloc_memory", 0, where) or 0, reason=_text(rec, "reason", where),
    )


def parse_nodes(data: Any) -> list[SlurmNode]:
    """Every node of ``sinfo --json`` output (text or decoded); a node listed twice is kept once."""
    d = _load(data, "sinfo --json")
    nodes = d.get("nodes")
    if not isinstance(nodes, list):
        raise SlurmJsonError("sinfo --json: nodes: expected a list")
    out: dict[str, SlurmNode] = {}
    for n in nodes:
        node = parse_node(n)
        out.setdefault(node.name, node)
    return list(out.values())
