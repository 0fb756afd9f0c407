"""A fleet of simulated node daemons for the scheduler service's scale tests.

Each shard is a process (``python -m bench.fleet``) that runs many nodes, each with its own MQTT
connection to the broker, speaking the node daemon's contract for real:

* a retained ``state`` (``online``) with a Last Will that sets it ``offline`` (a ``kill -9`` of
  the shard makes the broker publish every one of its nodes' wills at once);
* telemetry every ``--interval`` seconds (QoS 0, a random phase per node), with the node's
  clock in ``ts``, its GPUs, cores, memory and the jobs it runs;
* ``run``/``stop``/``allocate``/``release``/``ping`` commands answered on ``reply`` (QoS 1),
  a repeated command id answered from a reply cache as the daemon does, a ``run`` for a job
  already running refused;
* a ``job_exit`` event when a job ends, ``--job-s`` seconds after it started, and the job
  listed as ``exited`` (with its exit code) in the telemetry of the next 300 s, as the daemon
  does, so a service that was down when the event passed still learns of the exit.

No process is started: a run is a timer.  Every start, stop and exit a node applies is
appended to ``--log`` (JSON lines, written as it happens, so a ``kill -9`` keeps them), and
:func:`double_starts` reads those logs back: a job whose runs overlap in time, or that ran
more often than the service placed it, started twice.

:class:`Fleet` starts and stops shards from a benchmark or a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent


def raise_fd_limit(want: int = 16384) -> None:
    """Many connections need many descriptors: raise the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, want)) if hard != resource.RLIM_INFINITY else max(soft, want)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class SimNode:
    """One simulated node daemon (see the module docstring)."""

    def __init__(self, shard: "Shard", node_id: str) -> None:
        self.shard = shard
        self.id = node_id
        self.running: dict[str, float] = {}  # job -> when it ends (monotonic)
        self.exited: dict[str, tuple[int, float]] = {}  # job -> (exit code, when), listed for 300 s as the daemon does
        self.replies: OrderedDict[str, bytes] = OrderedDict()
        self.bus = None
        self.task: asyncio.Task | None = None
        self.stop = asyncio.Event()
        self.next_t = time.monotonic() + random.uniform(0.0, shard.interval)

    async def start(self) -> None:
        from nodesvc.bus import messages
        from nodesvc.bus.mqtt import Bus

        async def online(bus) -> None:
            await bus.publish(messages.node_topic(self.id, "state"), messages.encode({"status": "online"}), 1, True)

        self.bus = Bus(self.shard.broker, f"fleet-{self.id}-{os.getpid()}",
                       subscriptions=[(messages.node_topic(self.id, "cmd"), 1)], handler=self.on_cmd,
                       on_connect=online, keepalive=30,
                       will=(messages.node_topic(self.id, "state"), messages.encode({"status": "offline"}), 1, True))
        self.task = asyncio.create_task(self.bus.run(self.stop))
        await asyncio.wait_for(self.bus.connected.wait(), 60)

    async def on_cmd(self, topic: str, payload: bytes) -> None:
        from nodesvc.bus import messages

        cmd = messages.parse_command(payload)
        took = time.time()
        cached = self.replies.get(cmd.id)
        if cached is not None:
            await self.bus.publish(messages.node_topic(self.id, "reply"), cached, 1)
            return
        job = cmd.args.get("job")
        ok, error = True, None
        if cmd.op == "run":
            if job in self.running:
                ok, error = False, f"job {job} is already running"
            else:
                self.exited.pop(job, None)
                self.running[job] = time.monotonic() + self.shard.job_s
                self.shard.record("run", self.id, job, cmd.id)
        elif cmd.op == "stop":
            if self.running.pop(job, None) is not None:
                self.shard.record("stop", self.id, job, cmd.id)
                self.exited[job] = (-15, time.monotonic())
                await self.exit(job, -15)
        elif cmd.op not in ("allocate", "release", "ping"):
            ok, error = False, f"unknown op {cmd.op!r}"
        reply = messages.reply(cmd.id, ok, {"op": cmd.op}, error=error, ts=took)
        self.replies[cmd.id] = reply
        while len(self.replies) > 4096:
            self.replies.popitem(last=False)
        # As the daemon does: the reply leaves without the pump waiting for its acknowledgement.
        task = asyncio.create_task(self.bus.publish(messages.node_topic(self.id, "reply"), reply, 1))
        self.shard.pending.add(task)
        task.add_done_callback(self.shard.pending.discard)

    async def exit(self, job: str, code: int) -> None:
        from nodesvc.bus import messages

        await self.bus.publish(messages.node_topic(self.id, "events"),
                               messages.encode({"event": "job_exit", "job": job, "exit_code": code}), 1)

    async def tick(self, now: float) -> None:
        from nodesvc.bus import messages

        for job in [j for j, end in self.running.items() if end <= now]:
            del self.running[job]
            self.shard.record("exit", self.id, job, "")
            self.exited[job] = (0, now)
            await self.exit(job, 0)
        for job in [j for j, (_, t) in self.exited.items() if now - t > 300.0]:
            del self.exited[job]
        if now >= self.next_t:
            self.next_t = now + self.shard.interval
            s = self.shard
            t = {"node": self.id, "ts": time.time(), "cpu": {"count": s.cpus, "percent": 10.0},
                 "memory": {"total_bytes": s.memory, "available_bytes": s.memory // 2},
                 "gpus": {"devices": [{"index": g, "util_percent": 50.0, "memory_total_bytes": 32 << 30}
                                      for g in range(s.gpus)], "reason": None, "simulated": True},
                 "rdma": {"devices": []},
                 "jobs": {**{j: {"pids": [], "state": "exited", "exit_code": code} for j, (code, _) in self.exited.items()},
                          **{j: {"pids": [1], "state": "running"} for j in self.running}}}
            await self.bus.publish(messages.node_topic(self.id, "telemetry"), messages.encode(t))

    async def close(self) -> None:
        from nodesvc.bus import messages

        if self.bus is not None and self.bus.connected.is_set():
            await self.bus.publish(messages.node_topic(self.id, "state"), messages.encode({"status": "offline"}), 1,
                                   True)
        self.stop.set()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class Shard:
    """The nodes of one process."""

    broker: str
    ids: list[str]
    gpus: int = 8
    cpus: int = 64
    memory: int = 512 << 30
    interval: float = 5.0
    job_s: float = 30.0
    log: TextIO | None = None
    nodes: list[SimNode] = field(default_factory=list)
    pending: set = field(default_factory=set)  # replies on their way to the broker

    def record(self, op: str, node: str, job: str, cmd: str) -> None:
        if self.log is not None:
            self.log.write(json.dumps({"t": time.time(), "op": op, "node": node, "job": job, "cmd": cmd}) + "\n")

    async def run(self, stop: asyncio.Event) -> None:
        self.nodes = [SimNode(self, i) for i in self.ids]
        for k in range(0, len(self.nodes), 50):  # connect in waves, not all at once
            await asyncio.gather(*(n.start() for n in self.nodes[k:k + 50]))
        print("ready", flush=True)
        while not stop.is_set():
            now = time.monotonic()
            for n in self.nodes:
                await n.tick(now)
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass
        await asyncio.gather(*(n.close() for n in self.nodes), return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="simulated node daemons (see bench/fleet.py)")
    ap.add_argument("--broker", required=True)
    ap.add_argument("--prefix", default="fleet")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--cpus", type=int, default=64)
    ap.add_argument("--memory-gib", type=int, default=512)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between telemetry reports")
    ap.add_argument("--job-s", type=float, default=30.0, help="how long a job runs")
    ap.add_argument("--log", help="JSON lines of every start, stop and exit applied")
    a = ap.parse_args(argv)
    raise_fd_limit()
    log = open(a.log, "a", buffering=1) if a.log else None  # line-buffered: each record reaches the kernel
    shard = Shard(a.broker, [f"{a.prefix}-{i:04d}" for i in range(a.first, a.first + a.nodes)], a.gpus, a.cpus,
                  a.memory_gib << 30, a.interval, a.job_s, log)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await shard.run(stop)

    asyncio.run(go())


class Fleet:
    """Shards of simulated nodes as processes: ``start`` them, ``kill`` one (SIGKILL: its nodes'
    Last Wills fire at once), ``stop`` the rest (they say offline first)."""

    def __init__(self, broker: str, workdir: Path, gpus: int = 8, cpus: int = 64, interval: float = 5.0,
                 job_s: float = 30.0) -> None:
        self.broker, self.workdir = broker, Path(workdir)
        self.gpus, self.cpus, self.interval, self.job_s = gpus, cpus, interval, job_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.killed: dict[str, float] = {}  # shard -> when it was killed (time.time())
        self.ids: dict[str, list[str]] = {}
        self.ready: set[str] = set()  # shards that said so (wait_ready waits only for the others)

    def start(self, name: str, nodes: int, first: int = 0, prefix: str = "fleet", job_s: float | None = None) -> None:
        """Start shard ``name`` of ``nodes`` nodes; ``job_s``: how long its jobs run (the fleet's by default)."""
        log = self.workdir / f"fleet-{name}.jsonl"
        self.logs.append(log)
        self.ids[name] = [f"{prefix}-{i:04d}" for i in range(first, first + nodes)]
        cmd = [sys.executable, "-m", "bench.fleet", "--broker", self.broker, "--prefix", prefix, "--first", str(first),
               "--nodes", str(nodes), "--gpus", str(self.gpus), "--cpus", str(self.cpus),
               "--interval", str(self.interval), "--job-s", str(self.job_s if job_s is None else job_s), "--log", str(log)]
        err = open(self.workdir / f"fleet-{name}.err", "ab")
        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                            preexec_fn=raise_fd_limit)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            if name in self.ready:
                continue
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"fleet shard {name} exited with {p.returncode} before it was ready "
                                       f"(see {self.workdir / f'fleet-{name}.err'})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"fleet shard {name} not ready within {timeout:g}s")
                line = _readline(p, left)
                if line is not None and line.strip() == "ready":
                    self.ready.add(name)
                    break

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        self.killed[name] = time.time()
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def records(self) -> list[dict[str, Any]]:
        out = []
        for log in self.logs:
            if log.exists():
                for line in log.read_text().splitlines():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut short by a kill -9
        return out

    def node_deaths(self) -> dict[str, float]:
        """node -> when its shard was killed."""
        return {n: t for name, t in self.killed.items() for n in self.ids[name]}


