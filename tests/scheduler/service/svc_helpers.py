"""Helpers for the scheduler-service tests: a fake node that speaks the node-daemon MQTT
contract over a real broker, the service in-process (with or without a broker) and as a real
process, and the payloads the service receives (telemetry, kube-scheduler's pods).
The fixtures that use them are in conftest.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodesvc.bus.procs import free_port, stop_proc, wait_port
from scheduler import WatchRules
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from nodesvc.bus.messages import telemetry_from

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "test-token-0123456789"
# The live rules on a test's time scale: fake nodes report every 0.3 s.
FAST_RULES = WatchRules(backoff_s=0.2, backoff_max_s=2.0, vanish_after_s=1.5)


class SchedProc:
    """``python -m nodesvc.cli sched`` as a real process on a free port; with ``tls`` (a directory of
    tests/tls_certs.py's files) it serves HTTPS with ``server.pem``, and its client trusts ``ca.pem``."""

    def __init__(self, tmp: Path, broker_url: str, profile: str = "dlshare", db: Path | None = None,
                 tls: Path | None = None) -> None:
        self.port = free_port()
        self.db = db or tmp / "sched.db"
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.broker_url = broker_url
        self.profile = profile
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None

    def start(self, extra_env: dict[str, str] | None = None) -> "SchedProc":
        # Uninformed predictors (3 s less to start); the tour test runs the trained ones.
        env = {**os.environ, "DLSHARE_SCHED_TICK_S": "0.5", "DLSHARE_SCHED_COMMAND_TIMEOUT_S": "3",
               "DLSHARE_SCHED_NODE_TIMEOUT_S": "6", "DLSHARE_SCHED_PREDICTORS": "default", **(extra_env or {})}
        self.log = open(self.tmp / f"sched-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodesvc.cli", "sched", "--listen", f"127.0.0.1:{self.port}", "--db", str(self.db),
             "--token", TOKEN, "--broker", self.broker_url, "--profile", self.profile,
             *(["--tls-cert-file", str(self.tls / "server.pem"), "--tls-key-file", str(self.tls / "server.key")]
               if self.tls else [])],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, timeout=30, proc=self.proc)
        return self

    def client(self):
        from scheduler.client import SchedulerClient

        return SchedulerClient(self.url, TOKEN, ca_file=str(self.tls / "ca.pem") if self.tls else None)

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)
            self.proc = None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None


