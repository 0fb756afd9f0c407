"""Fixtures for the scheduler-service tests (the helpers they use live in svc_helpers.py)."""

from __future__ import annotations

import pytest

from tests.scheduler.service.svc_helpers import FakeNodes, LiveServices
from tests.teardown import within


@pytest.fixture
def store(tmp_path):
    from scheduler.service.store import JobStore

    s = JobStore(tmp_path / "sched.db", synchronous="NORMAL")
    yield s
    s.close()


@pytest.fixture
async def fake_node(mosquitto):
    """``await fake_node("n1", cpus=8, gpus=2)``: a node speaking the daemon's MQTT contract on the
    test's mosquitto; the ones still up are stopped at the end."""
    nodes = FakeNodes(mosquitto.url)
    yield nodes.start
    await within(nodes.stop_all(), 20, "stopping the fake nodes")


@pytest.fixture
async def live_service(mosquitto, tmp_path):
    """``await live_service.start(db, profile)``: the service in-process against the test's
    mosquitto; ``await live_service.stop(svc)`` stops one (a restart starts another on the same
    db); the ones still running are stopped at the end."""
    services = LiveServices(mosquitto.url, tmp_path)
    yield services
    await within(services.stop_all(), 30, "stopping the scheduler services")
