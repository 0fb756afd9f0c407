"""``dlshare node``: run the node daemon."""

from __future__ import annotations

import asyncio
import importlib

from nodesvc.bus import config, messages

# Optional parts of the daemon register their config sections on import, and
# the config is loaded before the daemon starts: import them here.
for _mod in ("nodesvc.daemon.donor",):
    try:
        importlib.import_module(_mod)
    except ModuleNotFoundError as _exc:
        if _exc.name is None or not _mod.startswith(_exc.name):
            raise

config.register_section("node", {
    "id": "",  # default: the host name
    "interval": 5.0,  # seconds between telemetry messages
    "metrics_listen": "127.0.0.1:9465",  # Prometheus endpoint; port -1 disables it
    "lend": False,  # lend idle memory to other nodes (remote memory donor)
    "enforce": True,  # apply allocations through cgroups
    "cgroup_root": "/sys/fs/cgroup",
    "cgroup_base": "",  # default: a dlshare group under the daemon's own (delegated) cgroup
    "fake_gpus": 0,  # simulate this many GPUs (marked simulated in telemetry) on GPU-less nodes
    "state_dir": "",  # job logs; default /var/lib/dlshare/<id> (root) or ~/.local/state/dlshare/<id>
    # Start job processes on request (the `run` op). Off by default: whoever may publish to this
    # node's cmd topic could then run programs as the daemon's user. Enable it together with broker ACLs.
    "allow_run": False,
})


def _run(args, cfg) -> int:
    from nodesvc.daemon.node import NodeDaemon

    try:
        daemon = NodeDaemon(cfg)
    except (messages.PayloadError, ValueError) as exc:
        raise config.ConfigError(str(exc)) from None
    asyncio.run(daemon.run())
    return 0


def register(sub) -> None:
    from nodesvc.cli import add_command, config_flag

    p = add_command(sub, "node", _run, "run the node daemon: telemetry, enforcement, memory lending",
                    sections=["node", "donor"])
    config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL, mqtt://HOST:PORT")
    config_flag(p, "--node-id", "node", "id", help="this node's id (default: host name)")
    config_flag(p, "--interval", "node", "interval", type=float, help="telemetry period in seconds")
    config_flag(p, "--metrics-listen", "node", "metrics_listen", help="HOST:PORT for Prometheus metrics")
    config_flag(p, "--lend", "node", "lend", action="store_const", const=True, help="lend idle memory")
    config_flag(p, "--fake-gpus", "node", "fake_gpus", type=int, help="simulate N GPUs (for GPU-less demos)")
    config_flag(p, "--allow-run", "node", "allow_run", action="store_const", const=True,
                help="start job processes on request (the run command); restrict the broker's ACLs")
    config_flag(p, "--no-enforce", "node", "enforce", action="store_const", const=False,
                help="do not apply allocations through cgroups")