class FakeNode:
    """A node that speaks the daemon's MQTT contract (telemetry, retained state with a Last
    Will, allocate/release/run/stop with replies, job_exit events) over a real broker.
    ``run`` does not start a process: the test ends jobs with :meth:`finish`."""

    def __init__(self, broker_url: str, node_id: str, cpus: int = 8, memory: int = 32 << 30,
                 interval: float = 0.3, gpus: int = 0) -> None:
        self.url, self.id, self.cpus, self.memory, self.interval = broker_url, node_id, cpus, memory, interval
        self.gpus = gpus
        self.commands: list[dict[str, Any]] = []
        self.drop_ops: set[str] = set()  # ops received but neither applied nor answered (a lost reply)
        self.refuse: dict[str, int] = {}  # op -> how many more of them to refuse (ok: false)
        self.replies: dict[str, bytes] = {}  # the daemon's reply cache: a repeated id gets the same answer
        self.running: dict[str, dict[str, Any]] = {}
        self.allocations: dict[str, dict[str, Any]] = {}
        self.reports = 0  # telemetry reports published
        self.hidden: set[str] = set()  # running jobs left out of the telemetry (as if they vanished)
        self._stop = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.bus = None

    async def start(self) -> "FakeNode":
        from nodesvc.bus import messages
        from nodesvc.bus.mqtt import Bus

        self.bus = Bus(self.url, f"fake-{self.id}", subscriptions=[(messages.node_topic(self.id, "cmd"), 1)],
                       handler=self._on_cmd, on_connect=self._online,
                       will=(messages.node_topic(self.id, "state"), messages.encode({"status": "offline"}), 1, True))
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.bus.connected.wait(), 10)
        return self

    async def _online(self, bus) -> None:
        from nodesvc.bus import messages

        await bus.publish(messages.node_topic(self.id, "state"), messages.encode({"status": "online"}), 1, True)

    async def _run(self) -> None:
        from nodesvc.bus import messages

        runner = asyncio.create_task(self.bus.run(self._stop))
        try:
            while not self._stop.is_set():
                t = {"node": self.id, "ts": 0.0, "cpu": {"count": self.cpus, "percent": 10.0},
                     "memory": {"total_bytes": self.memory, "available_bytes": self.memory // 2,
                                "reserved_unused_bytes": 1 << 30},
                     "gpus": {"devices": [{"index": i, "name": "fake", "util_percent": 50.0 if self._on_gpu(i) else 0.0,
                                           "memory_used_bytes": 0, "memory_total_bytes": 32 << 30}
                                          for i in range(self.gpus)],
                              "reason": None if self.gpus else "no NVIDIA driver (fake node)"},
                     "rdma": {"devices": []},
                     "jobs": {j: {"pids": [1], "cpu_percent": 50.0, "rss_bytes": 1 << 20, "state": "running"}
                              for j in self.running if j not in self.hidden},
                     "donor": {"lendable_bytes": 4 << 30, "lent_bytes": 1 << 30}}
                await self.bus.publish(messages.node_topic(self.id, "telemetry"), messages.encode(t))
                self.reports += 1
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            self._stop.set()
            await runner

    def _on_gpu(self, i: int) -> bool:
        return any(i in (a.get("gpus") or []) for a in self.running.values())

    async def _on_cmd(self, topic: str, payload: bytes) -> None:
        from nodesvc.bus import messages

        cmd = messages.parse_command(payload)
        self.commands.append({"id": cmd.id, "op": cmd.op, "args": cmd.args})
        if cmd.op in self.drop_ops:
            return
        if cmd.id in self.replies:
            await self.bus.publish(messages.node_topic(self.id, "reply"), self.replies[cmd.id], 1)
            return
        if self.refuse.get(cmd.op, 0) > 0:
            self.refuse[cmd.op] -= 1
            self.replies[cmd.id] = messages.reply(cmd.id, False, error=f"{cmd.op} refused (fake node)")
            await self.bus.publish(messages.node_topic(self.id, "reply"), self.replies[cmd.id], 1)
            return
        if cmd.op == "allocate":
            self.allocations[cmd.args["job"]] = cmd.args
        elif cmd.op == "release":
            self.allocations.pop(cmd.args["job"], None)
        elif cmd.op == "run":
            self.running[cmd.args["job"]] = cmd.args
        elif cmd.op == "stop":
            if self.running.pop(cmd.args["job"], None) is not None:
                await self._exit(cmd.args["job"], -15)
        self.replies[cmd.id] = messages.reply(cmd.id, True, {"op": cmd.op})
        await self.bus.publish(messages.node_topic(self.id, "reply"), self.replies[cmd.id], 1)

    async def _exit(self, job: str, code: int) -> None:
        from nodesvc.bus import messages

        await self.bus.publish(messages.node_topic(self.id, "events"),
                               messages.encode({"event": "job_exit", "job": job, "exit_code": code}), 1)

    async def finish(self, job: str, code: int = 0) -> None:
        self.running.pop(job, None)
        await self._exit(job, code)

    async def stop(self) -> None:
        from nodesvc.bus import messages

        if self.bus is not None and self.bus.connected.is_set():
            await self.bus.publish(messages.node_topic(self.id, "state"), messages.encode({"status": "offline"}), 1, True)
        self._stop.set()
        if self.task:
            await self.task

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [c for c in self.commands if c["op"] == op]


