"""The scheduler service: HTTP API for job launchers, the live loop over node
daemons (MQTT), the Kubernetes scheduler extender and the status page.

What it may import (floor 2, a shell; ``lint-imports`` checks it): the scheduler core and its
libraries (:mod:`scheduler`), the control-plane substrate :mod:`nodesvc.bus` (the only way it
reaches nodes: MQTT, the codec, the command correlator), and its own dependencies (FastAPI,
pydantic, httpx, SQLite).  Never another shell (``nodesvc.daemon``, ``aggregator.server``),
``scheduler.cli`` or ``bench``; the core never imports this package.

Inside, the parts import one way: ``store``/``nodes``/``core_log``/``stats``/``charts`` (plain data and pure
functions) < ``tokens`` (who is calling) < ``models`` < ``journal`` (the core's log and snapshots) < ``commands`` (to nodes) <
``decisions`` (the core's decisions -> rows and commands) < ``translate`` (node messages -> core
events) < ``recovery`` < ``pending`` (why waiting jobs wait, their positions and start estimates),
``history`` (the cluster over time), ``metrics`` (Prometheus) < ``live`` (:class:`SchedulerService`,
which holds the others) < ``api``/``k8s``/``http_checks``/``views``/``status_page`` (HTTP).  No placement or allocation
policy lives here: that is the core's plugins' (and :mod:`scheduler.watch`'s).

Public names: :class:`SchedulerService` (the live loop), :func:`create_app`
(the FastAPI app), :class:`JobStore` (SQLite persistence), :class:`ApiJobSpec`
(a submission).
"""

from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from scheduler.service.models import ApiJobSpec
from scheduler.service.store import JobStore

__all__ = ["SchedulerService", "create_app", "JobStore", "ApiJobSpec"]
