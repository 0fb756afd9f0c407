"""The bounded teardown helper itself: a clean-up that hangs fails fast and names the stuck task."""

from __future__ import annotations

import asyncio

import pytest

from tests.teardown import TeardownHung, within


async def test_a_hung_cleanup_fails_within_its_deadline_naming_the_stuck_task():
    never = asyncio.Event()

    async def stuck_reader():
        await never.wait()

    t = asyncio.create_task(stuck_reader(), name="stuck-reader")

    async def cleanup():
        await t  # waits for a task that never ends

    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TeardownHung) as err:
        await within(cleanup(), 0.3, "stopping the reader")
    assert loop.time() - start < 10
    assert "stopping the reader" in str(err.value) and "stuck-reader" in str(err.value)
    t.cancel()


async def test_a_cleanup_that_ends_returns_and_its_error_propagates():
    await within(asyncio.sleep(0), 5, "nothing")

    async def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await within(broken(), 5, "broken")