def telemetry(node: str, gpus: int, cpus: int = 8) -> dict[str, Any]:
    """A node daemon's telemetry payload (``messages.parse_telemetry`` accepts it)."""
    return {"schema": 1, "node": node, "ts": 0.0, "cpu": {"count": cpus, "percent": 5.0},
            "memory": {"total_bytes": 64 << 30, "available_bytes": 60 << 30},
            "gpus": {"devices": [{"index": i, "name": "sim", "util_percent": 0.0, "memory_total_bytes": 32 << 30}
                                 for i in range(gpus)], "reason": None},
            "rdma": {"devices": []}, "jobs": {}}


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def pod(name: str = "train-0", gpus: int = 1, cpu: str = "2", memory: str = "4Gi",
        model: str | None = "resnet50") -> dict[str, Any]:
    """A v1.Pod as kube-scheduler serialises it (metadata, spec.containers[].resources)."""
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    meta = {"name": name, "namespace": "ml", "uid": POD_UID,
            "resourceVersion": "4711", "creationTimestamp": "2026-11-21T08:00:00Z", "labels": {"app": "train"}}
    if model:
        meta["annotations"] = {"dlshare.io/model": model, "dlshare.io/batch-size": "64"}
    return {"metadata": meta,
            "spec": {"schedulerName": "dlshare", "containers": [
                {"name": "main", "image": "trainer:1", "resources": {"requests": {"cpu": cpu, "memory": memory},
                                                                     "limits": limits}},
                {"name": "sidecar", "image": "log:1", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]},
            "status": {"phase": "Pending"}}


POD_UID = "6f1c0c8e-1f7e-4b63-9c55-0d3c1a0d7b11"


def node_list(*names: str) -> dict[str, Any]:
    """A v1.NodeList as kube-scheduler sends it to an extender that is not nodeCacheCapable."""
    return {"metadata": {"resourceVersion": "99"},
            "items": [{"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}},
                       "status": {"capacity": {"cpu": "8", "nvidia.com/gpu": "4"}}} for n in names]}


def service_with_nodes(store: JobStore, nodes: dict[str, tuple[int, int]], profile: str = "dlshare") -> SchedulerService:
    """The service in-process, without a broker, that has heard telemetry from ``nodes``
    (id -> (GPUs, cores)) and handed it to its core."""
    svc = SchedulerService(store, profile=profile)
    for node, (gpus, cpus) in nodes.items():
        svc.translator.on_telemetry(telemetry_from(telemetry(node, gpus, cpus)))
    svc.round()  # the core learns the nodes
    return svc


class LiveServices:
    """Starts :class:`SchedulerService` against a real broker (fast ticks and timeouts) and stops
    whatever is still running at the end (the ``live_service`` fixture)."""

    def __init__(self, broker_url: str, tmp: Path) -> None:
        self.broker_url, self.tmp = broker_url, tmp
        self.running: list[SchedulerService] = []

    async def start(self, db: Path | None = None, profile: str = "dlshare", **kw: Any) -> SchedulerService:
        kw = {"tick_s": 0.2, "command_timeout_s": 3, "node_timeout_s": 5, "rules": FAST_RULES, **kw}
        svc = SchedulerService(JobStore(db or self.tmp / "sched.db", synchronous="NORMAL"), profile=profile,
                               broker_url=self.broker_url, **kw)
        self.running.append(svc)
        await svc.start()
        await asyncio.wait_for(svc.bus.connected.wait(), 10)
        return svc

    async def stop(self, svc: SchedulerService) -> None:
        """Stop ``svc`` and close its store (as a service that exits does)."""
        if svc in self.running:
            self.running.remove(svc)
            await svc.stop()
            svc.store.close()

    async def stop_all(self) -> None:
        for svc in list(self.running):
            await self.stop(svc)


class FakeNodes:
    """Starts :class:`FakeNode` s on a broker and stops the ones still up at the end (``fake_node``)."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self.nodes: list[FakeNode] = []

    async def start(self, node_id: str, **kw: Any) -> FakeNode:
        node = await FakeNode(self.broker_url, node_id, **kw).start()
        self.nodes.append(node)
        return node

    async def stop_all(self) -> None:
        for node in self.nodes:
            if node.task is not None and not node.task.done():
                await node.stop()
