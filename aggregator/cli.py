"""``dlshare agg``: run one shared aggregation server.

    dlshare agg --listen 127.0.0.1:7700 --broker mqtt://127.0.0.1:1883 --id agg0

Without a console script: ``python -m aggregator.cli [same flags]``.  An empty
broker (``--broker ''``) runs without MQTT telemetry.  Drain it by sending
``{"id":..,"op":"drain"}`` to ``dlshare/v1/agg/<id>/cmd``.
"""

from __future__ import annotations

import signal
import sys
import threading

from aggregator.server import resolve, serve  # also registers the [agg] config section


def _run(args, cfg) -> int:
    cfg = resolve(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(cfg, stop)
    return 0


def register(sub) -> None:
    from nodesvc.cli import add_command, config_flag

    p = add_command(sub, "agg", _run, "run a shared gradient aggregation server (one elastic CPU pool)",
                    sections=["agg"])
    config_flag(p, "--listen", "agg", "listen", help="HOST:PORT for workers (default 127.0.0.1:7700)")
    config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL for telemetry ('' for none)")
    config_flag(p, "--id", "agg", "id", help="server id in MQTT topics (default agg0)")
    config_flag(p, "--min-cores", "agg", "min_cores", help="smallest pool size")
    config_flag(p, "--max-cores", "agg", "max_cores", help="largest pool size (0: all CPUs)")
    config_flag(p, "--round-timeout-s", "agg", "round_timeout_s", help="fail a round after this many seconds")


if __name__ == "__main__":
    # Only this command, so that a server starts whatever other optional parts are installed.
    from nodesvc import cli

    cli.COMMAND_MODULES = ["aggregator.cli"]
    sys.exit(cli.main(["agg", *sys.argv[1:]]))
