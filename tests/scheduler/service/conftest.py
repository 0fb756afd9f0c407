"""Fixtures for the scheduler-service tests (helpers live in svc_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def store(tmp_path):
    from scheduler.service.store import JobStore

    s = JobStore(tmp_path / "sched.db", synchronous="NORMAL")
    yield s
    s.close()
