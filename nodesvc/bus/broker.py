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
    from amqtt.contexts import Action
    from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
except ImportError:  # pragma: no cover - amqtt is a dependency
    BaseAuthPlugin = BaseTopicPlugin = object  # type: ignore[misc,assignment]
    Action = None  # type: ignore[assignment]

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
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"broker TLS certificate {cert_file!r} with key {key_file!r}: {exc}") from None


async def serve(addrs: list[tuple[str, int]], stop: asyncio.Event, ready: asyncio.Event | None = None,
                password_file: str = "", acl_file: str = "", tls_cert_file: str = "", tls_key_file: str = "") -> None:
    from amqtt.broker import Broker

    if password_file or acl_file:  # read here, so a bad file is one clear error before anything listens
        parse_passwords(read_text(password_file, "password file"), password_file)
        if acl_file:
            parse_acl(read_text(acl_file, "ACL file"), acl_file)
    (host, port), extra = addrs[0], addrs[1:]
    conf = broker_config(host, port, extra, password_file, acl_file, tls_cert_file, tls_key_file)
    if tls_cert_file:
        check_tls_files(tls_cert_file, tls_key_file)
    broker = Broker(conf)
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
