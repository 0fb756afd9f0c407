"""Bounded teardowns: a fixture's clean-up that hangs fails within seconds and names what hung.

A stuck teardown used to sit until pytest-timeout killed the test at 300 s, with the event loop idle
in ``select`` and no word of which task never ended.  :func:`within` awaits a clean-up with a
deadline; past it, it raises :class:`TeardownHung` with the stack of every asyncio task still pending.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable


class TeardownHung(TimeoutError):
    pass


def pending_tasks() -> str:
    """Every unfinished task of the running loop with its stack, one block each."""
    out = io.StringIO()
    me = asyncio.current_task()
    for t in asyncio.all_tasks():
        if t is me or t.done():
            continue
        out.write(f"--- task {t.get_name()}: {t.get_coro()!r}\n")
        t.print_stack(limit=8, file=out)
    return out.getvalue() or "(no other task pending)"


async def within(aw: Awaitable[object], seconds: float, what: str) -> None:
    """Await ``aw`` (a clean-up) for at most ``seconds``; past that, raise naming ``what`` and the
    tasks still pending (``aw`` itself is cancelled)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task in done:
        task.result()
        return
    stacks = pending_tasks()
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    raise TeardownHung(f"{what} did not end within {seconds:g}s; tasks still pending:\n{stacks}")
