"""The scheduler core's events as JSON, for the service's replayable log.

Every event the live loop hands to ``SchedulerState.handle`` is written, with
its id, in the batch it was handled in.  At start the service reads the log
back, batch by batch, into a fresh core: the same events in the same batches
give the same state and the same decisions (with the same ids), and the
decisions table says which of those were already carried out.

Pure: no I/O.  :func:`decode_event` raises :class:`CoreLogError` for anything
it cannot turn back into an event.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import TYPE_CHECKING, Any

from scheduler.events import (
    Event, JobArrived, JobCancelled, JobFinished, JobSample, NodeLost, NodeReport, PlacementFailed, Tick,
)
from scheduler.model import Job, Node

if TYPE_CHECKING:
    from scheduler.service.store import JobRow

_TYPES: dict[str, type] = {c.__name__: c for c in (
    JobArrived, JobFinished, JobCancelled, PlacementFailed, Tick, NodeReport, NodeLost)}


class CoreLogError(ValueError):
    pass


def encode_event(ev: Event) -> str:
    kind = type(ev).__name__
    if kind not in _TYPES:
        raise CoreLogError(f"cannot log event type {kind}")
    body: dict[str, Any] = {"type": kind}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        if isinstance(v, Job):
            v = v.to_dict()
        elif isinstance(v, Node):
            v = dataclasses.asdict(v)
        elif f.name == "jobs":
            v = {k: dataclasses.asdict(s) for k, s in v.items()}
        elif isinstance(v, tuple):
            v = list(v)
        body[f.name] = v
    return json.dumps(body, sort_keys=True, allow_nan=False)


def decode_event(text: str) -> Event:
    try:
        body = json.loads(text)
        kind = body.pop("type")
        cls = _TYPES[kind]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CoreLogError(f"unreadable core event {text[:200]!r}: {exc}") from None
    try:
        if cls is JobArrived:
            body["job"] = Job.from_dict(body["job"])
        elif cls is NodeReport:
            body["node"] = Node(**body["node"])
            body["gpu_util"] = tuple(body.get("gpu_util") or ())
            body["jobs"] = {k: JobSample(**v) for k, v in (body.get("jobs") or {}).items()}
        return cls(**body)
    except (TypeError, ValueError, KeyError) as exc:
        raise CoreLogError(f"core event {kind} does not fit its type: {exc}") from None


def new_event_id() -> str:
    """A fresh id for an event the service makes up (every core event carries one)."""
    return f"ev-{uuid.uuid4().hex[:16]}"


def core_job(row: "JobRow", now: float) -> Job:
    """The core's view of an accepted job row."""
    s = row.spec
    return Job(id=row.id, model=s.get("model") or s.get("name") or "unknown", batch_size=int(s.get("batch_size") or 0),
               gpus=int(s["gpus"]), cpus=float(s.get("cpus") or 0.0), memory_bytes=int(s.get("memory_bytes") or 0),
               priority=int(s.get("priority") or 0), arrival=max(0.0, row.submitted_at),
               attained_service=float(row.attained_service), features=s.get("graph_features"))
