"""Commands with correlated replies: the one place anything waits on a daemon's answer.

A command goes out on ``dlshare/v1/<kind>/<id>/cmd`` at QoS 1 with an id; the
daemon's reply on ``.../reply`` carries the same id.  :class:`Correlator` keeps
the futures of commands in flight by id and resolves them when replies arrive;
it owns no connection, so every shell (the scheduler service, the remote-memory
control plane, :class:`NodeClient`) feeds it the replies its own bus receives
and hands it the publish function of that bus.

Ids are the caller's to choose when they must survive a restart (the scheduler
derives them from decision ids, so a re-sent command is answered from the
node's reply cache instead of being applied twice); otherwise the correlator
makes unique ones.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt

from nodesvc.bus import messages
from nodesvc.bus.mqtt import parse_broker_url

# publish(topic, payload, qos) -> whether the message went out
Publish = Callable[[str, bytes, int], Awaitable[bool]]


class CommandError(RuntimeError):
    """A command that did not succeed: refused, not sent, or not answered in time."""


class CommandRefused(CommandError):
    """The daemon answered ``ok: false``; ``reply`` is its whole answer."""

    def __init__(self, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reply = reply or {}


class CommandTimeout(CommandError, TimeoutError):
    """No reply within the timeout (the command may or may not have been applied)."""


class CommandNotSent(CommandError, ConnectionError):
    """The broker was not connected: the command never left."""


class Correlator:
    """Futures of the commands in flight, by id.

    ``prefix`` starts the ids it makes (unique per process and instance);
    ``timeout_s`` is the default wait for a reply.  Not thread-safe: use it
    from the event loop that runs the bus.
    """

    def __init__(self, prefix: str = "", timeout_s: float = 10.0) -> None:
        self.prefix = prefix or f"dlshare-{os.getpid()}"
        self.timeout_s = timeout_s
        self._instance = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}

    def next_id(self) -> str:
        return f"{self.prefix}-{self._instance}-{next(self._ids)}"

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def resolve(self, reply: dict[str, Any]) -> bool:
        """A reply arrived: wake whoever waits on its id.  Stray and duplicate ids are ignored
        (returns False), since a broker may deliver a QoS 1 reply twice."""
        if not isinstance(reply, dict) or "ok" not in reply:
            return False
        fut = self._pending.pop(str(reply.get("id")), None)
        if fut is None or fut.done():
            return False
        fut.set_result(reply)
        return True

    async def reply(self, publish: Publish, topic: str, payload: bytes, cmd_id: str,
                    timeout: float | None = None, what: str = "command") -> dict[str, Any]:
        """Publish ``payload`` (already encoded, carrying ``cmd_id``) and return the whole reply,
        whatever its ``ok``.  Raises :class:`CommandNotSent` or :class:`CommandTimeout`."""
        timeout = self.timeout_s if timeout is None else timeout
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[cmd_id] = fut
        try:
            if not await publish(topic, payload, 1):
                raise CommandNotSent(f"broker not connected; {what} not sent")
            try:
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel on 3.11
                    return await fut
            except TimeoutError:
                raise CommandTimeout(f"{what}: no reply within {timeout:g}s") from None
        finally:
            self._pending.pop(cmd_id, None)

    async def call(self, publish: Publish, node: str, op: str, args: dict[str, Any] | None = None,
                   cmd_id: str | None = None, timeout: float | None = None, kind: str = "node",
                   leaf: str = "cmd") -> dict[str, Any]:
        """Send ``op`` to daemon ``node`` (on its ``leaf`` topic: ``cmd``, or ``mem`` for a memory
        consumer's ops) and return the reply's ``result``; raises :class:`CommandRefused`,
        :class:`CommandNotSent` or :class:`CommandTimeout`."""
        cid = cmd_id or self.next_id()
        r = await self.reply(publish, messages.topic(kind, node, leaf), messages.command(op, cid, **(args or {})),
                             cid, timeout, what=f"{op} to {node}")
        if not r.get("ok"):
            raise CommandRefused(f"{op} on {node} refused: {r.get('error')}", r)
        return r.get("result") or {}

    def fail_all(self, exc: BaseException) -> None:
        """Wake every waiter with ``exc`` (the connection went away for good)."""
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)


class NodeClient:
    """A small async client for node daemons: its own MQTT connection, commands with
    correlated replies, and the nodes' ``events`` on :attr:`events`.

    >>> async with NodeClient("mqtt://broker:1883") as c:
    ...     await c.call("node-1", "ping")
    """

    def __init__(self, broker: str, client_id: str | None = None, timeout_s: float = 10.0) -> None:
        self.addr = parse_broker_url(broker)
        self.tls = self.addr.tls_context()  # a bad CA or certificate file fails here
        self.client_id = client_id or f"dlshare-client-{os.getpid()}-{time.monotonic_ns()}"
        self.rpc = Correlator(self.client_id, timeout_s)
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task | None = None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __aenter__(self) -> "NodeClient":
        self._client = aiomqtt.Client(**self.addr.client_args(self.tls), identifier=self.client_id, timeout=5)
        await self._client.__aenter__()
        await self._client.subscribe(f"{messages.PREFIX}/node/+/reply", qos=1)
        await self._client.subscribe(f"{messages.PREFIX}/node/+/events", qos=1)
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.rpc.fail_all(CommandNotSent("client closed"))
        if self._client:
            await self._client.__aexit__(None, None, None)

    async def _publish(self, topic: str, payload: bytes, qos: int) -> bool:
        if self._client is None:
            return False
        try:
            await self._client.publish(topic, payload, qos=qos)
        except aiomqtt.MqttError:
            return False
        return True

    async def _pump(self) -> None:
        assert self._client is not None
        async for msg in self._client.messages:
            try:
                obj = messages.decode(msg.payload)
                # Match topics here too: a broker may deliver more than the filters asked for.
                kind, _node, leaf = messages.parse_topic(str(msg.topic))
            except messages.PayloadError:
                continue
            if kind != "node":
                continue
            if leaf == "events":
                self.events.put_nowait(obj)
            elif leaf == "reply":
                self.rpc.resolve(obj)

    async def send_raw(self, node: str, payload: bytes, cmd_id: str | None = None,
                       timeout: float = 10.0) -> dict[str, Any]:
        """Publish a hand-made command payload and return the whole reply (for tests of bad input)."""
        return await self.rpc.reply(self._publish, messages.node_topic(node, "cmd"), payload, str(cmd_id),
                                    timeout, what=f"command to {node}")

    async def call(self, node: str, op: str, timeout: float = 10.0, cmd_id: str | None = None,
                   **args: Any) -> dict[str, Any]:
        """Send ``op`` to ``node``; returns ``result`` or raises :class:`CommandError`."""
        return await self.rpc.call(self._publish, node, op, args, cmd_id, timeout)
