"""The embedded pure-Python MQTT broker (amqtt) for one machine (``dlshare broker``, ``dlshare up``).

Clusters should run mosquitto (DESIGN.md); dlshare uses only MQTT 3.1.1
features, so either works.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("dlshare.broker")


def broker_config(host: str, port: int, extra: list[tuple[str, int]] = ()) -> dict:
    listeners = {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0}}
    for i, (h, p) in enumerate(extra):
        listeners[f"extra{i}"] = {"type": "tcp", "bind": f"{h}:{p}", "max_connections": 0}
    return {
        "listeners": listeners,
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        "timeout_disconnect_delay": 0,
    }


async def serve(addrs: list[tuple[str, int]], stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    from amqtt.broker import Broker

    (host, port), extra = addrs[0], addrs[1:]
    broker = Broker(broker_config(host, port, extra))
    await broker.start()
    for h, p in addrs:
        log.info("MQTT broker (amqtt) listening on mqtt://%s:%d", h, p)
    if ready:
        ready.set()
    try:
        await stop.wait()
    finally:
        await broker.shutdown()
