"""Plain-dict (JSON-ready) forms of events and decisions, for event logs and replay.

``event_to_dict(ev)`` / ``event_from_dict(d)`` and ``decision_to_dict(d)`` /
``decision_from_dict(d)`` round-trip every type in :mod:`scheduler.events`;
the ``"type"`` key names the class.  Both ``*_from_dict`` raise
:class:`CodecError` (a ``ValueError``) naming the field at fault, so a shell can
reject a bad logged or submitted event without crashing.

Logs written before the project's one event convention keep replaying: an
event's ``stimulus_id`` was called ``id`` and a decision's was called
``cause``, and both old keys are still read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scheduler import events as E
from scheduler.model import Job, JobState, Node, Shard

EVENTS = {c.__name__: c for c in (E.JobArrived, E.JobFinished, E.JobCancelled, E.PlacementFailed, E.Tick,
                                  E.NodeReport, E.NodeLost, E.JobStarted, E.JobBound,
                                  E.DonorReclaimed)}
DECISIONS = {c.__name__: c for c in (E.Place, E.Preempt, E.Allocate, E.Reject, E.Wakeup, E.Release)}


_OLD_EVENT_ID = "id"  # an event's stimulus_id in logs written before the event convention
_OLD_DECISION_ID = "cause"  # likewise a decision's


class CodecError(ValueError):
    """A dict that is not a valid event or decision."""


_SCALARS = (str, int, float, bool, type(None))


def _plain(v: Any) -> Any:
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, Job):
        return v.to_dict()
    if isinstance(v, JobState):
        return v.value
    if isinstance(v, (list, tuple)):
        return [x if isinstance(x, _SCALARS) else _plain(x) for x in v]
    if isinstance(v, dict):
        return {k: x if isinstance(x, _SCALARS) else _plain(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # Field order is declaration order, as dataclasses.fields() gives it (the instance dict keeps it).
        return {k: x if isinstance(x, _SCALARS) else _plain(x) for k, x in vars(v).items()}
    return v


def event_to_dict(ev: E.Event) -> dict[str, Any]:
    return {"type": type(ev).__name__, **_plain(ev)}


def decision_to_dict(d: E.Decision) -> dict[str, Any]:
    return {"type": type(d).__name__, **_plain(d)}


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise CodecError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise CodecError(f"{key}: expected a non-empty string, got {v!r}")
    return v


def _opt_str(d: dict[str, Any], key: str) -> str:
    v = d.get(key, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise CodecError(f"{key}: expected a string, got {v!r}")
    return v


def event_from_dict(d: Any) -> E.Event:
    if not isinstance(d, dict):
        raise CodecError("event must be an object")
    t = d.get("type")
    cls = EVENTS.get(t) if isinstance(t, str) else None
    if cls is None:
        raise CodecError(f"type: unknown event type {d.get('type')!r} (known: {', '.join(EVENTS)})")
    id_key = _OLD_EVENT_ID if "stimulus_id" not in d and _OLD_EVENT_ID in d else "stimulus_id"
    base = {"stimulus_id": _str(d, id_key), "now": _num(d, "now")}
    try:
        if cls is E.JobArrived:
            if not isinstance(d.get("job"), dict):
                raise CodecError("job: expected an object")
            return cls(**base, job=Job.from_dict(d["job"]))
        if cls in (E.JobFinished, E.JobCancelled, E.PlacementFailed):
            extra = {"reason": str(d.get("reason", ""))} if "reason" in d else {}
            if cls is E.JobFinished:
                extra["failed"] = bool(d.get("failed", False))
                extra["node"] = _opt_str(d, "node")
            if cls is E.PlacementFailed:
                extra["place_id"] = _opt_str(d, "place_id")
            return cls(**base, job=_str(d, "job"), **extra)
        if cls is E.Tick:
            return cls(**base)
        if cls is E.NodeLost:
            return cls(**base, node=_str(d, "node"))
        if cls is E.DonorReclaimed:
            n = d.get("bytes")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise CodecError(f"bytes: expected an integer >= 0, got {n!r}")
            return cls(**base, node=_str(d, "node"), bytes=n)
        if cls is E.JobStarted:
            return cls(**base, job=_str(d, "job"), node=_str(d, "node"), place_id=_opt_str(d, "place_id"))
        if cls is E.JobBound:
            if not isinstance(d.get("job"), dict):
                raise CodecError("job: expected an object")
            gpus = d.get("gpus") or []
            if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
                raise CodecError("gpus: expected a list of GPU indices")
            hold = None if d.get("hold_s") is None else _num(d, "hold_s")
            return cls(**base, job=Job.from_dict(d["job"]), node=_str(d, "node"), gpus=tuple(gpus), hold_s=hold)
        node = d.get("node")
        if not isinstance(node, dict):
            raise CodecError("node: expected an object")
        jobs = d.get("jobs") or {}
        if not isinstance(jobs, dict):
            raise CodecError("jobs: expected an object")
        samples = {}
        for jid, s in jobs.items():
            if not isinstance(s, dict):
                raise CodecError(f"jobs.{jid}: expected an object")
            samples[str(jid)] = E.JobSample(**{k: (None if s.get(k) is None else _num(s, k))
                                               for k in ("sm_percent", "mem_percent", "speed")})
        util = d.get("gpu_util") or []
        if not isinstance(util, list):
            raise CodecError("gpu_util: expected a list")
        running = d.get("running")
        if running is not None and (not isinstance(running, list) or not all(isinstance(j, str) for j in running)):
            raise CodecError("running: expected a list of job ids")
        return E.NodeReport(**base, node=Node(**{k: node[k] for k in Node.__dataclass_fields__ if k in node}),
                            gpu_util=tuple(float(x) for x in util),
                            cpu_percent=None if d.get("cpu_percent") is None else _num(d, "cpu_percent"),
                            memory_available_bytes=None if d.get("memory_available_bytes") is None
                            else int(_num(d, "memory_available_bytes")),
                            jobs=samples, running=None if running is None else tuple(running))
    except CodecError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise CodecError(f"{cls.__name__}: {exc}") from None


def decision_from_dict(d: Any) -> E.Decision:
    if not isinstance(d, dict):
        raise CodecError("decision must be an object")
    t = d.get("type")
    cls = DECISIONS.get(t) if isinstance(t, str) else None
    if cls is None:
        raise CodecError(f"type: unknown decision type {d.get('type')!r} (known: {', '.join(DECISIONS)})")
    fields = {k: v for k, v in d.items() if k != "type"}
    if "stimulus_id" not in fields and _OLD_DECISION_ID in fields:
        fields["stimulus_id"] = fields.pop(_OLD_DECISION_ID)
    try:
        if cls is E.Place:
            fields["shards"] = tuple(Shard(s["node"], tuple(s["gpus"])) for s in fields["shards"])
            fields["colocated_with"] = tuple(fields.get("colocated_with", ()))
        if cls is E.Preempt:
            fields["nodes"] = tuple(fields.get("nodes", ()))
        if cls is E.Release:
            fields["nodes"] = tuple(fields["nodes"])
            fields["state"] = JobState(fields["state"])
        return cls(**fields)
    except (TypeError, ValueError, KeyError) as exc:
        raise CodecError(f"{cls.__name__}: {exc}") from None
