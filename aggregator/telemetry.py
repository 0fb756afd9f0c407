"""An aggregation server's MQTT side: periodic telemetry, a retained load summary, and commands.

``run_telemetry(server, broker, interval, stop)`` publishes ``server.stats()`` to
``dlshare/v1/agg/<id>/telemetry`` every ``interval`` seconds and a retained summary to
``.../state`` (with a Last Will), and answers ``ping``, ``stats`` and ``drain`` on ``.../cmd``.
``server`` is any object with ``server_id``, ``bytes_in``, ``bytes_out``, ``stats()`` and
``drain()`` (aggregator/server.py's ``AggregationServer``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("dlshare.agg")


async def run_telemetry(server: Any, broker: str, interval: float, stop: asyncio.Event) -> None:
    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import Bus

    sid = server.server_id
    state_t = messages.topic("agg", sid, "state")
    last = {"t": time.monotonic(), "in": server.bytes_in, "out": server.bytes_out}

    def state(st: dict[str, Any], rate_in: float = 0.0) -> bytes:
        # The retained state carries a load summary, so `dlshare status` shows load from retained
        # messages alone; telemetry has the full figures.
        pool = st["pool"]
        summary = {"cores": pool["size"], "min_cores": pool["min"], "max_cores": pool["max"],
                   "busy": pool["busy_fraction"], "cores_avg": pool["cores_avg"], "jobs": sorted(st["jobs"]),
                   "bytes_in_per_s": rate_in, "draining": st["draining"],
                   "drained": bool(st["drain"] and st["drain"]["moved"])}
        return messages.encode({"status": "online", "server": sid, "address": st["address"], "ts": time.time(),
                                "summary": summary})

    async def on_connect(bus: Bus) -> None:
        await bus.publish(state_t, state(server.stats()), qos=1, retain=True)

    async def on_message(topic: str, payload: bytes) -> None:
        cid = messages.command_id_of(payload)
        try:
            cmd = messages.parse_command(payload)
            if cmd.op == "ping":
                result: Any = {"pong": True}
            elif cmd.op == "stats":
                result = server.stats()
            elif cmd.op == "drain":
                server.drain()
                result = {"draining": True}
            else:
                raise messages.PayloadError(f"unknown op {cmd.op!r} (known: ping, stats, drain)")
            await bus.publish(messages.topic("agg", sid, "reply"), messages.reply(cmd.id, True, result), qos=1)
        except messages.PayloadError as exc:
            log.warning("bad command on %s: %s", topic, exc)
            await bus.publish(messages.topic("agg", sid, "reply"), messages.reply(cid, False, error=str(exc)), qos=1)

    bus = Bus(broker, f"dlshare-agg-{sid}", subscriptions=[(messages.topic("agg", sid, "cmd"), 1)],
              handler=on_message, on_connect=on_connect,
              will=(state_t, messages.encode({"status": "offline", "server": sid, "address": server.stats()["address"]}), 1, True))
    bus_stop = asyncio.Event()  # outlives ``stop`` long enough to publish the offline state
    runner = asyncio.ensure_future(bus.run(bus_stop))
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
            now = time.monotonic()
            dt = max(1e-9, now - last["t"])
            st = server.stats()
            st["ts"] = time.time()
            st["bytes_in_per_s"] = round((server.bytes_in - last["in"]) / dt, 1)
            st["bytes_out_per_s"] = round((server.bytes_out - last["out"]) / dt, 1)
            last.update(t=now, **{"in": server.bytes_in, "out": server.bytes_out})
            await bus.publish(messages.topic("agg", sid, "telemetry"), messages.encode(st))
            await bus.publish(state_t, state(st, st["bytes_in_per_s"]), qos=1, retain=True)
        await bus.publish(state_t, messages.encode({"status": "offline", "server": sid, "address": server.stats()["address"]}), qos=1, retain=True)
    finally:
        bus_stop.set()
        await runner
