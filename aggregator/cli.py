"""``dlshare agg``: run one shared aggregation server, or drain one.

    dlshare agg --listen 127.0.0.1:7700 --broker mqtt://127.0.0.1:1883 --id agg0
    dlshare agg drain agg0 --broker mqtt://127.0.0.1:1883   # returns once its jobs have moved

Without a console script: ``python -m aggregator.cli [same arguments]``.  An
empty broker (``--broker ''``) runs a server without MQTT telemetry.  Draining
sends ``drain`` to ``dlshare/v1/agg/<id>/cmd``, then polls ``stats`` until
nothing is in flight on the server and every rank of every job it served has
said it has nothing left there (or has left); ``--no-wait`` returns at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from typing import Any

from aggregator.settings import resolve  # also registers the [agg] config section


def _run(args, cfg) -> int:
    from nodesvc.bus.commands import drain_usage_error

    bad = drain_usage_error(args, "agg", "aggregation server")
    if bad is not None:
        return bad
    if args.action == "drain":
        return _drain_cmd(args, cfg)
    from aggregator.server import serve
    from nodesvc.bus.commands import check_broker

    if cfg["dlshare"]["broker"]:
        check_broker(cfg["dlshare"]["broker"])
    cfg = resolve(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(cfg, stop)
    return 0


async def drain(broker: str, server: str, wait: bool = True, timeout_s: float = 600.0, poll_s: float = 0.5,
                progress=None, reply_timeout_s: float = 10.0) -> dict[str, Any]:
    """Drain aggregation server ``server`` and (``wait``) return its stats once the move finished.

    Raises :class:`nodesvc.bus.rpc.CommandError` when the server refuses or does not answer within
    ``reply_timeout_s``, and :class:`TimeoutError` when the move does not finish within ``timeout_s``.
    """
    import aiomqtt

    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import parse_broker_url
    from nodesvc.bus.rpc import Correlator

    addr = parse_broker_url(broker)
    rpc = Correlator("dlshare-agg-drain", timeout_s=reply_timeout_s)
    async with aiomqtt.Client(**addr.client_args(), identifier=rpc.prefix + f"-{time.monotonic_ns()}",
                              timeout=5) as client:
        await client.subscribe(messages.topic("agg", server, "reply"), qos=1)

        async def pump() -> None:
            async for msg in client.messages:
                try:
                    rpc.resolve(messages.decode(msg.payload))
                except messages.PayloadError:
                    continue

        async def publish(topic: str, payload: bytes, qos: int) -> bool:
            try:
                await client.publish(topic, payload, qos=qos)
            except aiomqtt.MqttError:
                return False
            return True

        task = asyncio.create_task(pump())
        try:
            t0 = time.monotonic()
            await rpc.call(publish, server, "drain", kind="agg")
            st = await rpc.call(publish, server, "stats", kind="agg")
            while wait:
                d = st.get("drain") or {}
                if d.get("moved"):
                    break
                if progress:
                    progress(d, time.monotonic() - t0)
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"server {server} still holds work after {timeout_s:g} s: "
                                       f"{d.get('pending_units')} reductions in flight, ranks left "
                                       f"{d.get('ranks_left')}")
                await asyncio.sleep(poll_s)
                st = await rpc.call(publish, server, "stats", kind="agg")
            st["waited_s"] = round(time.monotonic() - t0, 3)
            return st
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _drain_cmd(args, cfg) -> int:
    from nodesvc.bus.commands import print_when_changed, run_drain

    broker = cfg["dlshare"]["broker"]
    show = print_when_changed()

    def progress(d: dict, waited: float) -> None:
        show(f"{args.target}: draining: {d.get('pending_units', '?')} reductions in flight, "
             f"ranks still sending here: {d.get('ranks_left') or '{}'}")

    st = run_drain("agg", broker, drain(broker, args.target, not args.no_wait, args.wait_timeout,
                                        progress=progress, reply_timeout_s=args.reply_timeout))
    if isinstance(st, int):
        return st
    jobs = sorted(st.get("jobs") or {})
    if args.no_wait:
        print(f"{args.target}: draining (not waiting); jobs: {', '.join(jobs) or 'none'}")
    else:
        print(f"{args.target}: drained in {st['waited_s']:.1f} s: its jobs' rounds now go to their other "
              f"servers (jobs still connected: {', '.join(jobs) or 'none'})")
    return 0


def register(cli) -> None:
    p = cli.add("agg", _run, "run a shared gradient aggregation server (one elastic CPU pool), "
                "or drain one", sections=["agg"])
    cli.add_drain(p, "serve", "aggregation server")
    cli.config_flag(p, "--listen", "agg", "listen", help="HOST:PORT for workers (default 127.0.0.1:7700)")
    cli.config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL ('' for none when serving)")
    cli.config_flag(p, "--id", "agg", "id", help="server id in MQTT topics (default agg0)")
    cli.config_flag(p, "--min-cores", "agg", "min_cores", help="smallest pool size")
    cli.config_flag(p, "--max-cores", "agg", "max_cores", help="largest pool size (0: all CPUs)")
    cli.config_flag(p, "--round-timeout-s", "agg", "round_timeout_s", help="fail a round after this many seconds")
    cli.config_flag(p, "--trace-file", "agg", "trace_file",
                    help="record every chunk's stage times and write them to this JSON file at exit")
    cli.config_flag(p, "--metrics-listen", "agg", "metrics_listen",
                    help="HOST:PORT for Prometheus metrics (default 127.0.0.1:9466; port -1: none)")


if __name__ == "__main__":
    # Only this command, so that a server starts whatever other optional parts are installed.
    from nodesvc.bus import commands

    sys.exit(commands.main([register], ["agg", *sys.argv[1:]]))
