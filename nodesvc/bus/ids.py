"""Stimulus ids: the one generator of the ids that every pure core's events carry.

Every core (scheduler, aggregation, reclaim) takes events whose first field is a ``stimulus_id``,
and each decision carries the id of the event that caused it, so that a decision can be traced to
its cause in logs, event tables and replays.  Each shell makes its ids here::

    from nodesvc.bus.ids import stimulus_id
    core.handle(Tick(stimulus_id("tick"), clock()))

An id is ``<what>-<run>-<n>``: ``what`` says where it came from, ``run`` is 64 random bits drawn once
per process (so ids stay unique across restarts, which a persistent event log needs) and ``n``
counts up within the process (so ids sort by creation within a run).  Thread-safe: ``next()`` on
an ``itertools.count`` is atomic under the GIL.
"""

from __future__ import annotations

import itertools
import secrets

RUN = secrets.token_hex(8)
_n = itertools.count(1)


def stimulus_id(what: str = "ev") -> str:
    return f"{what}-{RUN}-{next(_n)}"
