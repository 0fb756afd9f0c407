"""The MQTT bus's pump under a flood: every message, in order, and a bad one stops nothing."""

from __future__ import annotations

import asyncio

from nodesvc.bus.mqtt import Bus
from nodesvc.bus.procs import until


async def test_a_flood_of_messages_arrives_whole_and_in_order_and_a_failing_handler_stops_none(broker):
    got: list[int] = []

    async def handler(topic: str, payload: bytes) -> None:
        n = int(payload)
        got.append(n)
        if n == 0:
            await asyncio.sleep(0.5)  # the others pile up meanwhile: the pump then takes many per pass
        if n % 97 == 0:
            raise ValueError(f"bad message {n}")  # logged; the rest of its pass goes on

    stop = asyncio.Event()
    sub = Bus(broker.url, "pump-sub", subscriptions=[("dlshare/v1/node/flood/telemetry", 1)], handler=handler)
    pub = Bus(broker.url, "pump-pub", max_inflight=1000)
    tasks = [asyncio.create_task(sub.run(stop)), asyncio.create_task(pub.run(stop))]
    try:
        await asyncio.wait_for(asyncio.gather(sub.connected.wait(), pub.connected.wait()), 30)
        n = 2000
        for i in range(n):
            assert await pub.publish("dlshare/v1/node/flood/telemetry", str(i).encode(), 1)
        await until(lambda: len(got) >= n, timeout=60, what=f"{n} messages through the pump")
        assert got == list(range(n))  # QoS 1 from one client on one topic: in order, none twice
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
