"""The consumer's control plane: donor discovery and map/unmap over MQTT.

A background thread runs an asyncio loop with one :class:`nodesvc.bus.Bus`.
It follows every node's retained ``state`` (Last Will: ``offline``),
``telemetry`` (the ``donor`` section) and ``events`` (evictions addressed to
this consumer), and sends commands to donors, matching replies by id.  The
synchronous :meth:`call` is what RemoteMemory uses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus
from nodesvc.bus.rpc import CommandError, Correlator
from rdma.placement import DonorView

log = logging.getLogger("dlshare.rdma.control")


def donor_view(node: str, donor: Any, online: bool = True) -> DonorView | None:
    """The ``donor`` section of a node's telemetry (or retained state) as a DonorView; None when it is
    absent, disabled or malformed (a bad report never places a slab)."""
    d = messages.parse_donor(donor)
    if d is None or not d.placeable:
        return None
    assert d.addr is not None and d.slab_bytes is not None and d.free_slabs is not None
    return DonorView(node, d.addr, d.slab_bytes, d.free_slabs, online, d.provider)


class ControlPlane:
    def __init__(self, broker: str, consumer_id: str,
                 on_offline: Callable[[str], None] | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 on_online: Callable[[str], None] | None = None) -> None:
        self.broker = broker
        self.consumer_id = messages.check_id(consumer_id, "consumer id")
        self.on_offline = on_offline
        self.on_online = on_online
        self.on_event = on_event
        self._donors: dict[str, DonorView] = {}
        self._online: dict[str, bool] = {}
        self.rpc = Correlator(f"{self.consumer_id}-rdma")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._loop = asyncio.new_event_loop()
        self._ready: Future = Future()
        self._thread = threading.Thread(target=self._run, name=f"rdma-control-{consumer_id}", daemon=True)
        self._thread.start()
        self._ready.result(timeout=30)

    # --- thread and bus ------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        subs = [(f"{messages.PREFIX}/node/+/state", 1), (f"{messages.PREFIX}/node/+/telemetry", 0),
                (f"{messages.PREFIX}/node/+/events", 1), (f"{messages.PREFIX}/node/+/reply", 1)]
        # several consumers may share an id (one per node): the MQTT client id must not
        self.bus = Bus(self.broker, f"dlshare-rdma-{self.consumer_id}-{uuid.uuid4().hex[:8]}", subs,
                       self._on_message)
        task = asyncio.create_task(self.bus.run(self._stop))
        try:
            await asyncio.wait_for(self.bus.connected.wait(), timeout=20)
            self._ready.set_result(True)
        except Exception as exc:  # noqa: BLE001 - handed to the constructor
            self._ready.set_exception(ConnectionError(f"cannot reach broker {self.broker}: {exc!r}"))
            self._stop.set()
        await task

    async def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            kind, node, leaf = messages.parse_topic(topic)
        except messages.PayloadError:
            return
        if kind != "node":
            return
        try:
            body = messages.decode(payload)
        except messages.PayloadError as exc:
            log.debug("ignoring bad payload on %s: %s", topic, exc)
            return
        if leaf == "reply":
            self.rpc.resolve(body)
        elif leaf == "state":
            online = body.get("status") == "online"
            summary = body.get("summary")
            # The retained state carries the donor section too: every donor is known as soon
            # as we subscribe, without waiting for each node's next telemetry.
            from_state = donor_view(node, summary.get("donor"), online) if isinstance(summary, dict) else None
            with self._changed:
                was = self._online.get(node)
                self._online[node] = online
                if from_state is not None and online:
                    self._donors[node] = from_state
                elif node in self._donors:
                    d = self._donors[node]
                    self._donors[node] = DonorView(d.node, d.addr, d.slab_bytes, d.free_slabs, online, d.provider)
                self._changed.notify_all()
            if was and not online and self.on_offline:
                await asyncio.to_thread(self.on_offline, node)
            if online and was is False and self.on_online:
                await asyncio.to_thread(self.on_online, node)
        elif leaf == "telemetry":
            view = donor_view(node, body.get("donor"), self._online.get(node, True))
            if view is None:
                return
            with self._changed:
                self._donors[node] = view
                self._changed.notify_all()
        elif leaf == "events":
            if body.get("consumer") == self.consumer_id and self.on_event:
                await asyncio.to_thread(self.on_event, node, body)

    # --- API (any thread) ----------------------------------------------------------------

    def donors(self) -> dict[str, DonorView]:
        with self._lock:
            return dict(self._donors)

    def wait_donors(self, n: int, timeout: float) -> dict[str, DonorView]:
        """Block until at least ``n`` online donors are known (or the timeout passes)."""
        with self._changed:
            self._changed.wait_for(lambda: sum(d.online for d in self._donors.values()) >= n, timeout=timeout)
            return dict(self._donors)

    def note_mapped(self, node: str, count: int = 1) -> None:
        """Count slabs we just mapped until the donor's next telemetry says so."""
        with self._lock:
            d = self._donors.get(node)
            if d:
                self._donors[node] = DonorView(d.node, d.addr, d.slab_bytes, max(0, d.free_slabs - count), d.online,
                                               d.provider)

    def mark_offline(self, node: str) -> None:
        with self._lock:
            d = self._donors.get(node)
            if d:
                self._donors[node] = DonorView(d.node, d.addr, d.slab_bytes, d.free_slabs, False, d.provider)

    async def _call(self, node: str, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        # A consumer's own ops go on the node's mem topic, the one the broker lets jobs publish on.
        leaf = messages.MEMORY_LEAF if op in messages.MEMORY_OPS else "cmd"
        return await self.rpc.call(self.bus.publish, node, op, args, timeout=timeout, leaf=leaf)

    def call(self, node: str, op: str, args: dict[str, Any], timeout: float = 10.0,
             give_up: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send a command and wait for its result; raises a :class:`~nodesvc.bus.rpc.CommandError`.
        ``give_up``: checked every 50 ms while waiting; once true the call stops waiting and raises
        ConnectionError (a node counted dead meanwhile will not answer)."""
        fut = asyncio.run_coroutine_threadsafe(self._call(node, op, args, timeout), self._loop)
        if give_up is None:
            return fut.result(timeout + 5)
        deadline = time.monotonic() + timeout + 5
        while not fut.done():
            if give_up():
                fut.cancel()
                raise ConnectionError(f"{op} to {node}: gave up waiting (the node is counted dead)")
            if time.monotonic() > deadline:
                fut.cancel()
                raise TimeoutError(f"{op} to {node}: no reply within {timeout:g}s")
            wait([fut], timeout=0.05)
        return fut.result()

    def call_many(self, calls: list[tuple[str, str, dict[str, Any]]], timeout: float = 10.0) -> list[Any]:
        """Send several commands at once; each result is the reply's result or the CommandError it raised."""
        async def one(node, op, args):
            try:
                return await self._call(node, op, args, timeout)
            except CommandError as exc:
                return exc

        async def gather():
            return await asyncio.gather(*(one(*c) for c in calls))

        return asyncio.run_coroutine_threadsafe(gather(), self._loop).result(timeout + 5)

    def call_nowait(self, node: str, op: str, args: dict[str, Any]) -> None:
        """Fire a command without waiting for its reply (best effort, e.g. unmap on free)."""
        payload = messages.command(op, self.rpc.next_id(), **args)
        asyncio.run_coroutine_threadsafe(self.bus.publish(messages.node_topic(node, messages.MEMORY_LEAF), payload, qos=1),
                                         self._loop)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
