"""Helpers shared by the aggregation tests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from aggregator import AggregationServer


def addr(server: AggregationServer) -> str:
    return f"{server.address[0]}:{server.address[1]}"


def run_ranks(world: int, fn, timeout: float = 30.0) -> list:
    """Run ``fn(rank)`` for every rank in threads; re-raise the first failure."""
    with ThreadPoolExecutor(world) as ex:
        futs = [ex.submit(fn, r) for r in range(world)]
        return [f.result(timeout=timeout) for f in futs]

