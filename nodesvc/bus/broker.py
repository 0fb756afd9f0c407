"""The embedded pure-Python MQTT broker (amqtt) for one machine (``dlshare broker``, ``dlshare up``).

Clusters should run mosquitto (DESIGN.md); dlshare uses only MQTT 3.1.1
features, so either works.  Given a password file and an ACL file (mosquitto's
formats, :mod:`nodesvc.bus.acl`), the embedded broker refuses anonymous clients
and wrong passwords, and enforces the ACL on every publish, subscription and
delivery, as mosquitto does with ``deploy/mosquitto/dlshare.{conf,acl}``.
Without them it takes anyone (and says so in its log): tests and a trusted
loopback only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dlshare.broker")

try:  # the plugins need amqtt; a process that only builds configs does not
    from amqtt.broker import Broker as _AmqttBroker
    from amqtt.contexts import Action
    from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
except ImportError:  # pragma: no cover - amqtt is a dependency
    BaseAuthPlugin = BaseTopicPlugin = _AmqttBroker = object  # type: ignore[misc,assignment]
    Action = None  # type: ignore[assignment]

from nodesvc.bus import tls
from nodesvc.bus.acl import Acl, parse_acl, parse_passwords, read_text


class PasswordFilePlugin(BaseAuthPlugin):  # type: ignore[misc]
    """Clients log in with a user and password from a mosquitto ``$7$`` password file; anonymous
    clients are refused.  A client whose Last Will names a topic it may not write is refused too
    (the broker would publish it for the client when it dies).  The files are read once, at start."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.users = parse_passwords(read_text(self.config.password_file, "password file"), self.config.password_file)
        self.acl: Acl | None = (parse_acl(read_text(self.config.acl_file, "ACL file"), self.config.acl_file)
                                if self.config.acl_file else None)

    async def authenticate(self, *, session: Any) -> bool:
        user, password = session.username, session.password
        entry = self.users.get(user) if user else None
        if entry is None or password is None or not entry.verify(password):
            log.info("refused MQTT client %s (user %r): %s", session.client_id, user,
                     "no user name" if not user else "wrong user name or password")
            return False
        if session.will_flag and self.acl is not None and session.will_topic and \
                not self.acl.may(user, "write", session.will_topic, session.client_id or ""):
            log.info("refused MQTT client %s (user %s): its Last Will names %s, which it may not write",
                     session.client_id, user, session.will_topic)
            return False
        return True

    @dataclass
    class Config:
        password_file: str = ""
        acl_file: str = ""


