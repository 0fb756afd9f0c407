"""A throwaway Slurm cluster on this host: munge, one slurmctld and several slurmd, fake GPUs.

For the integration tests, ``dlshare bench slurm`` and trying ``dlshare slurm`` out.  It uses Debian's
``slurm-wlm`` build with multiple-slurmd support: every node is a ``slurmd -N NAME`` on its own port
of this host, with ``SlurmdParameters=config_overrides`` so nodes may declare more CPUs and memory than
the host has.  GPUs are GRES (``AutoDetect=off``): either backed by plain files, one per device, as Slurm alone
uses them, or declared as ``gpu_slots`` count-only slots per device, as dlshare's partitions do.  Everything lives under one
directory (config, state, spool, logs, a private munge socket and key); every daemon runs in the
foreground as a child of this process and is stopped by its pid.  Timers are short (node down after
``slurmd_timeout_s``) so fault tests take seconds.

dlshare's shipped ``deploy/slurm/job_submit.lua`` and ``dlshare-taskprolog.sh`` are used as they are
(the lua with its partition table set to this cluster's partition).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from nodesvc.bus.procs import free_port, stop_proc, wait_port, wait_until

DEPLOY = Path(__file__).resolve().parent.parent.parent / "deploy" / "slurm"


class TestbedError(RuntimeError):
    """The local cluster could not be started (missing packages, a daemon that exited)."""


def _exe(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)
    if not found:
        raise TestbedError(f"{name} is not installed: run `make deps` (it installs slurm-wlm and munge)")
    return found


def available() -> str:
    """Empty when Slurm and munge are installed, else what is missing."""
    missing = [n for n in ("munged", "slurmctld", "slurmd", "squeue", "scontrol", "sbatch", "sinfo")
               if not (shutil.which(n) or os.path.exists(f"/usr/sbin/{n}"))]
    return ", ".join(missing)


@dataclass
class LocalSlurm:
    """The cluster (see the module docstring).  ``start()``, then ``env`` for clients, ``stop()``."""

    root: Path
    nodes: int = 3
    gpus: int = 4
    cpus: int = 12
    memory_mb: int = 256000
    partition: str = "dlshare"
    lua: bool = True  # hold every job of the partition with deploy/slurm/job_submit.lua
    taskprolog: bool = True
    # 0: GPUs are GRES backed by one file each (Slurm binds them: Slurm alone).  N: each GPU is declared
    # as N count-only ``gpu`` GRES, the slots dlshare co-locates jobs in and binds itself (dlshare's form).
    gpu_slots: int = 2
    slurmd_timeout_s: int = 6
    extra_conf: str = ""
    partition_opts: str = ""
    ctld: subprocess.Popen | None = field(default=None, init=False)
    slurmd: dict[str, subprocess.Popen] = field(default_factory=dict, init=False)
    munged: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.names = [f"n{i + 1}" for i in range(self.nodes)]
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}
        self._logs: list = []

    # ------------------------------------------------------------------ config

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (squeue, scontrol, sbatch) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def gpu_dir(self, node: str) -> Path:
        return self.root / "gpu" / node

    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "log", "run", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        lines = [
            "# written by dlshare's scheduler/slurm/testbed.py: a throwaway cluster on one host",
            "ClusterName=dlshare-testbed",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "PriorityType=priority/basic",
            "SlurmdParameters=config_overrides", "GresTypes=gpu", "ReturnToService=2",
            # Short timers: a node is declared down within seconds, jobs are killed quickly, and finished
            # jobs stay visible for an hour (dlshare reads their end states).  MessageTimeout bounds how
            # long a client (squeue, dlshare's poll) keeps retrying a slurmctld that is down and how long
            # a ping to a dead slurmd takes to fail: 2 s (Slurm's default is 10) is ample on loopback, even
            # with every core busy.
            f"SlurmdTimeout={self.slurmd_timeout_s}", "MessageTimeout=2", "KillWait=2", "InactiveLimit=0",
            "MinJobAge=3600", "SchedulerParameters=bf_interval=1,sched_min_interval=100000",
        ]
        if self.lua:
            lua = (DEPLOY / "job_submit.lua").read_text()
            lua = lua.replace("{ dlshare = true }", f"{{ [\"{self.partition}\"] = true }}")
            (r / "etc" / "job_submit.lua").write_text(lua)
            lines.append("JobSubmitPlugins=lua")
        if self.taskprolog:
            lines.append(f"TaskProlog={DEPLOY / 'dlshare-taskprolog.sh'}")
        gres = ["AutoDetect=off"]
        for name in self.names:
            port = self.node_ports[name]
            count = self.gpus * (self.gpu_slots or 1)
            lines.append(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory={self.memory_mb} Gres=gpu:{count} State=UNKNOWN")
            (r / "spool" / name).mkdir(parents=True, exist_ok=True)
            gd = self.gpu_dir(name)
            gd.mkdir(parents=True, exist_ok=True)
            for i in range(self.gpus):
                (gd / f"gpu{i}").touch()
            # Slurm's own form lists each device once; dlshare's lists it gpu_slots times (its co-location slots).
            for _ in range(self.gpu_slots or 1):
                gres.append(f"NodeName={name} Name=gpu File={gd}/gpu[0-{self.gpus - 1}]")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE "
                     f"State=UP OverSubscribe=NO DefMemPerCPU={self.memory_mb // self.cpus} {self.partition_opts}".rstrip())
        if self.extra_conf:
            lines.append(self.extra_conf)
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self._logs.append(log)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                                start_new_session=True)

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        missing = available()
        if missing:
            raise TestbedError(f"not installed: {missing}; run `make deps` (slurm-wlm, munge)")
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # leave nothing running behind a failed start
            raise

    def _start(self, timeout: float) -> "LocalSlurm":
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.names}
        self._write_config()
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        m = self.root / "munge"
        self.munged = self._spawn("munged", [
            _exe("munged"), "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}", f"--log-file={m / 'munged.log'}"])
        wait_until(lambda: self.munge_socket.exists() or self.munged.poll() is not None, timeout, "munged socket")
        if self.munged.poll() is not None:
            raise TestbedError(f"munged exited ({self.munged.returncode}); see {self.root / 'log' / 'munged.out'}")
        self.start_ctld(timeout=timeout)
        for n in self.names:
            self.start_node(n, wait=False)
        for n in self.names:
            wait_port(self.node_ports[n], proc=self.slurmd[n], timeout=timeout)
        self.wait_nodes(lambda st: all(s in ("idle", "mixed", "allocated") for s in st.values()), timeout)
        return self

    def start_ctld(self, timeout: float = 60.0) -> None:
        self.ctld = self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-i"])
        wait_port(self.ctld_port, proc=self.ctld, timeout=timeout)

    def stop_ctld(self, sig: int = signal.SIGTERM) -> None:
        if self.ctld is not None:
            stop_proc(self.ctld, sig, timeout=20)
            self.ctld = None

    def restart_ctld(self, sig: int = signal.SIGTERM) -> None:
        self.stop_ctld(sig)
        self.start_ctld()

    def start_node(self, name: str, wait: bool = True) -> None:
        self.slurmd[name] = self._spawn(f"slurmd-{name}", [_exe("slurmd"), "-D", "-N", name])
        if wait:
            wait_port(self.node_ports[name], proc=self.slurmd[name])

    def stop_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop ``name``'s slurmd (SIGKILL by default: the node vanishes; its job steps live on until
        slurmctld has the node back and tells it to kill them, as after a real crash)."""
        p = self.slurmd.pop(name, None)
        if p is not None:
            stop_proc(p, sig, timeout=20)

    def stop(self) -> None:
        if self.ctld is not None and self.ctld.poll() is None:
            self.run("scancel", "--partition", self.partition, check=False)
        for name in list(self.slurmd):
            self.stop_node(name, signal.SIGTERM)
        self.stop_ctld()
        if self.munged is not None:
            stop_proc(self.munged)
            self.munged = None
        self._reap_strays()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def _reap_strays(self) -> None:
        """Kill what outlived its slurmd: job steps (slurmstepd) and their jobs, found by this cluster's
        SLURM_CONF in their environment (a slurmd killed with -9 leaves them running, as on a real node)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    # ------------------------------------------------------------------ clients

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--json", check=False)
        if out.returncode:
            return {}
        states = {}
        for n in json.loads(out.stdout).get("nodes", []):
            flags = [f.lower() for f in n.get("state_flags") or []]
            states[n["name"]] = "+".join([str(n["state"]).lower(), *flags])
        return states

    def wait_nodes(self, pred, timeout: float = 60.0) -> dict[str, str]:
        return wait_until(lambda: (lambda st: st if st and pred(st) else None)(self.node_states()), timeout,
                          "Slurm node states", interval=0.2)

    def sbatch(self, *args: str) -> str:
        """Submit; returns the job id."""
        out = self.run("sbatch", "--parsable", *args)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        out = self.run("squeue", "--json", check=False)
        for j in json.loads(out.stdout or "{}").get("jobs", []):
            if str(j["job_id"]) == str(job_id):
                return j
        return {}

    def cancel_all(self) -> None:
        self.run("scancel", "--partition", self.partition, check=False)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no job of the partition is pending or running (after :meth:`cancel_all`)."""
        def idle() -> bool:
            out = self.run("squeue", "-h", "-p", self.partition, "-t", "PD,R,CG,CF,S", "-o", "%i", check=False)
            return out.returncode == 0 and not out.stdout.strip()
        wait_until(idle, timeout, "an idle partition", interval=0.2)

