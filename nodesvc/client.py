"""A small async client for node daemons: send a command, await its reply by id."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any

import aiomqtt

from nodesvc import messages
from nodesvc.bus import parse_broker_url


class CommandError(RuntimeError):
    """The daemon answered ``ok: false``."""


class NodeClient:
    def __init__(self, broker: str, client_id: str | None = None) -> None:
        self.addr = parse_broker_url(broker)
        self.client_id = client_id or f"dlshare-client-{os.getpid()}-{time.monotonic_ns()}"
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future] = {}
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task | None = None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __aenter__(self) -> "NodeClient":
        self._client = aiomqtt.Client(self.addr.host, self.addr.port, identifier=self.client_id,
                                      username=self.addr.username, password=self.addr.password, timeout=5)
        await self._client.__aenter__()
        await self._client.subscribe("dlshare/v1/node/+/reply", qos=1)
        await self._client.subscribe("dlshare/v1/node/+/events", qos=1)
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client:
            await self._client.__aexit__(None, None, None)

    async def _pump(self) -> None:
        async for msg in self._client.messages:
            try:
                obj = messages.decode(msg.payload)
            except messages.PayloadError:
                continue
            # Match topics here too: a broker may deliver more than the filters asked for.
            try:
                kind, _node, leaf = messages.parse_topic(str(msg.topic))
            except messages.PayloadError:
                continue
            if kind != "node":
                continue
            if leaf == "events":
                self.events.put_nowait(obj)
                continue
            if leaf != "reply" or "id" not in obj or "ok" not in obj:
                continue
            fut = self._pending.pop(str(obj["id"]), None)
            if fut is not None and not fut.done():
                fut.set_result(obj)

    async def send_raw(self, node: str, payload: bytes, cmd_id: str | None = None, timeout: float = 10.0) -> dict:
        fut = asyncio.get_running_loop().create_future()
        key = str(cmd_id)
        self._pending[key] = fut
        await self._client.publish(messages.node_topic(node, "cmd"), payload, qos=1)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(key, None)

    async def call(self, node: str, op: str, timeout: float = 10.0, cmd_id: str | None = None, **args: Any) -> dict:
        """Send ``op`` to ``node``; returns ``result`` or raises :class:`CommandError`."""
        cid = cmd_id or f"{self.client_id}-{next(self._ids)}"
        reply = await self.send_raw(node, messages.command(op, cid, **args), cid, timeout)
        if not reply.get("ok"):
            raise CommandError(f"{node} {op}: {reply.get('error')}")
        return reply.get("result", {})
