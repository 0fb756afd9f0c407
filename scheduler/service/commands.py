"""Node commands with correlated replies: the one place the service waits on a node.

A command goes out on ``dlshare/v1/node/<id>/cmd`` at QoS 1 with an id; the
node's reply on ``.../reply`` carries the same id and resolves the caller's
future.  Ids derive from decision ids, so a command re-sent after a restart
has the id it had before and the node answers it from its reply cache
instead of applying it twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nodesvc import messages


class CommandFailed(RuntimeError):
    """A command that was refused, not delivered, or not answered in time."""


class NodeCommands:
    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[str, asyncio.Future] = {}

    def resolve(self, reply: dict[str, Any]) -> None:
        """A reply arrived (from any node): wake whoever waits on its id; stray ids are ignored."""
        fut = self._pending.pop(str(reply.get("id")), None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    async def call(self, bus: Any, node: str, op: str, args: dict[str, Any], cmd_id: str) -> dict[str, Any]:
        """Publish the command and wait for its reply; the reply's ``result``, or CommandFailed."""
        if bus is None:
            raise CommandFailed("no broker configured")
        fut = asyncio.get_running_loop().create_future()
        self._pending[cmd_id] = fut
        try:
            if not await bus.publish(messages.node_topic(node, "cmd"), messages.command(op, cmd_id, **args), 1):
                raise CommandFailed(f"broker not connected; {op} to {node} not sent")
            try:
                r = await asyncio.wait_for(fut, self.timeout_s)
            except TimeoutError:
                raise CommandFailed(f"{op} to {node}: no reply within {self.timeout_s:g}s") from None
        finally:
            self._pending.pop(cmd_id, None)
        if not r.get("ok"):
            raise CommandFailed(f"{op} on {node} refused: {r.get('error')}")
        return r.get("result") or {}