def _readline(p: subprocess.Popen, timeout: float) -> str | None:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return None
        return p.stdout.readline()
    finally:
        sel.close()


def double_starts(records: list[dict[str, Any]], deaths: dict[str, float],
                  placements: dict[str, int] | None = None) -> list[str]:
    """Jobs that started twice: two runs that overlap in time (a run lasts until its stop, its
    exit or its node's death), or more runs than the service placed the job (``placements``)."""
    runs: dict[str, list[list[Any]]] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        if r["op"] == "run":
            runs.setdefault(r["job"], []).append([r["node"], r["t"], None])
        elif r["op"] in ("stop", "exit"):
            for run in runs.get(r["job"], []):
                if run[0] == r["node"] and run[2] is None:
                    run[2] = r["t"]
                    break
    bad = []
    for job, rs in runs.items():
        spans = sorted((t0, t1 if t1 is not None else deaths.get(node, float("inf")), node) for node, t0, t1 in rs)
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1 - 1e-3:
                bad.append(f"{job}: runs on {an} and {bn} overlap ({a0:.3f}-{a1:.3f} and {b0:.3f}-{b1:.3f})")
        if placements is not None and len(rs) > placements.get(job, 0):
            bad.append(f"{job}: {len(rs)} runs, {placements.get(job, 0)} placements")
    return bad


if __name__ == "__main__":
    main()
