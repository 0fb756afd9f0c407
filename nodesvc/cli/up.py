"""``dlshare up``: the whole stack on one machine, as supervised child processes.

It starts the embedded MQTT broker, N node daemons with distinct ids (donors
of remote memory when that part is installed), and, when those parts are
installed, the aggregation server and the scheduler service.  It prints where
everything listens and stops everything, in reverse order, on Ctrl-C.
``--tour`` runs a short scripted tour of the running stack and then stops.

Nothing listens anonymously.  It makes a broker user and a random password for each
principal (:class:`BrokerUsers`: each node daemon by its id, the scheduler, the
aggregation server, memory consumers and the operator) and has the broker (amqtt
or mosquitto) enforce ``deploy/mosquitto/dlshare.acl``; each child gets its own
credentials in its environment (never on its command line, which every local
user can read).  Jobs get the memory consumers' credentials (lent memory is found
through the broker).  The scheduler's bootstrap token acts as the user who
started ``dlshare up``: root's jobs are allowed on the nodes only when that user
is root; other users get tokens with ``dlshare token create``.
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nodesvc import netns
from nodesvc.bus import config
from nodesvc.bus.acl import password_line
from nodesvc.bus.procs import free_port, split_hostport, wait_port
from nodesvc.netns import HostNet

log = logging.getLogger("dlshare.up")

config.register_section("up", {
    "nodes": 2,
    "broker_listen": "127.0.0.1:1883",
    "agg_listen": "127.0.0.1:7700",
    "sched_listen": "127.0.0.1:7800",
    "fake_gpus": 4,  # this machine has no GPU: each node simulates this many (marked simulated)
    "interval": 2.0,
    "state_dir": "",  # default: a new private directory under /tmp
    # Run each node daemon in its own network namespace, standing in for a separate host:
    # "auto" (when root and iproute2 allow it), "on" (fail if they do not) or "off" (all on loopback).
    "netns": "auto",
    # "amqtt": the embedded pure-Python broker (dlshare broker); "mosquitto": the production broker.
    "broker": "amqtt",
})


def _commands() -> set[str]:
    """The parts installed: the ``dlshare`` subcommands their entry points add."""
    from nodesvc.cli import COMMANDS_GROUP, load_entry_points

    return {name for name, _ in load_entry_points(COMMANDS_GROUP)}


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `dlshare up` dies, so no orphan outlives it."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _pick(host: str, port: int) -> int:
    """The configured port, or a free one when it is taken (said in the log)."""
    if _port_free(host, port):
        return port
    free = free_port(host)
    log.warning("port %d on %s is in use; using %d instead", port, host, free)
    return free


ACL_FILE = Path(__file__).resolve().parent.parent / "bus" / "dlshare.acl"  # deploy/mosquitto/dlshare.acl's twin
AGG_ID = "agg0"  # the aggregation server's id, and its broker user (a section of the ACL)


@dataclass
class BrokerUsers:
    """A broker user and random password per principal of the stack, and the files the broker
    reads: ``<dir>/passwd`` (mosquitto's ``$7$`` hashes) and ``<dir>/dlshare.acl``."""

    dir: Path
    passwords: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, state_dir: Path, node_ids: list[str]) -> "BrokerUsers":
        d = state_dir / "broker"
        d.mkdir(mode=0o700, exist_ok=True)
        users = cls(d, {u: secrets.token_urlsafe(24) for u in (*node_ids, "dlshare-sched", AGG_ID, "dlshare-memory",
                                                              "dlshare-operator")})
        _write_private(d / "passwd", "".join(password_line(u, pw) + "\n" for u, pw in users.passwords.items()))
        _write_private(d / "dlshare.acl", ACL_FILE.read_text())
        return users

    def url(self, user: str, host: str, port: int) -> str:
        return f"mqtt://{user}:{self.passwords[user]}@{host}:{port}"

    def hand_to(self, uid: int) -> None:
        """Let the broker's own user (mosquitto drops to it) read the files."""
        for p in (self.dir, self.dir / "passwd", self.dir / "dlshare.acl"):
            os.chown(p, uid, -1)


