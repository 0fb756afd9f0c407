"""The scheduler core's events as JSON, for the service's replayable log.

Every event the live loop hands to ``SchedulerState.handle`` is written, with
its ``stimulus_id``, in the batch it was handled in, in :mod:`scheduler.codec`'s
form (the one codec of the core's events).  At start the service reads the log
back, batch by batch, into a fresh core: the same events in the same batches
give the same state and the same decisions (with the same ids), and the
decisions table says which of those were already carried out.

Pure: no I/O.  :func:`decode_event` raises :class:`CoreLogError` for anything
it cannot turn back into an event.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from nodesvc.bus.ids import stimulus_id
from scheduler.codec import CodecError, event_from_dict, event_to_dict
from scheduler.events import Event
from scheduler.model import Job

if TYPE_CHECKING:
    from scheduler.service.rows import JobRow


class CoreLogError(ValueError):
    """A logged line that is not a core event (the message says why)."""


def encode_event(ev: Event) -> str:
    """One logged line: the event as :mod:`scheduler.codec` writes it, as JSON."""
    return json.dumps(event_to_dict(ev), sort_keys=True, allow_nan=False)


def decode_event(text: str) -> Event:
    """The event of a logged line, written by this or an earlier version (the codec reads the old keys)."""
    try:
        body = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise CoreLogError(f"unreadable core event {text[:200]!r}: {exc}") from None
    try:
        return event_from_dict(body)
    except CodecError as exc:
        raise CoreLogError(f"core event {text[:200]!r}: {exc}") from None


def new_event_id() -> str:
    """A fresh ``stimulus_id`` for an event the service makes up (every core event carries one)."""
    return stimulus_id("ev")


def core_job(row: "JobRow", now: float) -> Job:
    """The core's view of an accepted job row (``gpus = 0``: a CPU-only job, which the API
    makes ask for cores)."""
    return spec_job(row.id, row.spec, max(0.0, row.submitted_at), float(row.attained_service),
                    user=row.user, account=row.account)


def spec_job(job_id: str, s: dict, arrival: float, attained_service: float = 0.0, user: str = "",
             account: str = "") -> Job:
    """The core's Job for a submitted spec (or a Kubernetes pod's, see ``k8s.pod_to_job``)."""
    gpus = int(s.get("gpus") or 0)
    cpus = float(s.get("cpus") or 0.0)
    return Job(id=job_id, model=s.get("model") or s.get("name") or "unknown", batch_size=int(s.get("batch_size") or 0),
               gpus=gpus, cpus=cpus if cpus > 0 or gpus else 0.01, memory_bytes=int(s.get("memory_bytes") or 0),
               priority=int(s.get("priority") or 0), arrival=arrival,
               remote_memory_bytes=int(s.get("remote_memory_bytes") or 0),
               attained_service=attained_service, features=s.get("graph_features"), user=user, account=account)
