"""The scheduler service: HTTP API for job launchers, the live loop over node
daemons (MQTT), the Kubernetes scheduler extender and the status page.

Public names: :class:`SchedulerService` (the live loop), :func:`create_app`
(the FastAPI app), :class:`JobStore` (SQLite persistence), :class:`ApiJobSpec`
(a submission), :func:`run_tour` (the scripted tour of ``dlshare up --tour``).
"""

from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from scheduler.service.models import ApiJobSpec
from scheduler.service.store import JobStore

__all__ = ["SchedulerService", "create_app", "JobStore", "ApiJobSpec"]
