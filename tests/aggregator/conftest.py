"""Fixtures for the aggregation tests: in-process servers on free loopback ports."""

from __future__ import annotations

import time

import pytest

from aggregator import AggregationServer, ServerSettings


@pytest.fixture
def agg_servers():
    """A factory of started servers; all are stopped at the end of the test."""
    made: list[AggregationServer] = []

    def make(n: int = 1, **kw) -> list[AggregationServer]:
        out = []
        for i in range(n):
            kw.setdefault("round_timeout_s", 5.0)
            clock = kw.pop("clock", time.monotonic)
            s = AggregationServer(ServerSettings(server_id=f"t{len(made)}", **kw), clock).start()
            made.append(s)
            out.append(s)
        return out

    yield make
    for s in made:
        s.stop()
