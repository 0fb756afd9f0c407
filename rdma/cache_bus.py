"""A sample cache's own MQTT connection: a named cache's manifest and its readers' reports.

Topics: ``dlshare/v1/cache/<name>/manifest`` (retained, sealed; an empty retained payload, also the
owner's Last Will, withdraws it) and ``dlshare/v1/cache/<name>/readers`` (sealed reports of attached
jobs' counters).  The bus runs in a thread of its own, like the remote-memory control plane.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future

from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus


def cache_topic(name: str, leaf: str) -> str:
    return messages.topic("cache", name, leaf)


class CacheBus:
    """One MQTT connection in a thread; ``on_message(topic, payload)`` runs in a worker thread."""

    def __init__(self, broker: str, client_id: str, subs: list[str],
                 on_message: Callable[[str, bytes], None] | None,
                 will: tuple[str, bytes, int, bool] | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready: Future = Future()
        self._on_message = on_message

        async def handler(topic: str, payload: bytes) -> None:
            if self._on_message is not None:
                await asyncio.to_thread(self._on_message, topic, payload)

        async def main() -> None:
            self._stop = asyncio.Event()
            self.bus = Bus(broker, client_id, [(s, 1) for s in subs], handler, will=will)
            task = asyncio.create_task(self.bus.run(self._stop))
            try:
                await asyncio.wait_for(self.bus.connected.wait(), timeout=20)
                self._ready.set_result(True)
            except Exception as exc:  # noqa: BLE001 - handed to the constructor
                self._ready.set_exception(ConnectionError(f"cannot reach broker {broker}: {exc!r}"))
                self._stop.set()
            await task

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="rdma-cache-bus", daemon=True)
        self._thread.start()
        self._ready.result(timeout=30)

    def publish(self, topic: str, payload: bytes, retain: bool = False, wait: bool = True) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.bus.publish(topic, payload, qos=1, retain=retain), self._loop)
        if wait:
            fut.result(10)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)


__all__ = ["CacheBus", "cache_topic"]
