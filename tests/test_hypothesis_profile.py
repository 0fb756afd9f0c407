"""The suite's hypothesis profile (tests/conftest.py): no timing checks, nothing else changed."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def test_a_tests_own_settings_inherit_the_suite_profile():
    own = settings(max_examples=7)  # as a test's @settings(max_examples=...) builds it
    assert own.max_examples == 7
    assert own.deadline is None and HealthCheck.too_slow in own.suppress_health_check
    assert HealthCheck.filter_too_much not in own.suppress_health_check  # the other checks stay

