"""``dlshare broker``: the embedded pure-Python MQTT broker (amqtt) for one machine.

Clusters should run mosquitto (DESIGN.md); dlshare uses only MQTT 3.1.1
features, so either works.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from nodesvc import config

log = logging.getLogger("dlshare.broker")

config.register_section("broker", {"listen": "127.0.0.1:1883"})


def split_hostport(text: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``host``, ``:port`` or ``[v6]:port`` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":") or str(default_port)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, str(default_port)
    try:
        p = int(port)
    except ValueError:
        raise config.ConfigError(f"listen address {text!r}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535:
        raise config.ConfigError(f"listen address {text!r}: port {p} out of range")
    return host or "127.0.0.1", p


def broker_config(host: str, port: int, extra: list[tuple[str, int]] = ()) -> dict:
    listeners = {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0}}
    for i, (h, p) in enumerate(extra):
        listeners[f"extra{i}"] = {"type": "tcp", "bind": f"{h}:{p}", "max_connections": 0}
    return {
        "listeners": listeners,
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        "timeout_disconnect_delay": 0,
    }


async def serve(addrs: list[tuple[str, int]], stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    from amqtt.broker import Broker

    (host, port), extra = addrs[0], addrs[1:]
    broker = Broker(broker_config(host, port, extra))
    await broker.start()
    for h, p in addrs:
        log.info("MQTT broker (amqtt) listening on mqtt://%s:%d", h, p)
    if ready:
        ready.set()
    try:
        await stop.wait()
    finally:
        await broker.shutdown()


def _run(args, cfg) -> int:
    addrs = [split_hostport(a, 1883) for a in cfg["broker"]["listen"].split(",") if a.strip()]
    if not addrs:
        raise config.ConfigError("broker.listen names no address")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(addrs, stop)

    asyncio.run(main())
    return 0


def register(sub) -> None:
    from nodesvc.cli import add_command, config_flag

    p = add_command(sub, "broker", _run, "run the embedded MQTT broker (amqtt) for single-machine use",
                    sections=["broker"])
    config_flag(p, "--listen", "broker", "listen", help="HOST:PORT to listen on (default 127.0.0.1:1883); several, comma-separated")
