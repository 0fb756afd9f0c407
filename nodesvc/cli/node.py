"""``dlshare node``: run the node daemon, or drain a donor.

    dlshare node --broker mqtt://127.0.0.1:1883 --node-id n1 --lend
    dlshare node drain n1 --broker mqtt://127.0.0.1:1883    # returns once n1 lends nothing

Draining sends ``reclaim`` for everything the donor lends, with lending paused (``--pause``, an hour
by default), to ``dlshare/v1/node/<id>/cmd``, then polls ``donor_status`` until no slab is lent: each
consumer moves its data to other donors within the donor's reclaim deadline, or the donor takes the
slabs back at the deadline anyway.  ``--no-wait`` returns once the reclaim has started.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from typing import Any

from nodesvc.bus import commands, config, jobenv, messages

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
    bad = commands.drain_usage_error(args, "node", "donor node")
    if bad is not None:
        return bad
    if args.action == "drain":
        return _drain_cmd(args, cfg)
    from nodesvc.daemon.node import NodeDaemon

    try:
        daemon = NodeDaemon(cfg)
    except (messages.PayloadError, ValueError) as exc:
        raise config.ConfigError(str(exc)) from None
    asyncio.run(daemon.run())
    return 0


def _lent(slabs: list[dict[str, Any]]) -> str:
    """Slabs by consumer: ``a: 2, b: 1``."""
    by = Counter(str(sl.get("consumer")) for sl in slabs)
    return ", ".join(f"{c}: {n}" for c, n in sorted(by.items())) or "none"


async def drain(broker: str, node: str, pause_s: float = 3600.0, wait: bool = True, timeout_s: float = 600.0,
                poll_s: float = 0.5, progress=None, reply_timeout_s: float = 10.0) -> dict[str, Any]:
    """Take back everything donor ``node`` lends and pause its lending for ``pause_s``; with ``wait``,
    return once it lends nothing.  Returns ``{"evicting", "slabs", "waited_s"}``.

    Raises :class:`nodesvc.bus.rpc.CommandError` when the node refuses (it does not lend) or does not
    answer within ``reply_timeout_s``, and :class:`TimeoutError` when slabs are still lent after
    ``timeout_s``."""
    from nodesvc.bus.rpc import NodeClient
    from nodesvc.daemon.donor import MAX_RECLAIM_BYTES

    async with NodeClient(broker, client_id=f"dlshare-node-drain-{time.monotonic_ns()}",
                          timeout_s=reply_timeout_s) as c:
        t0 = time.monotonic()
        res = await c.call(node, "reclaim", timeout=reply_timeout_s, bytes=MAX_RECLAIM_BYTES, pause_s=pause_s)
        st = await c.call(node, "donor_status", timeout=reply_timeout_s)
        while wait and st.get("slabs"):
            if progress:
                progress(st["slabs"], time.monotonic() - t0)
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"donor {node} still lends {len(st['slabs'])} slabs after {timeout_s:g} s "
                                   f"({_lent(st['slabs'])})")
            await asyncio.sleep(poll_s)
            st = await c.call(node, "donor_status", timeout=reply_timeout_s)
        return {"evicting": list(res.get("evicting") or []), "slabs": list(st.get("slabs") or []),
                "waited_s": round(time.monotonic() - t0, 3)}


def _drain_cmd(args, cfg) -> int:
    broker = cfg["dlshare"]["broker"]
    show = commands.print_when_changed()

    def progress(slabs: list[dict[str, Any]], waited: float) -> None:
        show(f"{args.target}: reclaiming: {len(slabs)} slabs still lent ({_lent(slabs)})")

    if args.pause < 0:
        print("dlshare node drain: --pause must be 0 or more seconds", file=sys.stderr)
        return 2
    st = commands.run_drain("node", broker, drain(broker, args.target, args.pause, not args.no_wait,
                                                  args.wait_timeout, progress=progress,
                                                  reply_timeout_s=args.reply_timeout))
    if isinstance(st, int):
        return st
    paused = f"lending paused for {args.pause:g} s" if args.pause > 0 else "lending not paused"
    if args.no_wait:
        print(f"{args.target}: reclaiming {len(st['evicting'])} slabs (not waiting); {paused}")
    else:
        print(f"{args.target}: drained in {st['waited_s']:.1f} s: {len(st['evicting'])} slabs taken back, "
              f"nothing lent; {paused}")
    return 0


def register(cli) -> None:
    p = cli.add("node", _run, "run the node daemon: telemetry, enforcement, memory lending; or drain a donor",
                sections=["node", "donor"])
    cli.add_drain(p, "run", "donor node")
    p.add_argument("--pause", type=float, default=3600.0, metavar="S",
                   help="drain: lend nothing for S seconds after (default 3600; at most a day, send again to "
                   "extend; 0: take back what is lent and go on lending)")
    cli.config_flag(p, "--broker", "dlshare", "broker",
                    help="MQTT broker URL, mqtt://HOST:PORT (mqtts://HOST:PORT?ca=PATH for TLS)")
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
