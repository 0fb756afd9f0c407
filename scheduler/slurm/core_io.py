"""The one place this package touches the names of the core's event and decision fields.

Events are built positionally (the stimulus id, then ``now``), and the stimulus id of an event or a
decision is read here only, so the core's rename of ``Event.id`` / ``Decision.cause`` to
``stimulus_id`` (issue 9) needs no change elsewhere in the package: the field is found at import.
"""

from __future__ import annotations

from typing import Any

from scheduler import events as E
from scheduler.model import Job, Node

_EVENT_ID = "stimulus_id" if "stimulus_id" in E.Event.__dataclass_fields__ else "id"
_DECISION_ID = "stimulus_id" if "stimulus_id" in E.Decision.__dataclass_fields__ else "cause"


def event_id(ev: E.Event) -> str:
    return getattr(ev, _EVENT_ID)


def decision_id(d: E.Decision) -> str:
    """The stimulus id of the event that caused ``d``."""
    return getattr(d, _DECISION_ID)


def arrived(sid: str, now: float, job: Job) -> E.JobArrived:
    return E.JobArrived(sid, now, job)


def finished(sid: str, now: float, job: str, failed: bool, reason: str) -> E.JobFinished:
    return E.JobFinished(sid, now, job, failed, reason)


def cancelled(sid: str, now: float, job: str, reason: str) -> E.JobCancelled:
    return E.JobCancelled(sid, now, job, reason)


def placement_failed(sid: str, now: float, job: str, reason: str) -> E.PlacementFailed:
    return E.PlacementFailed(sid, now, job, reason)


def node_report(sid: str, now: float, node: Node, **kw: Any) -> E.NodeReport:
    return E.NodeReport(sid, now, node, **kw)


def node_lost(sid: str, now: float, node: str) -> E.NodeLost:
    return E.NodeLost(sid, now, node)


def tick(sid: str, now: float) -> E.Tick:
    return E.Tick(sid, now)
