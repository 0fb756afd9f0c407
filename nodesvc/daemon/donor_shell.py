"""A minimal node shell that runs only the donor extension: for tests and development.

``python -m nodesvc.daemon.donor_shell --broker URL --node-id ID [--slab-bytes N] ...`` speaks
the node daemon's MQTT contract (retained state with a Last Will, telemetry
with a ``donor`` section, commands on ``.../cmd`` answered on ``.../reply``)
for the donor's commands.  The full daemon (``dlshare node`` with
``lend = true``) loads the same extension.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from typing import Any

import psutil

from nodesvc.bus import config, messages
from nodesvc.bus.mqtt import Bus
from nodesvc.daemon.donor import DonorExtension, read_pressure
from nodesvc.extension import NodeContext

log = logging.getLogger("dlshare.donor.shell")


def _telemetry(node: str, ext: DonorExtension) -> dict[str, Any]:
    avail, psi = read_pressure()
    return {
        "node": node, "ts": time.time(),
        "cpu": {"count": psutil.cpu_count(), "percent": psutil.cpu_percent(None)},
        "memory": {"total_bytes": psutil.virtual_memory().total, "available_bytes": avail,
                   "psi": {"some_avg10": psi}},
        "gpus": {"devices": [], "reason": "donor-only shell"},
        "rdma": {"devices": [], "reason": "donor-only shell"},
        "donor": ext.telemetry(),
    }


async def run(node: str, broker: str, cfg: dict[str, dict[str, Any]], interval: float,
              stop: asyncio.Event) -> None:
    ext = DonorExtension(cfg)
    handlers = ext.commands()
    state_t = messages.node_topic(node, "state")
    offline = messages.encode({"status": "offline", "node": node})
    bus: Bus

    async def on_message(topic: str, payload: bytes) -> None:
        cid = messages.command_id_of(payload)
        try:
            cmd = messages.parse_command(payload)
            handler = handlers.get(cmd.op)
            if topic.endswith("/" + messages.MEMORY_LEAF) and cmd.op not in messages.MEMORY_OPS:
                raise messages.PayloadError(f"op {cmd.op!r} is not a memory consumer's: send it on the cmd topic")
            if cmd.op == "ping":
                result: dict[str, Any] = {"pong": True}
            elif handler is None:
                raise messages.PayloadError(f"unknown op {cmd.op!r} (known: ping, {', '.join(sorted(handlers))})")
            else:
                result = await handler(cmd.args)
            body = messages.reply(cmd.id, True, result)
        except messages.PayloadError as exc:
            body = messages.reply(cid, False, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a command must never end the node
            log.exception("command failed")
            body = messages.reply(cid, False, error=f"internal error: {exc}")
        await bus.publish(messages.node_topic(node, "reply"), body, qos=1)

    async def on_connect(b: Bus) -> None:
        await b.publish(state_t, messages.encode({"status": "online", "node": node, "pid": os.getpid(),
                                                  "lend": True}), qos=1, retain=True)

    bus = Bus(broker, f"dlshare-node-{node}", [(messages.node_topic(node, "cmd"), 1),
                                               (messages.node_topic(node, messages.MEMORY_LEAF), 1)], on_message,
              on_connect, will=(state_t, offline, 1, True))
    ctx = NodeContext(node_id=node, cfg=cfg, publish=bus.publish)
    await ext.start(ctx)

    async def telemetry_loop() -> None:
        while True:
            await bus.publish(messages.node_topic(node, "telemetry"), messages.encode(_telemetry(node, ext)))
            await asyncio.sleep(interval)

    tel = asyncio.create_task(telemetry_loop())
    try:
        await bus.run(stop)
    finally:
        tel.cancel()
        await ext.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nodesvc.daemon.donor_shell", description=__doc__.splitlines()[0])
    ap.add_argument("--broker", default=None)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--interval", type=float, default=1.0, help="telemetry period, seconds")
    for key in ("slab_bytes", "headroom_bytes", "max_slabs", "port", "threads"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    ap.add_argument("--listen", default=None)
    ap.add_argument("--reclaim-deadline-s", type=float, default=None)
    ap.add_argument("--psi-threshold", type=float, default=None)
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    flags = {"donor": {k: getattr(a, k) for k in ("slab_bytes", "headroom_bytes", "max_slabs", "port", "threads",
                                                  "listen", "reclaim_deadline_s", "psi_threshold")},
             "dlshare": {"broker": a.broker}}
    cfg = config.load(flags=flags)
    messages.check_id(a.node_id, "node id")

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(a.node_id, cfg["dlshare"]["broker"], cfg, a.interval, stop)

    asyncio.run(_main())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
