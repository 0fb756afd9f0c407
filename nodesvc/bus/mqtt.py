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
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiomqtt

from nodesvc.bus import tls

log = logging.getLogger("dlshare.bus")


PLAIN_SCHEMES = ("mqtt", "tcp")
TLS_SCHEMES = ("mqtts", "ssl")
# Query parameters of an mqtts:// URL: the CA bundle that signs the broker's certificate (else the
# system's trust store), and a client certificate and key for brokers that ask for one.
TLS_PARAMS = {"ca": "ca_file", "cert": "cert_file", "key": "key_file"}


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def url(self) -> str:
        """The URL without user name and password (for logs, and for jobs); TLS settings kept."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = urllib.parse.urlencode({k: getattr(self, f) for k, f in TLS_PARAMS.items() if getattr(self, f)},
                                       safe="/")
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}" + (f"?{query}" if query else "")

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context of an mqtts:// address (None for mqtt://): the broker's certificate is
        checked against ``ca`` (or the system's trust store) and its name against the host.  A file
        that cannot be read or is not PEM raises ValueError, naming it."""
        if not self.tls:
            return None
        return tls.client_context(self.ca_file, self.cert_file, self.key_file, what="broker")

    def client_args(self, tls_context: ssl.SSLContext | None = None) -> dict[str, Any]:
        """Keyword arguments for ``aiomqtt.Client``: where, who, and TLS (``tls_context`` when given,
        else built here)."""
        return {"hostname": self.host, "port": self.port, "username": self.username, "password": self.password,
                "tls_context": tls_context or self.tls_context()}


def _shown(url: str) -> str:
    """The URL for an error message: its password, if any, replaced by ***."""
    scheme, sep, rest = url.partition("://")
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0] + [len(rest)])
    userinfo, at, host = rest[:end].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}{rest[end:]}"


def parse_broker_url(url: str) -> BrokerAddress:
    """``mqtt://[user:pass@]host[:port]`` (also ``tcp://`` or bare ``host:port``), or over TLS
    ``mqtts://[user:pass@]host[:port][?ca=PATH][&cert=PATH&key=PATH]`` (also ``ssl://``; port 8883 by
    default)."""
    if "://" not in url:
        url = "mqtt://" + url
    shown = _shown(url)
    u = urllib.parse.urlsplit(url)
    scheme = u.scheme.lower()
    if scheme not in PLAIN_SCHEMES + TLS_SCHEMES:
        raise ValueError(f"broker URL {shown!r}: scheme must be mqtt:// or mqtts://")
    if not u.hostname:
        raise ValueError(f"broker URL {shown!r} has no host")
    try:
        port = u.port or (8883 if scheme in TLS_SCHEMES else 1883)
    except ValueError:
        raise ValueError(f"broker URL {shown!r} has an invalid port") from None
    if u.path not in ("", "/") or u.fragment:
        raise ValueError(f"broker URL {shown!r}: nothing may follow host:port but ?ca=, cert= and key=")
    try:
        query = urllib.parse.parse_qs(u.query, keep_blank_values=True, strict_parsing=bool(u.query))
    except ValueError:
        raise ValueError(f"broker URL {shown!r}: malformed query") from None
    files: dict[str, str] = {}
    for key, values in query.items():
        if key not in TLS_PARAMS:
            raise ValueError(f"broker URL {shown!r}: unknown parameter {key!r} (known: {', '.join(TLS_PARAMS)})")
        if scheme not in TLS_SCHEMES:
            raise ValueError(f"broker URL {shown!r}: {key}= needs mqtts://")
        if len(values) != 1 or not values[0]:
            raise ValueError(f"broker URL {shown!r}: {key}= needs exactly one path")
        files[TLS_PARAMS[key]] = values[0]
    if "key_file" in files and "cert_file" not in files:
        raise ValueError(f"broker URL {shown!r}: key= needs cert=")
    return BrokerAddress(u.hostname, port, u.username, u.password, tls=scheme in TLS_SCHEMES, **files)


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
                if paho.loop_read() != 0 or (sock := paho.socket()) is None:
                    return
                if getattr(sock, "pending", None) and sock.pending() > 0:
                    continue  # TLS: bytes already decrypted and read off the socket, which is not readable
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
        self.tls = self.addr.tls_context()  # built once: a bad CA or certificate file fails here, not per retry
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
                    **self.addr.client_args(self.tls),
                    identifier=self.client_id,
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
