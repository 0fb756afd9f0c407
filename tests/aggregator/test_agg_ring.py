"""Consistent hashing of chunks onto servers (the client's key partitioning)."""

from __future__ import annotations

import pytest

from aggregator.client import HashRing
from aggregator.placement import NoServer


def test_ring_spreads_keys_and_moves_few_when_a_server_joins():
    three = HashRing(["a:1", "b:1", "c:1"])
    items = [f"job/{k}/{c}" for k in range(50) for c in range(40)]
    owners = [three.route(i) for i in items]
    share = {s: owners.count(s) / len(items) for s in three.servers}
    assert all(0.2 < v < 0.47 for v in share.values()), share
    four = HashRing(["a:1", "b:1", "c:1", "d:1"])
    moved = sum(1 for i, o in zip(items, owners) if four.route(i) != o)
    assert moved / len(items) < 0.4  # about a quarter moves, all of it to the new server
    assert all(four.route(i) == "d:1" for i, o in zip(items, owners) if four.route(i) != o)


def test_ring_is_deterministic_and_skips_draining_servers():
    r1, r2 = HashRing(["x:1", "y:1"]), HashRing(["y:1", "x:1"])
    assert all(r1.route(f"k{i}") == r2.route(f"k{i}") for i in range(200))  # order of the list is irrelevant
    assert all(r1.route(f"k{i}", skip={"x:1"}) == "y:1" for i in range(200))
    with pytest.raises(NoServer, match="down or draining"):
        r1.route("k", skip={"x:1", "y:1"})
    with pytest.raises(ValueError):
        HashRing([])