def _others_may_pass(path: Path) -> bool:
    """Whether every directory from / down to ``path`` lets other users through."""
    p = path.resolve()
    return all(os.stat(d).st_mode & 0o001 for d in (p, *p.parents))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


@dataclass
class Stack:
    broker_url: str = ""  # with the operator's credentials: what this process and the tour connect with
    broker_public: str = ""  # the same without credentials, to show
    node_ids: list[str] = field(default_factory=list)
    agg_addr: str | None = None
    agg_metrics: str | None = None  # HOST:PORT of its Prometheus endpoint
    sched_url: str | None = None
    sched_token: str | None = None
    state_dir: str = ""
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    net: HostNet | None = None
    node_addrs: dict[str, str] = field(default_factory=dict)
    lending: bool = False  # the node daemons lend memory (remote memory is installed)
    users: BrokerUsers | None = None
    job_broker: str = ""  # the broker URL jobs get (the memory consumers' credentials)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              prefix: list[str] = (), raw: list[str] | None = None) -> subprocess.Popen:
        """Start ``dlshare ARGV`` (or the ``raw`` command) as a supervised child, logging to state_dir."""
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        logf = open(Path(self.state_dir) / f"{name}.log", "ab")
        cmd = raw if raw is not None else [*prefix, sys.executable, "-m", "nodesvc.cli", *argv]
        p = subprocess.Popen(cmd, stdout=logf,
                             stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
                             cwd=Path(__file__).resolve().parents[2], preexec_fn=_die_with_parent)  # the checkout's root: its packages
        self.procs.append((name, p))
        return p

    def stop(self) -> None:
        """Stop the children in reverse start order (services, then nodes, then the broker)."""
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for name, p in reversed(self.procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in 10 s; killing it", name)
                    p.kill()
                    p.wait()
            self.procs.clear()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if self.net is not None:
            self.net.destroy()
            self.net = None


def _want_netns(mode: str) -> bool:
    if mode not in ("auto", "on", "off"):
        raise config.ConfigError(f"up.netns must be auto, on or off, not {mode!r}")
    if mode == "off":
        return False
    reason = netns.available()
    if reason is None:
        return True
    if mode == "on":
        raise config.ConfigError(f"up.netns = on, but {reason}")
    log.info("nodes share the loopback network: %s", reason)
    return False


def start(cfg: dict, log_json: bool = False) -> Stack:
    import tempfile

    u = cfg["up"]
    st = Stack(state_dir=u["state_dir"] or tempfile.mkdtemp(prefix="dlshare-up-"))
    Path(st.state_dir).mkdir(parents=True, exist_ok=True)
    os.chmod(st.state_dir, 0o711)  # jobs of other users pass through it to their own directories
    try:
        _start(st, u, log_json)
    except BaseException:
        st.stop()
        raise
    return st


def _start(st: Stack, u: dict, log_json: bool) -> None:
    common = ["--log-json"] if log_json else []
    node_ids = [f"node-{i}" for i in range(1, int(u["nodes"]) + 1)]
    if _want_netns(u["netns"]):
        st.net = HostNet(node_ids).create()
    host, port = split_hostport(u["broker_listen"], 1883)
    port = _pick(host, port)
    users = st.users = BrokerUsers.create(Path(st.state_dir), node_ids)
    st.broker_url = users.url("dlshare-operator", host, port)
    st.broker_public = f"mqtt://{host}:{port}"
    _write_private(Path(st.state_dir) / "operator.env", f"DLSHARE_BROKER={st.broker_url}\n")
    listen = f"{host}:{port}" + (f",{st.net.gateway}:{port}" if st.net else "")
    broker_files = ["--password-file", str(users.dir / "passwd"), "--acl-file", str(users.dir / "dlshare.acl")]
    if u["broker"] == "mosquitto":
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.path.exists(exe):
            raise config.ConfigError("up.broker = mosquitto, but mosquitto is not installed (apt-get install mosquitto)")
        conf = Path(st.state_dir) / "mosquitto.conf"
        run_as = ""
        if os.geteuid() == 0:  # mosquitto started as root drops to its own user, which must read the files
            try:
                users.hand_to(pwd.getpwnam("mosquitto").pw_uid)
            except KeyError:
                pass
            if not _others_may_pass(users.dir.parent):  # e.g. a state dir under a private one: stay root
                run_as = "user root\n"
        conf.write_text("".join(f"listener {a.rpartition(':')[2]} {a.rpartition(':')[0]}\n" for a in listen.split(","))
                        + run_as + f"allow_anonymous false\npassword_file {users.dir / 'passwd'}\n"
                        f"acl_file {users.dir / 'dlshare.acl'}\npersistence false\nset_tcp_nodelay true\n")
        p = st.spawn("broker", [], raw=[exe, "-c", str(conf)])
    elif u["broker"] == "amqtt":
        p = st.spawn("broker", ["broker", "--listen", listen, *broker_files, *common])
    else:
        raise config.ConfigError(f"up.broker must be amqtt or mosquitto, not {u['broker']!r}")
    wait_port(port, p, timeout=30, host=host)
    parts = _commands()
    lend = st.lending = True  # every node daemon lends: the remote-memory part ships in nodesvc
    bhost = st.net.gateway if st.net else host  # how the nodes (and their jobs) reach the broker
    st.job_broker = users.url("dlshare-memory", bhost, port)
    me = getpass.getuser()  # the bootstrap token's user: its jobs run as the user who started the stack
    for nid in node_ids:
        addr = st.net.addrs[nid] if st.net else "127.0.0.1"
        argv = ["node", "--node-id", nid, "--interval", str(u["interval"]),
                "--metrics-listen", f"{addr}:0", "--fake-gpus", str(u["fake_gpus"]),
                "--allow-run", *common]  # the scheduler starts jobs; the broker's ACL says who may command
        env = {"DLSHARE_NODE_STATE_DIR": str(Path(st.state_dir) / nid), "DLSHARE_BROKER": users.url(nid, bhost, port),
               "DLSHARE_NODE_JOB_BROKER": st.job_broker,
               # root started the stack: root's own jobs (the bootstrap token's) may run as root
               "DLSHARE_NODE_ALLOW_ROOT_JOBS": "true" if pwd.getpwnam(me).pw_uid == 0 else "false"}
        if lend:
            argv.append("--lend")
            env["DLSHARE_DONOR_LISTEN"] = addr  # the slab server listens on this host's own address
        st.spawn(nid, argv, env=env, prefix=st.net.prefix(nid) if st.net else [])
        st.node_ids.append(nid)
        st.node_addrs[nid] = addr
    if "agg" in parts:
        ahost, aport = split_hostport(u["agg_listen"], 7700)
        if st.net:
            ahost = st.net.gateway  # reachable from every node's namespace and from here
        aport = _pick(ahost, aport)
        mport = free_port(ahost)  # its Prometheus endpoint: never the default, so two stacks never clash
        p = st.spawn("agg", ["agg", "--listen", f"{ahost}:{aport}", "--id", AGG_ID,
                             "--metrics-listen", f"{ahost}:{mport}", *common],
                     env={"DLSHARE_BROKER": users.url(AGG_ID, host, port)})
        wait_port(aport, p, timeout=30, host=ahost)
        st.agg_addr = f"{ahost}:{aport}"
        st.agg_metrics = f"{ahost}:{mport}"
    if "sched" in parts:
        shost, sport = split_hostport(u["sched_listen"], 7800)
        sport = _pick(shost, sport)
        token = os.environ.get("DLSHARE_SCHED_TOKEN") or os.urandom(16).hex()
        p = st.spawn("sched", ["sched", "--listen", f"{shost}:{sport}",
                               "--db", str(Path(st.state_dir) / "sched.db"), *common],
                     env={"DLSHARE_BROKER": users.url("dlshare-sched", host, port), "DLSHARE_SCHED_TOKEN": token,
                          "DLSHARE_SCHED_TOKEN_USER": me})
        wait_port(sport, p, timeout=30, host=shost)
        st.sched_url, st.sched_token = f"http://{shost}:{sport}", token


def describe(st: Stack) -> str:
    lines = [f"MQTT broker        {st.broker_public}" + (f" (hosts reach it at {st.net.gateway})" if st.net else "")
             + f"; no anonymous clients: the operator's credentials are in {st.state_dir}/operator.env"]
    for nid in st.node_ids:
        where = f"network namespace {st.net.netns(nid)}, {st.node_addrs[nid]}" if st.net else "loopback"
        lines.append(f"node daemon        {nid} ({where}; telemetry on dlshare/v1/node/{nid}/telemetry)")
    if st.agg_addr:
        lines.append(f"aggregation server tcp://{st.agg_addr}" + (f" (metrics http://{st.agg_metrics}/metrics)"
                                                                 if st.agg_metrics else ""))
    if st.sched_url:
        lines.append(f"scheduler API      {st.sched_url}  (status page {st.sched_url}/: log in with token "
                     f"{st.sched_token}; metrics {st.sched_url}/metrics with the same token)")
    lines.append(f"logs               {st.state_dir}/*.log")
    return "\n".join(lines)


def _run(args, cfg) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    st = Stack()

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too, explicitly: Python installs its KeyboardInterrupt handler only when SIGINT is not
    # ignored at start, and a shell starts background jobs (`dlshare up &`, CI runners, nohup) with
    # SIGINT ignored; `kill -INT` would then do nothing.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        with console.status("starting the dlshare stack..."):
            st = start(cfg, cfg["dlshare"]["log_json"])
            from nodesvc.cli.tour import wait_nodes

            asyncio.run(wait_nodes(st.broker_url, st.node_ids, timeout=30))
        console.print("[bold]dlshare is up[/bold]")
        console.print(describe(st))
        if args.tour:
            from nodesvc.cli.tour import run_tour

            ok = asyncio.run(run_tour(st, console))
            return 0 if ok else 1
        console.print("press Ctrl-C to stop")
        deadline = time.monotonic() + args.duration if args.duration else None
        while deadline is None or time.monotonic() < deadline:
            for name, p in st.procs:
                if p.poll() is not None:
                    console.print(f"[red]{name} exited with {p.returncode}; stopping the stack[/red]")
                    return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        with console.status("stopping..."):
            st.stop()
        console.print("stopped")


def register(cli) -> None:
    p = cli.add("up", _run, "run the whole stack on this machine (broker, nodes, aggregation, scheduler)",
                sections=["up"])
    cli.config_flag(p, "--nodes", "up", "nodes", type=int, help="number of node daemons (default 2)")
    cli.config_flag(p, "--broker-listen", "up", "broker_listen", help="HOST:PORT for the embedded broker")
    cli.config_flag(p, "--fake-gpus", "up", "fake_gpus", type=int, help="simulated GPUs per node")
    cli.config_flag(p, "--state-dir", "up", "state_dir", help="where logs and the scheduler database go")
    cli.config_flag(p, "--broker", "up", "broker", choices=["amqtt", "mosquitto"],
                    help="which MQTT broker to run (default amqtt, the embedded one)")
    cli.config_flag(p, "--netns", "up", "netns", choices=["auto", "on", "off"],
                    help="node daemons in network namespaces, as separate hosts (default auto)")
    p.add_argument("--tour", action="store_true", help="run the scripted tour, then stop")
    p.add_argument("--duration", type=float, default=0, help="stop after this many seconds (0: until Ctrl-C)")
