"""The MQTT shell shared by every daemon: connect, Last Will, reconnect with backoff.

aiomqtt (>= 2.5) does the protocol.  :class:`Bus` keeps one connection alive:
when the broker goes away it retries with exponential backoff (capped) and,
once connected again, re-runs ``on_connect`` (re-publish retained state,
re-subscribe) so the daemon resumes where it was.
"""

from __future__ import annotations

import asyncio
import logging
import random
import select
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiomqtt

log = logging.getLogger("dlshare.bus")


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    username: str | None = None
    password: str | None = None

    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """``mqtt://[user:pass@]host[:port]`` (also ``tcp://`` or bare ``host:port``)."""
    if "://" not in url:
        url = "mqtt://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("mqtt", "tcp"):
        raise ValueError(f"broker URL {url!r}: scheme must be mqtt:// (TLS is not supported yet)")
    if not u.hostname:
        raise ValueError(f"broker URL {url!r} has no host")
    try:
        port = u.port or 1883
    except ValueError:
        raise ValueError(f"broker URL {url!r} has an invalid port") from None
    return BrokerAddress(u.hostname, port, u.username, u.password)


MessageHandler = Callable[[str, bytes], Awaitable[None]]


def _no_delay(client: aiomqtt.Client) -> None:
    """Turn Nagle off: paho leaves it on, and a small command then waits ~40-90 ms for a delayed ACK."""
    try:
        client._client.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (AttributeError, OSError):
        pass  # a paho without socket(); latency, not correctness


READ_BURST = 256  # packets read per wakeup of the loop, at most
PUMP_BATCH = 1024  # messages handled per pass of the pump, at most


def _drain_reads(client: aiomqtt.Client, most: int = READ_BURST) -> None:
    """Read every packet waiting on the socket per wakeup of the loop, up to ``most``.

    aiomqtt's reader calls paho's ``loop_read`` once per wakeup, and that reads ONE packet when
    no QoS exchange is in flight: a busy loop (or one that waits for the GIL behind another
    thread) then takes in one message per iteration, and replies and telemetry queue in the
    kernel's socket buffer for seconds.  The same callback, with a drain: read while the socket
    stays readable.  A paho or aiomqtt without these internals keeps the one-packet reader."""
    try:
        paho = client._client
        fd = paho.socket().fileno()
        disconnected = client._disconnected
    except (AttributeError, OSError):
        return
    if fd < 0:
        return

    def drain() -> None:
        try:
            for _ in range(most):
                if paho.loop_read() != 0 or paho.socket() is None:
                    return
                ready, _, _ = select.select([fd], [], [], 0)
                if not ready:
                    return
        except Exception as exc:  # noqa: BLE001 - as aiomqtt's own reader: the connection broke
            if not disconnected.done():
                disconnected.set_exception(exc)

    asyncio.get_running_loop().add_reader(fd, drain)


class Bus:
    """One resilient MQTT connection.

    ``subscriptions``: (topic filter, qos) pairs subscribed at every connect.
    ``on_connect(bus)``: awaited after every (re)connect, before messages flow.
    ``handler(topic, payload)``: awaited for each message; an exception in it is
    logged and never ends the loop.  ``max_inflight``: QoS 1 messages sent and not yet
    acknowledged by the broker (paho's default, 20, when None); past it, publishes wait.
    """

    def __init__(
        self,
        url: str,
        client_id: str,
        subscriptions: list[tuple[str, int]] | None = None,
        handler: MessageHandler | None = None,
        on_connect: Callable[["Bus"], Awaitable[None]] | None = None,
        will: tuple[str, bytes, int, bool] | None = None,
        keepalive: int = 10,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        max_inflight: int | None = None,
    ) -> None:
        self.addr = parse_broker_url(url)
        self.client_id = client_id
        self.subscriptions = subscriptions or []
        self.handler = handler
        self.on_connect = on_connect
        self.will = will
        self.keepalive = keepalive
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_inflight = max_inflight  # QoS 1 messages out awaiting their PUBACK (paho's default: 20)
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self.connects = 0

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> bool:
        """Publish if connected; returns False (and drops the message) while disconnected."""
        client = self.client
        if client is None or not self.connected.is_set():
            return False
        try:
            await client.publish(topic, payload, qos=qos, retain=retain)
            return True
        except aiomqtt.MqttError as exc:
            log.warning("publish to %s failed: %s", topic, exc)
            return False

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Connect and process messages until ``stop`` is set (or cancelled)."""
        stop = stop or asyncio.Event()
        delay = self.backoff_initial
        while not stop.is_set():
            will = None
            if self.will:
                t, p, q, r = self.will
                will = aiomqtt.Will(topic=t, payload=p, qos=q, retain=r)
            try:
                async with aiomqtt.Client(
                    self.addr.host,
                    self.addr.port,
                    identifier=self.client_id,
                    username=self.addr.username,
                    password=self.addr.password,
                    will=will,
                    keepalive=self.keepalive,
                    timeout=5,
                    max_inflight_messages=self.max_inflight,
                ) as client:
                    self.client = client
                    _no_delay(client)
                    _drain_reads(client)
                    for filt, qos in self.subscriptions:
                        await client.subscribe(filt, qos=qos)
                    self.connected.set()
                    self.connects += 1
                    delay = self.backoff_initial
                    log.info("connected to broker %s as %s", self.addr.url(), self.client_id)
                    if self.on_connect:
                        await self.on_connect(self)
                    await self._pump(client, stop)
            except aiomqtt.MqttError as exc:
                if stop.is_set():
                    break
                log.warning("broker %s unreachable (%s); retrying in %.1fs", self.addr.url(), exc, delay)
            except Exception:  # a fault in on_connect or a subscription: reconnect, never give up
                if stop.is_set():
                    break
                log.exception("MQTT session failed; reconnecting in %.1fs", delay)
            finally:
                self.connected.clear()
                self.client = None
            if stop.is_set():
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay * (0.8 + 0.4 * random.random()))
            except TimeoutError:
                pass
            delay = min(delay * 2, self.backoff_max)

    async def _pump(self, client: aiomqtt.Client, stop: asyncio.Event) -> None:
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            messages = client.messages.__aiter__()
            while True:
                nxt = asyncio.ensure_future(messages.__anext__())
                done, _ = await asyncio.wait({nxt, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if stop_wait in done:
                    if not nxt.done():
                        nxt.cancel()
                    elif not nxt.cancelled():
                        nxt.exception()  # seen: a disconnect as we stop is no error to log
                    return
                # The messages already queued are taken in the same pass: a waiting task per message
                # costs several turns of the loop, and a loop that shares the GIL with another thread
                # (the scheduler's API) then takes in a few dozen messages a second.
                batch = [nxt.result()]
                queued = getattr(client, "_queue", None)
                while queued is not None and len(batch) < PUMP_BATCH:
                    try:
                        batch.append(queued.get_nowait())
                    except (asyncio.QueueEmpty, AttributeError):
                        break
                if self.handler is None:
                    continue
                for msg in batch:
                    try:
                        payload = (msg.payload if isinstance(msg.payload, (bytes, bytearray))
                                   else str(msg.payload).encode())
                        await self.handler(str(msg.topic), bytes(payload))
                    except Exception:  # a bad message must never end the daemon
                        log.exception("handler failed on a message on %s", msg.topic)
        finally:
            stop_wait.cancel()
