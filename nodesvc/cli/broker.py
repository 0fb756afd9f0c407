"""``dlshare broker``: run the embedded pure-Python MQTT broker (amqtt) for one machine."""

from __future__ import annotations

import asyncio
import signal

from nodesvc.bus import config
from nodesvc.bus.acl import AclError
from nodesvc.bus.procs import split_hostport

config.register_section("broker", {
    "listen": "127.0.0.1:1883",
    # mosquitto's formats: a mosquitto_passwd ($7$) file of users (anonymous clients are then
    # refused) and an ACL file (deploy/mosquitto/dlshare.acl). Empty: anyone may connect.
    "password_file": "",
    "acl_file": "",
    # TLS on every listener (clients then use mqtts://): the broker's certificate (PEM, its chain
    # after it) and its key.  Empty: plain MQTT.
    "tls_cert_file": "",
    "tls_key_file": "",
})


def _run(args, cfg) -> int:
    addrs = [split_hostport(a, 1883) for a in cfg["broker"]["listen"].split(",") if a.strip()]
    if not addrs:
        raise config.ConfigError("broker.listen names no address")

    from nodesvc.bus.broker import serve  # amqtt: loaded by this command only

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        b = cfg["broker"]
        await serve(addrs, stop, password_file=b["password_file"], acl_file=b["acl_file"],
                    tls_cert_file=b["tls_cert_file"], tls_key_file=b["tls_key_file"])

    try:
        asyncio.run(main())
    except (AclError, ValueError) as exc:
        raise config.ConfigError(str(exc)) from None
    return 0


def register(cli) -> None:
    p = cli.add("broker", _run, "run the embedded MQTT broker (amqtt) for single-machine use",
                sections=["broker"])
    cli.config_flag(p, "--listen", "broker", "listen", help="HOST:PORT to listen on (default 127.0.0.1:1883); several, comma-separated")
    cli.config_flag(p, "--password-file", "broker", "password_file",
                    help="mosquitto_passwd file of users; anonymous clients are then refused")
    cli.config_flag(p, "--acl-file", "broker", "acl_file", help="mosquitto ACL file of topic rights")
    cli.config_flag(p, "--tls-cert-file", "broker", "tls_cert_file",
                    help="PEM certificate (and chain) of the broker: every listener speaks TLS (mqtts://)")
    cli.config_flag(p, "--tls-key-file", "broker", "tls_key_file", help="PEM private key of --tls-cert-file")
