"""Telemetry from ``dlshare node`` running beside slurmd, fed to the core as node reports.

Optional (``[slurm] telemetry = true``): a thread subscribes to ``dlshare/v1/node/+/telemetry`` on the
configured broker and keeps each node's latest figures; the shell turns them into ``NodeReport``
events (GPU utilisation, CPU percent, available memory) at most every ``telemetry_s`` per node, so
the journal grows slowly.  A node daemon's id must be the Slurm node's name (both default to the
host name).  Per-job samples are not fed: the node daemon keys them by its own job ids, which Slurm's
jobs do not have.

:func:`report_fields` is pure; :class:`TelemetryFeed` owns the thread and the MQTT connection
(``nodesvc.bus``, floor 0).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from nodesvc.bus.messages import NodeTelemetry, PayloadError, parse_telemetry, parse_topic

log = logging.getLogger("dlshare.slurm.telemetry")


def report_fields(t: NodeTelemetry) -> dict[str, Any]:
    """The NodeReport keyword fields of a node's typed telemetry."""
    return {"gpu_util": tuple(g.util_percent for g in t.gpus if g.util_percent is not None),
            "cpu_percent": t.cpu_percent, "memory_available_bytes": t.memory_available_bytes}


class TelemetryFeed:
    """The latest telemetry of each node, received on a background thread."""

    def __init__(self, broker_url: str, client_id: str = "dlshare-slurm") -> None:
        self.broker_url = broker_url
        self.client_id = client_id
        self._latest: dict[str, tuple[dict[str, Any], float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.received = 0
        self.rejected = 0

    async def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            kind, node, leaf = parse_topic(topic)
            if kind != "node" or leaf != "telemetry":
                return
            t = parse_telemetry(payload)
            if t.node != node:
                raise PayloadError(f"telemetry of {t.node!r} on the topic of {node!r}")
            fields = report_fields(t)
        except (PayloadError, ValueError, KeyError, TypeError) as exc:
            self.rejected += 1
            log.warning("slurm: ignoring telemetry on %s: %s", topic, exc)
            return
        with self._lock:
            self._latest[node] = (fields, time.time())
            self.received += 1

    def start(self) -> None:
        from nodesvc.bus.messages import topic
        from nodesvc.bus.mqtt import Bus

        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._stop = asyncio.Event()
            bus = Bus(self.broker_url, self.client_id, subscriptions=[(topic("node", "+", "telemetry"), 0)],
                      handler=self._on_message)
            ready.set()
            try:
                loop.run_until_complete(bus.run(self._stop))
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name="slurm-telemetry", daemon=True)
        self._thread.start()
        ready.wait(10)

    def take(self, since: dict[str, float]) -> dict[str, tuple[dict[str, Any], float]]:
        """Telemetry received after ``since[node]`` (all of it for nodes not in ``since``)."""
        with self._lock:
            return {n: v for n, v in self._latest.items() if v[1] > since.get(n, float("-inf"))}

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
