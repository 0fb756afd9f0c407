"""How optional parts plug into the node daemon (the donor of remote memory, for one).

An extension is constructed by the daemon with the effective config, then:

- ``await start(ctx)`` once the daemon runs (``ctx`` is a :class:`NodeContext`);
- ``telemetry()`` each period: a JSON-able dict, published under
  ``telemetry[ext.name]``;
- ``commands()``: ``{op: async handler(args: dict) -> dict}``.  A handler raises
  ``messages.PayloadError`` for bad arguments (the sender gets an error reply);
- ``await stop()`` at shutdown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

CommandHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass
class NodeContext:
    node_id: str
    cfg: dict[str, dict[str, Any]]
    # publish(topic, payload_bytes, qos=0, retain=False) -> bool (False while disconnected)
    publish: Callable[..., Awaitable[bool]]
    # What local jobs were promised (their allocations' memory) and reserved but do not use.
    promised_bytes: Callable[[], int] | None = None
    reserved_unused_bytes: Callable[[], int] | None = None
    # True while the daemon is connected to the broker.
    connected: Callable[[], bool] | None = None


class NodeExtension(Protocol):
    name: str

    async def start(self, ctx: NodeContext) -> None: ...

    def telemetry(self) -> dict[str, Any]: ...

    def commands(self) -> dict[str, CommandHandler]: ...

    async def stop(self) -> None: ...
