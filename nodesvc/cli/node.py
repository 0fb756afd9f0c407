"""``dlshare node``: run the node daemon."""

from __future__ import annotations

import asyncio

from nodesvc.bus import config, jobenv, messages

import nodesvc.daemon.donor  # noqa: F401  (registers the [donor] config section, read before the daemon starts)

config.register_section("node", {
    "id": "",  # default: the host name
    "interval": 5.0,  # seconds between telemetry messages
    "metrics_listen": "127.0.0.1:9465",  # Prometheus endpoint; port -1 disables it
    "lend": False,  # lend idle memory to other nodes (remote memory donor)
    "enforce": True,  # apply allocations through cgroups
    "cgroup_root": "/sys/fs/cgroup",
    "cgroup_base": "",  # default: a dlshare group under the daemon's own (delegated) cgroup
    "fake_gpus": 0,  # simulate this many GPUs (marked simulated in telemetry) on GPU-less nodes
    "state_dir": "",  # default /var/lib/dlshare/<id> (root) or ~/.local/state/dlshare/<id>
    # Start job processes on request (the `run` op). Off by default: whoever may publish to this
    # node's cmd topic could then run programs as any job owner. Enable it together with broker ACLs.
    "allow_run": False,
    # Jobs run as their owner (the run command's user, resolved here). uid 0 only when allowed;
    # other uids from min_job_uid up (system accounts, e.g. the broker's user, are refused).
    "allow_root_jobs": False,
    "min_job_uid": 1000,
    "job_dir": "",  # the jobs' own directories (<job_dir>/<job>, the owner's, 0700); default <state_dir>/jobs
    # The job's environment: the run command's variables that the allow list lets through (an exact
    # name in job_env_allow beats the deny globs), plus these of the daemon's own (globs).
    "job_env_allow": list(jobenv.DEFAULT_ALLOW),
    "job_env_deny": list(jobenv.DEFAULT_DENY),
    "job_env_inherit": ["PATH", "LANG", "LANGUAGE", "LC_*", "TZ"],
    # The broker URL jobs get as DLSHARE_BROKER; default: the daemon's without its user and password.
    "job_broker": "",
})


def _run(args, cfg) -> int:
    from nodesvc.daemon.node import NodeDaemon

    try:
        daemon = NodeDaemon(cfg)
    except (messages.PayloadError, ValueError) as exc:
        raise config.ConfigError(str(exc)) from None
    asyncio.run(daemon.run())
    return 0


def register(cli) -> None:
    p = cli.add("node", _run, "run the node daemon: telemetry, enforcement, memory lending",
                sections=["node", "donor"])
    cli.config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL, mqtt://HOST:PORT")
    cli.config_flag(p, "--node-id", "node", "id", help="this node's id (default: host name)")
    cli.config_flag(p, "--interval", "node", "interval", type=float, help="telemetry period in seconds")
    cli.config_flag(p, "--metrics-listen", "node", "metrics_listen", help="HOST:PORT for Prometheus metrics")
    cli.config_flag(p, "--lend", "node", "lend", action="store_const", const=True, help="lend idle memory")
    cli.config_flag(p, "--fake-gpus", "node", "fake_gpus", type=int, help="simulate N GPUs (for GPU-less demos)")
    cli.config_flag(p, "--allow-run", "node", "allow_run", action="store_const", const=True,
                    help="start job processes on request (the run command); restrict the broker's ACLs")
    cli.config_flag(p, "--no-enforce", "node", "enforce", action="store_const", const=False,
                    help="do not apply allocations through cgroups")
    cli.config_flag(p, "--allow-root-jobs", "node", "allow_root_jobs", action="store_const", const=True,
                    help="let run start jobs as root (uid 0); by default a job whose owner is root is refused")
