"""Commands from the scheduler service to node daemons, over the bus.

:class:`NodeCommands` sends one command at a time as a QoS 1 message and waits
for its reply, correlated by command id (``nodesvc.bus.rpc.Correlator``, the
one correlator of the project).  The service's parts start commands as
background tasks with :meth:`NodeCommands.spawn`, so that a slow node never
holds up the loop; commands about one job run one after the other (a ``stop``
never overtakes the ``run`` before it); :meth:`NodeCommands.close` cancels
what is still running.  Command ids derive from decision ids, so a command
sent again after a restart is answered from the node's reply cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from nodesvc.bus.rpc import CommandError, CommandNotSent, Correlator

if TYPE_CHECKING:  # pragma: no cover
    from nodesvc.bus.mqtt import Bus

log = logging.getLogger("dlshare.sched.live")


class NodeCommands:
    """The service's command path to node daemons (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.correlator = Correlator("sched", timeout_s)
        self.bus: Bus | None = None  # set once the service has a broker connection
        self._tasks: set[asyncio.Task] = set()
        self._last: dict[str, asyncio.Task] = {}  # key (a job) -> its latest command task
        self._replied: dict[str, tuple[float, Any]] = {}  # timed command id -> (reply seen, the node's ts)

    async def send(self, node: str, op: str, args: dict[str, Any], cmd_id: str,
                   stages: dict[str, float] | None = None) -> dict[str, Any]:
        """Send one command (QoS 1) and wait for its reply; raises ``CommandError``.  With
        ``stages``, the times it was handed to the bus (``publish``), the broker took it (``sent``),
        the node took it (``node``, when the reply says) and its reply reached this loop
        (``reply``) are written there (wall clock)."""
        if self.bus is None:
            raise CommandNotSent("no broker configured")
        if stages is None:
            return await self.correlator.call(self.bus.publish, node, op, args, cmd_id)
        bus = self.bus

        async def publish(topic: str, payload: bytes, qos: int) -> bool:
            stages.setdefault("publish", time.time())
            ok = await bus.publish(topic, payload, qos)
            stages["sent"] = time.time()
            return ok

        self._replied[cmd_id] = (0.0, None)
        try:
            return await self.correlator.call(publish, node, op, args, cmd_id)
        finally:  # a refusal was answered too: its times count
            seen, node_ts = self._replied.pop(cmd_id, (0.0, None))
            if seen:
                stages["reply"] = seen
            if isinstance(node_ts, (int, float)) and not isinstance(node_ts, bool) and 0 < node_ts < 1e12:
                stages["node"] = float(node_ts)  # a time (s since the epoch); anything else is ignored

    def resolve(self, reply: dict[str, Any]) -> None:
        """A reply arrived on ``.../reply``: wake whoever waits for it."""
        cid = str(reply.get("id")) if isinstance(reply, dict) else ""
        if self.correlator.resolve(reply) and cid in self._replied:
            self._replied[cid] = (time.time(), reply.get("ts"))

    def spawn(self, coro: Coroutine[Any, Any, None], key: str | None = None) -> None:
        """Run ``coro`` in the background (kept until it ends, cancelled by :meth:`close`); with
        ``key``, only after the commands spawned before with the same key have ended."""
        prev = self._last.get(key) if key is not None else None
        t = asyncio.get_running_loop().create_task(self._after(prev, coro) if prev is not None else coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        if key is not None:
            self._last[key] = t
            t.add_done_callback(lambda done, k=key: self._last.pop(k) if self._last.get(k) is done else None)

    @staticmethod
    async def _after(prev: asyncio.Task, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await asyncio.wait([prev])  # its outcome is its own; a cancel of this task still propagates
        except BaseException:
            coro.close()
            raise
        await coro

    async def release(self, job_id: str, node: str, cmd_id: str) -> None:
        """Free what ``node`` holds for ``job_id`` (cgroups); a failure is only logged."""
        try:
            await self.send(node, "release", {"job": job_id}, cmd_id)
        except CommandError as exc:
            log.info("release of %s on %s: %s", job_id, node, exc)

    async def stop_and_release(self, job_id: str, node: str, cmd_base: str, stop: bool = True) -> None:
        """``stop`` (when asked) then ``release`` ``job_id`` on ``node``, as ``cmd_base``/stop and /release."""
        if stop:
            try:
                await self.send(node, "stop", {"job": job_id}, f"{cmd_base}/stop")
            except CommandError as exc:
                log.info("stop of %s on %s: %s", job_id, node, exc)
        await self.release(job_id, node, f"{cmd_base}/release")

    async def close(self) -> None:
        """Cancel the commands still in flight and wait for them to end."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a cancel of close() itself propagates
