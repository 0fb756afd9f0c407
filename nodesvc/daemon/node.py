"""``dlshare node``: the node daemon's asyncio shell.

It owns the I/O (MQTT, cgroups, processes, timers) around the pure parts:
command validation and idempotence (:mod:`nodesvc.node_core`) and the
collectors (:mod:`nodesvc.telemetry`).  A bad message gets an error reply and a
log line; nothing a peer sends can end the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from nodesvc import __version__, cgroups, telemetry
from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus
from nodesvc.extension import NodeContext
from nodesvc.gpu import GpuProbe, SimulatedNvml
from nodesvc.bus import jobenv
from nodesvc.bus.mqtt import parse_broker_url
from nodesvc.daemon.jobs import JobTable, tgid_of
from nodesvc.daemon.metrics import NodeMetrics
from nodesvc.daemon.runas import RunAsError, job_environment, resolve
from nodesvc.node_core import (BUILTIN_OPS, AllocateSpec, Ping, ReleaseSpec, ReplyCache, RunSpec, StopSpec, parse_op,
                               thread_groups)

log = logging.getLogger("dlshare.node")


def default_state_dir(node_id: str) -> str:
    if os.geteuid() == 0:
        return f"/var/lib/dlshare/{node_id}"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "dlshare", node_id)


def protected_pids() -> frozenset[int]:
    """init, this daemon and its ancestors: never to be put under an allocation or signalled."""
    import psutil

    pids = {1, os.getpid()}
    try:
        pids.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    return frozenset(pids)


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)


class NodeDaemon:
    def __init__(self, cfg: dict[str, dict[str, Any]], clock: Callable[[], float] = time.time) -> None:
        """``clock``: the daemon's wall time (telemetry and state timestamps, a reply's ``ts``, when
        a job exited and when its record is forgotten); a test may move it by hand."""
        self.cfg = cfg
        self.clock = clock
        n = cfg["node"]
        self.node_id = messages.check_id(n["id"] or socket.gethostname().split(".")[0], "node id")
        self.interval = float(n["interval"])
        if self.interval <= 0:
            raise ValueError("node.interval must be positive")
        self.topic = lambda leaf: messages.node_topic(self.node_id, leaf)
        self.cgroups = (
            cgroups.driver(n["cgroup_root"], n["cgroup_base"] or None, group=f"dlshare/{self.node_id}")
            if n["enforce"] else cgroups.NoCgroups("enforcement disabled (node.enforce = false)")
        )
        self.jobs = JobTable(n["state_dir"] or default_state_dir(self.node_id), n["job_dir"], clock)
        self.allow_run = bool(n["allow_run"])
        self.allow_root_jobs = bool(n["allow_root_jobs"])
        self.min_job_uid = int(n["min_job_uid"])
        if not 0 <= self.min_job_uid < 1 << 31:
            raise ValueError("node.min_job_uid must be a uid (0 to 2^31-1)")
        self.env_allow = jobenv.check_patterns(n["job_env_allow"], "node.job_env_allow")
        self.env_deny = jobenv.check_patterns(n["job_env_deny"], "node.job_env_deny")
        self.env_inherit = jobenv.check_patterns(n["job_env_inherit"], "node.job_env_inherit")
        self.job_broker = n["job_broker"] or _without_credentials(cfg["dlshare"]["broker"])
        self.protected_pids = protected_pids()
        self.allocations: dict[str, cgroups.CgroupLimits] = {}
        nvml = None
        if n["fake_gpus"] > 0:
            nvml = SimulatedNvml(int(n["fake_gpus"]), load=self._simulated_gpu_load)
        self.gpu = GpuProbe(nvml)
        self.replies = ReplyCache()
        self._replying: set[asyncio.Task] = set()  # replies on their way to the broker
        self.last: dict[str, Any] | None = None
        self.metrics = NodeMetrics(self.node_id, lambda: self.last)
        self.metrics_port: int | None = None
        self.extensions: list[Any] = []
        if n["lend"]:
            from nodesvc.daemon.donor import DonorExtension

            self.extensions.append(DonorExtension(cfg))
        self.bus = Bus(
            cfg["dlshare"]["broker"],
            client_id=f"dlshare-node-{self.node_id}",
            subscriptions=[(self.topic("cmd"), 1), (self.topic(messages.MEMORY_LEAF), 1)],
            handler=self._on_message,
            on_connect=self._on_connect,
            will=(self.topic("state"), messages.encode({"node": self.node_id, "status": "offline",
                                                         "reason": "connection lost"}), 1, True),
        )
        self.started = clock()
        self._stop = asyncio.Event()

    # --- telemetry ----------------------------------------------------------------------------

    def _simulated_gpu_load(self, index: int) -> tuple[float, list[int]]:
        """Simulated GPUs look busy while a job assigned to them runs (35% plus half its CPU use)."""
        util, pids = 0.0, []
        for jp in list(self.jobs.jobs.values()):
            if jp.state == "running" and index in jp.gpus:
                util += min(100.0, 35.0 + jp.last_usage.get("cpu_percent", 0.0) / 2)
                pids.extend(jp.root_pids())
        return min(100.0, util), pids

    def collect(self) -> dict[str, Any]:
        jobs = {}
        reserved_unused = 0
        # A snapshot: commands change these tables on the event loop while this runs in a thread.
        allocations = dict(self.allocations)
        for name, jp in list(self.jobs.jobs.items()):
            u = jp.usage() if jp.state == "running" else {"cpu_percent": 0.0, "rss_bytes": 0, "pids": []}
            alloc = allocations.get(name)
            jobs[name] = {**u, "state": jp.state, "exit_code": jp.exit_code, "gpus": list(jp.gpus),
                          "memory_limit_bytes": alloc.memory_bytes if alloc else None,
                          "oom_kills": self.cgroups.oom_kills(name) if alloc else 0,
                          **({"run_id": jp.run_id} if jp.run_id else {})}
            if alloc and alloc.memory_bytes and jp.state == "running":
                reserved_unused += max(0, alloc.memory_bytes - u["rss_bytes"])
        promised = sum(a.memory_bytes or 0 for a in allocations.values())
        t = {
            "node": self.node_id,
            "ts": self.clock(),
            "cpu": telemetry.cpu(),
            "memory": telemetry.memory(promised, reserved_unused),
            "gpus": self.gpu.sample(),
            "rdma": telemetry.rdma_devices(),
            "jobs": jobs,
            "cgroup_version": self.cgroups.version,
        }
        for ext in self.extensions:
            try:
                t[ext.name] = ext.telemetry()
            except Exception as exc:  # an extension's fault must not stop telemetry
                log.exception("telemetry of extension %s failed", ext.name)
                t[ext.name] = {"error": str(exc)}
        return t

    def state_payload(self) -> bytes:
        t = self.last or {}
        summary: dict[str, Any] = {}
        if t:
            summary = {
                "cpu_count": t["cpu"]["count"],
                "cpu_percent": t["cpu"]["percent"],
                "memory_total_bytes": t["memory"]["total_bytes"],
                "memory_available_bytes": t["memory"]["available_bytes"],
                "gpus": len(t["gpus"]["devices"]),
                "gpu_util_percent": [d.get("util_percent") for d in t["gpus"]["devices"]],
                "gpus_simulated": bool(t["gpus"].get("simulated")),
                "jobs_running": sum(1 for j in t["jobs"].values() if j["state"] == "running"),
            }
            donor = t.get("donor")
            if isinstance(donor, dict):
                summary["donor"] = {k: donor.get(k) for k in ("enabled", "addr", "provider", "lendable_bytes",
                                                              "lent_bytes", "free_slabs", "total_slabs", "slab_bytes",
                                                              "lent_to")}
        return messages.encode({
            "node": self.node_id, "status": "online", "version": __version__, "pid": os.getpid(),
            "started": self.started, "ts": self.clock(), "metrics_port": self.metrics_port,
            "cgroup_version": self.cgroups.version, "summary": summary,
        })

    async def _telemetry_loop(self) -> None:
        while not self._stop.is_set():
            self.metrics.connected.set(1 if self.bus.connected.is_set() else 0)
            try:
                self.last = await asyncio.to_thread(self.collect)
                if self._stop.is_set():
                    break  # do not republish "online" after a clean stop said "offline"
                payload = messages.encode(self.last)
                if await self.bus.publish(self.topic("telemetry"), payload, qos=0):
                    self.metrics.telemetry.inc()
                await self.bus.publish(self.topic("state"), self.state_payload(), qos=1, retain=True)
            except Exception:
                log.exception("telemetry collection failed")
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval)
            except TimeoutError:
                pass

    async def _reap_loop(self) -> None:
        while not self._stop.is_set():
            try:
                for jp in self.jobs.reap():
                    try:
                        oom = self.cgroups.oom_kills(jp.job) if jp.job in self.allocations else 0
                    except cgroups.CgroupError as exc:
                        log.warning("cannot read OOM count of %s: %s", jp.job, exc)
                        oom = 0
                    log.info("job %s exited with %s", jp.job, jp.exit_code)
                    await self.bus.publish(self.topic("events"), messages.encode({
                        "event": "job_exit", "node": self.node_id, "job": jp.job, "exit_code": jp.exit_code,
                        "oom_killed": oom > 0, "ts": jp.exited_at, **({"run_id": jp.run_id} if jp.run_id else {}),
                    }), qos=1)
                self.jobs.forget_exited()
            except Exception:  # reaping must go on, or exited jobs become zombies
                log.exception("reaping jobs failed")
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=0.25)
            except TimeoutError:
                pass

    # --- MQTT ---------------------------------------------------------------------------------

    async def _on_connect(self, bus: Bus) -> None:
        self.metrics.connected.set(1)
        self.metrics.connects.inc()
        await bus.publish(self.topic("state"), self.state_payload(), qos=1, retain=True)
        if bus.connects == 1:
            sd_notify(f"READY=1\nSTATUS=connected to {bus.addr.url()}")

    async def _on_message(self, topic: str, payload: bytes) -> None:
        if topic == self.topic("cmd"):
            reply = await self.handle_command(payload)
        elif topic == self.topic(messages.MEMORY_LEAF):
            reply = await self.handle_command(payload, memory_only=True)
        else:
            return
        # The reply leaves without this pump waiting for the broker's acknowledgement: the next
        # command is taken at once (replies are matched by id, their order does not matter).
        task = asyncio.create_task(self.bus.publish(self.topic("reply"), reply, qos=1))
        self._replying.add(task)
        task.add_done_callback(self._replied)

    def _replied(self, task: asyncio.Task) -> None:
        self._replying.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sending a reply failed: %s", task.exception())

    async def handle_command(self, payload: bytes, memory_only: bool = False) -> bytes:
        """Validate and apply one command; always returns a reply payload.  ``memory_only``: it came
        on the ``mem`` topic, where only a memory consumer's ops are taken (the broker lets jobs
        publish there, not on ``cmd``)."""
        try:
            cmd = messages.parse_command(payload)
        except messages.PayloadError as exc:
            self.metrics.bad_messages.inc()
            cid = messages.command_id_of(payload)
            log.warning("malformed command (id %s): %s", cid, exc)
            return messages.reply(cid, False, error=f"malformed command: {exc}")
        key = f"mem:{cmd.id}" if memory_only else cmd.id  # one topic's ids never answer the other's
        took = round(self.clock(), 6)  # when this node took the command (the reply's ts)
        cached = self.replies.get(key)
        if cached is not None:
            return cached
        if memory_only and cmd.op not in messages.MEMORY_OPS:
            self.metrics.commands.labels("unknown", "rejected").inc()
            log.warning("refused %s on the memory topic (command %s)", cmd.op, cmd.id)
            return messages.reply(cmd.id, False, op=cmd.op, error=f"op {cmd.op!r} is not a memory consumer's "
                                  f"({', '.join(sorted(messages.MEMORY_OPS))}): it is taken on the cmd topic only")
        known = cmd.op in BUILTIN_OPS or any(cmd.op in ext.commands() for ext in self.extensions)
        label = cmd.op if known else "unknown"  # bounded label set: one series per real op
        try:
            result = await self._apply(cmd)
            reply = messages.reply(cmd.id, True, result=result, op=cmd.op, ts=took)
            self.metrics.commands.labels(label, "ok").inc()
        except messages.PayloadError as exc:
            log.warning("rejected command %s %s: %s", cmd.id, cmd.op, exc)
            reply = messages.reply(cmd.id, False, error=str(exc), op=cmd.op)
            self.metrics.commands.labels(label, "rejected").inc()
        except Exception as exc:  # the command failed to apply; report, keep running
            log.exception("command %s %s failed", cmd.id, cmd.op)
            reply = messages.reply(cmd.id, False, error=f"{type(exc).__name__}: {exc}", op=cmd.op)
            self.metrics.commands.labels(label, "failed").inc()
        self.replies.put(key, reply)
        return reply

    async def _apply(self, cmd: messages.Command) -> dict[str, Any]:
        for ext in self.extensions:
            handler = ext.commands().get(cmd.op)
            if handler is not None:
                return await handler(cmd.args)
        spec = parse_op(cmd, self.protected_pids)
        if isinstance(spec, Ping):
            return {"node": self.node_id, "ts": self.clock()}
        if isinstance(spec, AllocateSpec):
            # Checked as processes: writing a thread id to cgroup.procs moves its whole process.
            pids = thread_groups(spec.pids, {p: tgid_of(p) for p in spec.pids}, self.protected_pids)
            where = self.cgroups.apply(spec.alloc, list(pids))
            self.allocations[spec.alloc.job] = spec.alloc
            if pids:
                self.jobs.adopt(spec.alloc.job, list(pids), spec.alloc.memory_bytes)
            return {"job": spec.alloc.job, "cgroup_version": self.cgroups.version, "cgroup": _paths(where),
                    "pids": list(pids)}
        if isinstance(spec, ReleaseSpec):
            self.cgroups.release(spec.job)
            existed = self.allocations.pop(spec.job, None) is not None
            return {"job": spec.job, "released": existed}
        if isinstance(spec, RunSpec):
            if not self.allow_run:
                raise messages.PayloadError(
                    f"node {self.node_id} does not start processes: set node.allow_run = true "
                    "(and restrict who may publish to its cmd topic with broker ACLs)")
            # Who it runs as and with what environment, checked before anything is applied.
            try:
                creds = resolve(spec.user, self.allow_root_jobs, self.min_job_uid)
            except RunAsError as exc:
                raise messages.PayloadError(str(exc)) from None
            bad = jobenv.refused(spec.env, self.env_allow, self.env_deny)
            if bad:
                raise messages.PayloadError(jobenv.explain(bad, "node.job_env_allow"))
            procs: list[str] = []
            if spec.alloc is not None:
                where = self.cgroups.apply(spec.alloc)
                self.allocations[spec.job] = spec.alloc
                procs = [str(p / "cgroup.procs") for p in _path_list(where)]
            elif spec.job in self.allocations:
                procs = [str(p / "cgroup.procs") for p in _path_list(self.cgroups.apply(self.allocations[spec.job]))]
            try:
                # A job reaches the broker (and through it the aggregation servers) as job_broker says:
                # never with the daemon's own credentials.
                own = {"DLSHARE_BROKER": self.job_broker, "DLSHARE_NODE_ID": self.node_id, "DLSHARE_JOB": spec.job}
                if spec.remote_memory_bytes:  # rdma.region_from_env() maps it
                    own["DLSHARE_REMOTE_MEMORY_BYTES"] = str(spec.remote_memory_bytes)
                if spec.alloc is not None and spec.alloc.memory_bytes:
                    own["DLSHARE_MEMORY_BYTES"] = str(spec.alloc.memory_bytes)
                if spec.gpus:
                    own["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
                env = job_environment(creds, spec.env, dict(os.environ), self.env_inherit, own)
                jp = self.jobs.start(spec.job, list(spec.argv), env, spec.cwd, procs, creds, spec.gpus, spec.run_id)
            except (RuntimeError, RunAsError) as exc:
                raise messages.PayloadError(str(exc)) from None
            except OSError as exc:
                raise messages.PayloadError(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}") from None
            except subprocess.SubprocessError as exc:  # the child failed between fork and exec (cgroup, ids)
                raise messages.PayloadError(f"cannot start {spec.argv[0]!r} as {creds.user}: {exc}") from None
            return {"job": spec.job, "pid": jp.popen.pid, "log": jp.log_path, "user": creds.user, "uid": creds.uid,
                    "gid": creds.gid}
        if isinstance(spec, StopSpec):
            try:
                members = [p for p in self.cgroups.pids(spec.job) if p not in self.protected_pids]
                sent = self.jobs.signal(spec.job, spec.signal, members)
            except KeyError:
                raise messages.PayloadError(f"no job {spec.job!r} on node {self.node_id}") from None
            return {"job": spec.job, "signalled": sent}
        raise messages.PayloadError(f"unhandled op {cmd.op!r}")

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        host, port = _split(self.cfg["node"]["metrics_listen"])
        if port >= 0:
            try:
                self.metrics_port = self.metrics.serve(host, port)
                log.info("metrics on http://%s:%d/metrics", host, self.metrics_port)
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", host, port, exc)
        ctx = NodeContext(self.node_id, self.cfg, self.bus.publish,
                          promised_bytes=lambda: int((self.last or {}).get("memory", {}).get("promised_bytes", 0)),
                          reserved_unused_bytes=lambda: int(
                              (self.last or {}).get("memory", {}).get("reserved_unused_bytes", 0)),
                          connected=self.bus.connected.is_set)
        for ext in self.extensions:
            await ext.start(ctx)
        try:
            removed = self.cgroups.cleanup_stale()
            if removed:
                log.info("removed %d stale job cgroups left by an earlier run", removed)
        except cgroups.CgroupError as exc:
            log.warning("could not clean up stale cgroups: %s", exc)
        try:
            self.last = await asyncio.to_thread(self.collect)
            log.info("node %s up (cgroup v%s, %d GPUs%s)", self.node_id, self.cgroups.version,
                     len(self.last["gpus"]["devices"]), ", simulated" if self.last["gpus"].get("simulated") else "")
        except Exception:
            log.exception("first telemetry collection failed; continuing")
        bus_stop = asyncio.Event()  # the bus outlives the loops: the offline state goes out last
        bus_task = asyncio.create_task(self.bus.run(bus_stop))
        loops = [asyncio.create_task(self._telemetry_loop()), asyncio.create_task(self._reap_loop())]
        await self._stop.wait()
        sd_notify("STOPPING=1")
        for t in loops:  # no telemetry may republish "online" after the offline state below
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        # A clean stop says offline itself; the Last Will covers crashes.
        await self.bus.publish(self.topic("state"), messages.encode({
            "node": self.node_id, "status": "offline", "reason": "stopped"}), qos=1, retain=True)
        for ext in self.extensions:
            try:
                await ext.stop()
            except Exception:
                log.exception("stopping extension %s failed", ext.name)
        await asyncio.to_thread(self.jobs.stop_all)
        for job in list(self.allocations):
            try:
                self.cgroups.release(job)
            except cgroups.CgroupError as exc:
                log.warning("could not release %s: %s", job, exc)
        if self._replying:  # the replies already on their way leave before the connection closes
            await asyncio.wait(set(self._replying), timeout=5)
        bus_stop.set()
        try:
            await asyncio.wait_for(bus_task, timeout=5)
        except TimeoutError:
            bus_task.cancel()
            await asyncio.gather(bus_task, return_exceptions=True)
        self.metrics.close()
        self.gpu.close()

    def stop(self) -> None:
        self._stop.set()


def _without_credentials(url: str) -> str:
    """The broker URL with its user name and password taken out (for jobs)."""
    try:
        return parse_broker_url(url).url()
    except ValueError:
        return url


def _split(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _path_list(where: Any) -> list:
    if isinstance(where, dict):
        return list(where.values())
    return [where] if where is not None else []


def _paths(where: Any) -> Any:
    if isinstance(where, dict):
        return {k: str(v) for k, v in where.items()}
    return str(where)
