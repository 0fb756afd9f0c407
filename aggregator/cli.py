"""``dlshare agg``: run one shared aggregation server.

    dlshare agg --listen 127.0.0.1:7700 --broker mqtt://127.0.0.1:1883 --id agg0

Without a console script: ``python -m aggregator.cli [same flags]``.  An empty
broker (``--broker ''``) runs without MQTT telemetry.  Drain it by sending
``{"id":..,"op":"drain"}`` to ``dlshare/v1/agg/<id>/cmd``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from nodesvc import config

config.register_section("agg", {
    "listen": "127.0.0.1:7700",
    "id": "agg0",
    "min_cores": 1,
    "max_cores": 0,  # 0: every CPU of the machine
    "round_timeout_s": 30.0,
    "telemetry_interval_s": 2.0,
    "max_job_bytes": 4 << 30,  # unfinished reductions one job may hold in server memory
})


def resolve(cfg: dict) -> dict:
    """Fill derived values (max_cores 0 -> CPU count) and check the section."""
    a = dict(cfg["agg"])
    if a["max_cores"] <= 0:
        a["max_cores"] = max(a["min_cores"], os.cpu_count() or 1)
    if not 1 <= a["min_cores"] <= a["max_cores"]:
        raise config.ConfigError(f"agg.min_cores ({a['min_cores']}) must be 1..max_cores ({a['max_cores']})")
    if a["max_job_bytes"] <= 0:
        raise config.ConfigError("agg.max_job_bytes must be positive")
    if a["round_timeout_s"] <= 0:
        raise config.ConfigError("agg.round_timeout_s must be positive")
    return {**cfg, "agg": a}


def _run(args, cfg) -> int:
    from aggregator.server import serve

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
