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


class Bus:
    """One resilient MQTT connection.

    ``subscriptions``: (topic filter, qos) pairs subscribed at every connect.
    ``on_connect(bus)``: awaited after every (re)connect, before messages flow.
    ``handler(topic, payload)``: awaited for each message; an exception in it is
    logged and never ends the loop.
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
                ) as client:
                    self.client = client
                    _no_delay(client)
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
                msg = nxt.result()
                if self.handler is None:
                    continue
                try:
                    payload = msg.payload if isinstance(msg.payload, (bytes, bytearray)) else str(msg.payload).encode()
                    await self.handler(str(msg.topic), bytes(payload))
                except Exception:  # a bad message must never end the daemon
                    log.exception("handler failed on a message on %s", msg.topic)
        finally:
            stop_wait.cancel()
