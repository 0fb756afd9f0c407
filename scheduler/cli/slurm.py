"""``dlshare slurm``: dlshare schedules the GPU jobs of one Slurm partition (README, "Slurm")."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from nodesvc.bus import config

log = logging.getLogger("dlshare.slurm")


def _default_journal(partition: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "dlshare", f"slurm-{partition}.journal")


config.register_section("slurm", {
    "partition": "dlshare",  # the partition dlshare schedules (its jobs wait held: job_submit.lua or --hold)
    "profile": "dlshare",  # scheduling profile (scheduler/profiles/NAME.toml or a path)
    "predictors": "data",  # data: trained on the shared data at start; default: uninformed (both learn online)
    "journal": "",  # empty: $XDG_STATE_HOME/dlshare/slurm-<partition>.journal
    "slurm_conf": "",  # SLURM_CONF for squeue/sinfo/scontrol; empty: Slurm's default
    "poll_s": 1.0,  # how often the queue is read
    "retry_s": 10.0,  # an scontrol action Slurm refused is tried again after this long
    "status_s": 10.0,  # how often the reasons of waiting jobs are refreshed in their comments
    "respect_requests": False,  # hand each job's own CPU/memory request to the core as its minimum
    "gpu_slots": 2,  # gres.conf lists each GPU of the partition's nodes this many times (co-location slots)
    "telemetry": False,  # feed telemetry of `dlshare node` beside slurmd (dlshare.broker) to the core
    "telemetry_s": 30.0,  # at most one node report per node this often
    "start_timeout_s": 120.0,  # a released job Slurm has not started by then is placed again
})


def _predictors(kind: str, journal: str):
    """The predictor bundle; the trained one is kept beside the journal (scheduler.slurm.cache)."""
    from pathlib import Path

    from scheduler import Predictors, data
    from scheduler.slurm.cache import cached, data_key

    if kind == "default":
        return Predictors.default()
    if kind != "data":
        raise config.ConfigError(f"slurm.predictors must be 'data' or 'default', not {kind!r}")
    try:
        files = [data.data_dir() / rel for rel in data.FILES]
        return cached(Path(journal + ".predictors"), data_key(files), Predictors.from_data)
    except (OSError, ValueError, RuntimeError) as exc:
        raise config.ConfigError(f"slurm.predictors = 'data': the shared data is not usable ({exc}); "
                                 "run `dlshare data fetch` or set predictors = 'default'") from None


def build_shell(cfg):
    """The :class:`~scheduler.slurm.shell.SlurmShell` for config ``cfg``, its journal replayed."""
    from scheduler import SchedulerState
    from scheduler.slurm.shell_log import ShellLogError
    from scheduler.slurm.runner import SlurmCLI
    from scheduler.slurm.shell import SlurmShell

    s = cfg["slurm"]
    if not s["partition"]:
        raise config.ConfigError("slurm.partition must name a partition")
    for key in ("poll_s", "retry_s", "status_s", "gpu_slots", "telemetry_s", "start_timeout_s"):
        if not s[key] > 0:
            raise config.ConfigError(f"slurm.{key} must be > 0, got {s[key]!r}")
    journal = s["journal"] or _default_journal(s["partition"])
    try:
        core = SchedulerState(s["profile"], predictors=_predictors(s["predictors"], journal))
    except (ValueError, OSError) as exc:
        raise config.ConfigError(f"scheduling profile {s['profile']!r}: {exc}") from None
    feed = None
    if s["telemetry"]:
        from nodesvc.bus.commands import check_broker
        from scheduler.slurm.telemetry import TelemetryFeed

        check_broker(cfg["dlshare"]["broker"])
        feed = TelemetryFeed(cfg["dlshare"]["broker"], client_id=f"dlshare-slurm-{s['partition']}")
    shell = SlurmShell(core, s["partition"], journal,
                       SlurmCLI(s["slurm_conf"]), poll_s=s["poll_s"], retry_s=s["retry_s"], status_s=s["status_s"],
                       respect_requests=s["respect_requests"], gpu_slots=s["gpu_slots"], predictors=s["predictors"],
                       telemetry=feed, telemetry_s=s["telemetry_s"], start_timeout_s=s["start_timeout_s"])
    try:
        shell.recover()
    except (ShellLogError, ValueError) as exc:
        raise config.ConfigError(f"journal: {exc}") from None
    if feed is not None:
        feed.start()
    return shell


def _run(args, cfg) -> int:
    s = cfg["slurm"]
    if args.release_held:
        from scheduler.slurm.runner import SlurmCLI, SlurmUnavailable
        from scheduler.slurm.shell import release_held

        try:
            done, failed = release_held(SlurmCLI(s["slurm_conf"]), s["partition"],
                                        s["journal"] or _default_journal(s["partition"]))
        except SlurmUnavailable as exc:
            print(f"dlshare slurm: {exc}", file=sys.stderr)
            return 1
        print(f"released {done} jobs of partition {s['partition']} with their own requests ({failed} failed)")
        return 1 if failed else 0
    shell = build_shell(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("dlshare slurm: scheduling partition %s with profile %s (journal %s)", s["partition"],
             shell.core.profile.name, shell.journal.path)
    shell.run(stop, max_steps=1 if args.once else None)
    if args.once:
        st = shell.stats
        print(f"events {st.events}, decisions {st.decisions}, actions {st.actions}, failed {st.failed_actions}")
    return 0


def register(cli) -> None:
    p = cli.add("slurm", _run, "schedule the GPU jobs of a Slurm partition (held jobs, placed and "
                "released with scontrol)", sections=["slurm"])
    cli.config_flag(p, "--partition", "slurm", "partition", help="the partition dlshare schedules (default dlshare)")
    cli.config_flag(p, "--profile", "slurm", "profile", help="scheduling profile (default dlshare)")
    cli.config_flag(p, "--journal", "slurm", "journal", help="the shell's journal (replayed at start)")
    cli.config_flag(p, "--slurm-conf", "slurm", "slurm_conf", help="SLURM_CONF for Slurm's commands")
    cli.config_flag(p, "--poll", "slurm", "poll_s", type=float, help="seconds between reads of the queue (default 1)")
    cli.config_flag(p, "--gpu-slots", "slurm", "gpu_slots", type=int,
                    help="count-only gpu GRES per physical GPU on the partition's nodes (default 2)")
    cli.config_flag(p, "--telemetry", "slurm", "telemetry", action="store_const", const=True,
                    help="feed telemetry of `dlshare node` beside slurmd (from --broker) to the core")
    cli.config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL (for --telemetry)")
    cli.config_flag(p, "--predictors", "slurm", "predictors", choices=["data", "default"],
                    help="predictors at start (default data)")
    p.add_argument("--once", action="store_true", help="one poll and its actions, then exit")
    p.add_argument("--release-held", action="store_true",
                   help="take dlshare out: give held jobs their own requests back and release them, then exit")
