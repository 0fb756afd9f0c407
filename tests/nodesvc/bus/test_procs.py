"""nodesvc.bus.procs.until: polls a predicate without blocking the event loop."""

from __future__ import annotations

import asyncio

import pytest

from nodesvc.bus.procs import until


async def test_until_returns_the_first_true_value_of_a_plain_or_an_awaitable_predicate():
    calls = []

    def plain():
        calls.append(1)
        return len(calls) >= 3 and "plain"

    assert await until(plain, timeout=10, interval=0.001) == "plain" and len(calls) == 3

    ticks = []

    async def ticker():  # runs only while until() yields the loop
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        async def check():  # a blocking check, run in a thread, as test_page's CLI calls are
            return await asyncio.to_thread(lambda: len(ticks) >= 5 and {"seen": len(ticks)})

        got = await until(lambda: check(), timeout=10, interval=0.001)
        assert got["seen"] >= 5  # an awaitable is awaited, not taken as true for being an object
    finally:
        task.cancel()


async def test_until_times_out_naming_what_it_waited_for_and_the_last_value():
    async def never():
        return 0

    with pytest.raises(TimeoutError, match=r"waiting for the thing \(last: 0\)"):
        await until(lambda: never(), timeout=0.05, what="the thing", interval=0.01)