class AclFilePlugin(BaseTopicPlugin):  # type: ignore[misc]
    """Topic rights from a mosquitto ACL file: publish needs write, subscribe a read grant that
    covers the whole filter, and each delivery read (checked again per message)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.acl = parse_acl(read_text(self.config.acl_file, "ACL file"), self.config.acl_file)

    async def topic_filtering(self, *, session: Any = None, topic: str | None = None, action: Any = None) -> bool:
        if session is None or not topic:
            return False
        user, cid = session.username, session.client_id or ""
        if action == Action.PUBLISH:
            ok = self.acl.may(user, "write", topic, cid)
        elif action == Action.SUBSCRIBE:
            ok = self.acl.may_subscribe(user, topic, cid)
        else:  # RECEIVE: a delivery
            ok = self.acl.may(user, "read", topic, cid)
        if not ok and action != Action.RECEIVE:
            log.info("denied %s of %s to %s (user %s)", getattr(action, "value", action), topic, cid, user)
        return ok

    @dataclass
    class Config:
        acl_file: str = ""


class MendedAmqttBroker(_AmqttBroker):  # type: ignore[misc,valid-type]
    """amqtt's broker, with two of its faults mended (both held by tests against both brokers).

    **What a client published before it left is not lost.**  amqtt acknowledges a QoS 1 publish
    when it arrives and handles it later, from the session's queue; when the client disconnected
    first, its loop ended and dropped what the queue still held: a publisher that sent 300 retained
    messages and disconnected at once left up to 18 unstored on a loaded machine.  Here the queue
    is handled, in order, before the disconnection (and so before a Last Will).

    **Retained messages go only where they belong.**  amqtt (0.12) replays retained messages to a
    client that connects for every topic filter that *any* session subscribes to, not for the
    client's own, and sends retained messages without asking the topic plugins: a node's user that
    connected while the operator held a subscription to every node's state got the other nodes'
    retained state, which its ACL does not let it read.
    Here a replay goes only to a session that holds the filter, and each retained message passes
    the topic plugins (the ACL's read check, ``Action.RECEIVE``) as a live delivery does.
    ``tests/adversarial/test_mqtt_acl.py`` holds the attack."""

    async def _client_message_loop(self, session: Any, handler: Any) -> None:
        waiters = {"deliver": asyncio.ensure_future(handler.mqtt_deliver_next_message()),
                   "subscribe": asyncio.ensure_future(handler.get_next_pending_subscription()),
                   "unsubscribe": asyncio.ensure_future(handler.get_next_pending_unsubscription()),
                   "disconnect": asyncio.ensure_future(handler.wait_disconnect())}
        try:
            while True:
                done, _ = await asyncio.wait(waiters.values(), return_when=asyncio.FIRST_COMPLETED)
                if waiters["deliver"] in done:
                    if not await self._handle_message_delivery(session, handler, waiters["deliver"]):
                        break  # a publish the protocol forbids: amqtt closes the connection
                    waiters["deliver"] = asyncio.ensure_future(handler.mqtt_deliver_next_message())
                if waiters["subscribe"] in done:
                    await self._handle_subscription(session, handler, waiters["subscribe"])
                    waiters["subscribe"] = asyncio.ensure_future(handler.get_next_pending_subscription())
                if waiters["unsubscribe"] in done:
                    await self._handle_unsubscription(session, handler, waiters["unsubscribe"])
                    waiters["unsubscribe"] = asyncio.ensure_future(handler.get_next_pending_unsubscription())
                if waiters["disconnect"] in done:
                    await self._deliver_queued(session, handler)
                    await self._handle_disconnect(session, handler, waiters["disconnect"])
                    break
        except asyncio.CancelledError:  # the broker shuts down: as amqtt's own loop, end this client
            log.debug("client loop of %s cancelled", session.client_id)
        finally:
            for w in waiters.values():
                w.cancel()
            await asyncio.gather(*waiters.values(), return_exceptions=True)

    async def _deliver_queued(self, session: Any, handler: Any) -> None:
        """The publishes that arrived (and were acknowledged) before the client left, in order."""
        queue = session.delivered_message_queue
        while not queue.empty():
            got = asyncio.get_running_loop().create_future()
            got.set_result(queue.get_nowait())
            if not await self._handle_message_delivery(session, handler, got):
                return

    async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int], session: Any) -> None:
        topic_filter, qos = subscription
        holders = self._subscriptions.get(topic_filter, ())
        if all(s.client_id != session.client_id for s, _ in holders):
            return  # a filter of other sessions
        handler = self._get_handler(session)
        if handler is None:
            return
        sends = []
        for topic, retained in list(self._retained_messages.items()):
            if not self._matches(topic, topic_filter):
                continue
            if not await self._topic_filtering(session, topic=topic, action=Action.RECEIVE):
                log.info("retained %s not sent to %s (user %s): it may not read it", topic, session.client_id,
                         session.username)
                continue
            sends.append(asyncio.ensure_future(
                handler.mqtt_publish(retained.topic, retained.data, min(qos, retained.qos or qos), retain=True)))
        if sends:
            await asyncio.wait(sends)
            for t in sends:  # amqtt waits 5 s for a PUBACK that can come before it listens for it
                if not t.cancelled() and t.exception() is not None:
                    log.debug("retained message to %s: %s", session.client_id, t.exception())


def broker_config(host: str, port: int, extra: list[tuple[str, int]] = (), password_file: str = "",
                  acl_file: str = "", tls_cert_file: str = "", tls_key_file: str = "") -> dict:
    """amqtt's configuration.  ``password_file``: users and passwords (anonymous clients refused);
    ``acl_file``: topic rights (needs ``password_file``); ``tls_cert_file`` and ``tls_key_file``:
    every listener speaks TLS only (clients connect with mqtts://)."""
    if acl_file and not password_file:
        raise ValueError("an ACL file needs a password file: without users, every client is anonymous")
    if bool(tls_cert_file) != bool(tls_key_file):
        raise ValueError("TLS needs both broker.tls_cert_file and broker.tls_key_file")
    tls = {"ssl": True, "certfile": tls_cert_file, "keyfile": tls_key_file} if tls_cert_file else {}
    listeners = {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0, **tls}}
    for i, (h, p) in enumerate(extra):
        listeners[f"extra{i}"] = {"type": "tcp", "bind": f"{h}:{p}", "max_connections": 0, **tls}
    plugins: dict[str, Any]
    if password_file:
        plugins = {f"{__name__}.PasswordFilePlugin": {"password_file": password_file, "acl_file": acl_file}}
        if acl_file:
            plugins[f"{__name__}.AclFilePlugin"] = {"acl_file": acl_file}
    else:
        plugins = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    return {"listeners": listeners, "plugins": plugins, "timeout_disconnect_delay": 0}


def check_tls_files(cert_file: str, key_file: str) -> None:
    """The broker's certificate and key load together (else ValueError naming them)."""
    tls.server_context(cert_file, key_file, what="broker TLS certificate")


async def serve(addrs: list[tuple[str, int]], stop: asyncio.Event, ready: asyncio.Event | None = None,
                password_file: str = "", acl_file: str = "", tls_cert_file: str = "", tls_key_file: str = "") -> None:
    if password_file or acl_file:  # read here, so a bad file is one clear error before anything listens
        parse_passwords(read_text(password_file, "password file"), password_file)
        if acl_file:
            parse_acl(read_text(acl_file, "ACL file"), acl_file)
    (host, port), extra = addrs[0], addrs[1:]
    conf = broker_config(host, port, extra, password_file, acl_file, tls_cert_file, tls_key_file)
    if tls_cert_file:
        check_tls_files(tls_cert_file, tls_key_file)
    broker = MendedAmqttBroker(conf)
    await broker.start()
    for h, p in addrs:
        log.info("MQTT broker (amqtt) listening on %s://%s:%d", "mqtts" if tls_cert_file else "mqtt", h, p)
    if not password_file:
        log.warning("the broker takes anonymous clients: anyone who reaches it may command the nodes "
                    "(give broker.password_file and broker.acl_file; dlshare up does)")
    elif not acl_file:
        log.warning("the broker checks passwords but no ACL: every user may use every topic (give broker.acl_file)")
    if ready:
        ready.set()
    try:
        await stop.wait()
    finally:
        await broker.shutdown()
