"""The scripted tour that ``dlshare up --tour`` (the README's ``make demo``) runs.

It shows the foundation at work on the running stack (nodes online, a job held
to half a core by its cgroup, a job over its memory limit stopped by the
kernel), then hands over to the other parts' tours (entry-point group ``dlshare.tour``: the
scheduler service's, when that part is installed), and ends with the status table.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from typing import Any

import aiomqtt

from nodesvc.bus import messages
from nodesvc.cli import TOUR_GROUP, load_entry_points, status
from nodesvc.bus.mqtt import parse_broker_url
from nodesvc.bus.rpc import CommandError, NodeClient


async def wait_nodes(broker: str, node_ids: list[str], timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            doc = status.summarize(await status.gather(broker, settle_s=0.3, timeout_s=2))
        except aiomqtt.MqttError:
            await asyncio.sleep(0.3)
            continue
        online = {n["node"] for n in doc["nodes"] if n["status"] == "online" and n["cpus"] is not None}
        if set(node_ids) <= online:
            return doc
        await asyncio.sleep(0.3)
    raise TimeoutError(f"nodes {node_ids} not all online after {timeout}s: {doc}")


async def job_usage(broker: str, node: str, job: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The job's entry in the node's next telemetry message that shows it running."""
    addr = parse_broker_url(broker)
    async with aiomqtt.Client(**addr.client_args(), identifier=f"dlshare-tour-{time.monotonic_ns()}") as c:
        await c.subscribe(messages.node_topic(node, "telemetry"))
        deadline = time.monotonic() + timeout
        it = c.messages.__aiter__()
        seen = 0
        while time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(it.__anext__(), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            j = messages.decode(msg.payload).get("jobs", {}).get(job)
            if j and j["state"] == "running":
                seen += 1
                if seen >= 2:  # the first sample only primes the CPU counter
                    return j
    return None


BUSY = "import time\nt=time.time()\nwhile time.time()-t<{s}: pass\n"
HOG = "b=bytearray({n})\nfor i in range(0,len(b),4096): b[i]=1\nimport time; time.sleep(5)\n"


async def enforcement_demo(st, console) -> bool:
    node = st.node_ids[0]
    ok = True
    async with NodeClient(st.broker_url) as nc:
        console.print(f"\n[bold]1. Enforcement[/bold]: a busy loop on {node}, held to 0.5 CPU by its cgroup")
        try:
            await nc.call(node, "run", job="tour-busy", argv=[sys.executable, "-c", BUSY.format(s=8)],
                          cpus=0.5, memory_bytes=256 << 20)
        except CommandError as exc:
            console.print(f"  [yellow]not applied: {exc}[/yellow]")
            return False
        u = await job_usage(st.broker_url, node, "tour-busy", timeout=12)
        if u is None:
            console.print("  [red]no telemetry for the job[/red]")
            ok = False
        else:
            console.print(f"  measured {u['cpu_percent']:.0f}% of one core (limit 50%), RSS {u['rss_bytes'] >> 20} MiB")
            ok &= u["cpu_percent"] < 70
        await nc.call(node, "stop", job="tour-busy")
        await nc.call(node, "release", job="tour-busy")
        console.print("\n[bold]2. Memory limit[/bold]: a job that touches 256 MiB under a 64 MiB limit")
        while not nc.events.empty():
            nc.events.get_nowait()
        await nc.call(node, "run", job="tour-hog", argv=[sys.executable, "-c", HOG.format(n=256 << 20)],
                      memory_bytes=64 << 20)
        deadline = time.monotonic() + 15
        ev = None
        while time.monotonic() < deadline:
            try:
                e = await asyncio.wait_for(nc.events.get(), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            if e.get("job") == "tour-hog":
                ev = e
                break
        if ev is None:
            console.print("  [red]the job did not end[/red]")
            ok = False
        else:
            console.print(f"  exit code {ev['exit_code']}, killed by the OOM killer: {ev['oom_killed']}")
            ok &= bool(ev["oom_killed"]) or ev["exit_code"] in (-9, 137)
        await nc.call(node, "release", job="tour-hog")
    return ok


def _still_running(doc: dict) -> bool:
    """A node's telemetry, or an online scheduler's state, still counts a running job."""
    if any(n["jobs_running"] for n in doc["nodes"]):
        return True
    return any(s["status"] == "online" and isinstance(s["jobs"], dict) and s["jobs"].get("running")
               for s in doc["schedulers"])


async def settled_status(broker_url: str, timeout_s: float = 15.0) -> dict:
    """The status once every node's telemetry and every scheduler's state show the tour's jobs gone
    (the jobs ended a moment ago; the sample before that still counts them), or what there is after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = status.summarize(await status.gather(broker_url))
        if not _still_running(doc) or time.monotonic() >= deadline:
            return doc
        await asyncio.sleep(0.5)


async def run_tour(st, console) -> bool:
    console.print("\n[bold]0. The cluster[/bold] (dlshare status)")
    status.render(status.summarize(await status.gather(st.broker_url)), console)
    ok = await enforcement_demo(st, console)
    for _name, part in load_entry_points(TOUR_GROUP) if st.sched_url else ():
        res = part(st, console)
        if inspect.isawaitable(res):
            res = await res
        ok &= res is not False
    console.print("\n[bold]Final status[/bold]")
    status.render(await settled_status(st.broker_url), console)
    console.print("[bold green]tour complete[/bold green]" if ok else "[bold red]tour finished with failures[/bold red]")
    return ok
