"""``dlshare status``: every node, aggregation server and scheduler, from the broker's retained state.

Each daemon keeps a retained ``.../state`` message up to date with a summary of
its latest telemetry, so status needs no waiting for the next telemetry period.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiomqtt

from nodesvc import messages
from nodesvc.bus import parse_broker_url


def _gib(n: Any) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{n / 2**30:.1f}"


def summarize(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pure: retained state payloads by topic -> the status document (also the --json output)."""
    nodes, aggs, scheds = [], [], []
    borrowed: dict[str, int] = {}
    for topic, st in states.items():
        try:
            kind, ident, leaf = messages.parse_topic(topic)
        except messages.PayloadError:
            continue
        if leaf != "state":
            continue
        if kind == "node":
            s = st.get("summary") or {}
            donor = s.get("donor") or {}
            for consumer, nbytes in (donor.get("lent_to") or {}).items():
                if isinstance(nbytes, int):
                    borrowed[consumer] = borrowed.get(consumer, 0) + nbytes
            nodes.append({
                "node": ident,
                "status": st.get("status", "unknown"),
                "cpus": s.get("cpu_count"),
                "cpu_percent": s.get("cpu_percent"),
                "memory_total_bytes": s.get("memory_total_bytes"),
                "memory_available_bytes": s.get("memory_available_bytes"),
                "gpus": s.get("gpus"),
                "gpu_util_percent": s.get("gpu_util_percent"),
                "gpus_simulated": s.get("gpus_simulated"),
                "jobs_running": s.get("jobs_running"),
                "lendable_bytes": donor.get("lendable_bytes"),
                "lent_bytes": donor.get("lent_bytes"),
                "age_s": round(time.time() - st["ts"], 1) if isinstance(st.get("ts"), (int, float)) else None,
                "reason": st.get("reason"),
            })
        elif kind == "agg":
            s = st.get("summary") or st
            aggs.append({"server": ident, "status": st.get("status", "unknown"), "addr": st.get("addr"),
                         "cores": s.get("cores"), "min_cores": s.get("min_cores"), "max_cores": s.get("max_cores"),
                         "busy": s.get("busy", s.get("load")), "jobs": s.get("jobs")})
        elif kind == "sched":
            scheds.append({"scheduler": ident, "status": st.get("status", "unknown"), "url": st.get("url"),
                           "jobs": st.get("jobs")})
    for n in nodes:
        n["borrowed_bytes"] = borrowed.get(n["node"], 0)
    key = lambda r: str(next(iter(r.values())))  # noqa: E731
    return {"nodes": sorted(nodes, key=key), "aggregators": sorted(aggs, key=key), "schedulers": sorted(scheds, key=key)}


async def gather(broker: str, settle_s: float = 0.4, timeout_s: float = 3.0) -> dict[str, dict[str, Any]]:
    """Collect retained state messages until none arrive for ``settle_s`` (or ``timeout_s``)."""
    addr = parse_broker_url(broker)
    states: dict[str, dict[str, Any]] = {}
    async with aiomqtt.Client(addr.host, addr.port, username=addr.username, password=addr.password,
                              identifier=f"dlshare-status-{time.monotonic_ns()}", timeout=5) as client:
        await client.subscribe("dlshare/v1/+/+/state", qos=1)
        deadline = time.monotonic() + timeout_s
        it = client.messages.__aiter__()
        while time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(it.__anext__(), timeout=settle_s)
            except TimeoutError:
                break
            try:
                states[str(msg.topic)] = messages.decode(msg.payload)
            except messages.PayloadError:
                continue
    return states


def render(doc: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=132)
    t = Table(title="nodes (memory in GiB)", title_justify="left")
    for col in ("node", "status", "CPU", "mem free/total", "GPUs util%", "lendable", "lent", "borrowed", "jobs"):
        t.add_column(col, overflow="fold")
    for n in doc["nodes"]:
        online = n["status"] == "online"
        gpus = "-" if n["gpus"] is None else f"{n['gpus']}" + (
            f":{','.join(str(u) for u in n['gpu_util_percent'] or [])}" if n["gpus"] else "")
        if n.get("gpus_simulated"):
            gpus += " (sim)"
        cpu = "-" if n["cpus"] is None else f"{n['cpu_percent']:.0f}%/{n['cpus']}"
        t.add_row(n["node"], f"[green]{n['status']}[/]" if online else f"[red]{n['status']}[/]", cpu,
                  f"{_gib(n['memory_available_bytes'])}/{_gib(n['memory_total_bytes'])}", gpus,
                  _gib(n["lendable_bytes"]), _gib(n["lent_bytes"]), _gib(n["borrowed_bytes"]),
                  "-" if n["jobs_running"] is None else str(n["jobs_running"]))
    console.print(t)
    if doc["aggregators"]:
        a = Table(title="aggregation servers", title_justify="left")
        for col in ("server", "status", "address", "cores (min-max)", "busy", "jobs"):
            a.add_column(col)
        for s in doc["aggregators"]:
            jobs = s["jobs"]
            a.add_row(s["server"], s["status"], str(s["addr"] or "-"),
                      f"{s['cores']} ({s['min_cores']}-{s['max_cores']})", str(s["busy"]),
                      str(len(jobs) if isinstance(jobs, (list, dict)) else jobs))
        console.print(a)
    if doc["schedulers"]:
        s_t = Table(title="schedulers", title_justify="left")
        for col in ("scheduler", "status", "url", "jobs"):
            s_t.add_column(col)
        for s in doc["schedulers"]:
            s_t.add_row(s["scheduler"], s["status"], str(s["url"] or "-"), json.dumps(s["jobs"]) if s["jobs"] else "-")
        console.print(s_t)


def _run(args, cfg) -> int:
    try:
        states = asyncio.run(gather(cfg["dlshare"]["broker"], timeout_s=args.timeout))
    except aiomqtt.MqttError as exc:
        print(f"dlshare status: cannot reach broker {cfg['dlshare']['broker']}: {exc}", file=sys.stderr)
        return 1
    doc = summarize(states)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render(doc)
    return 0


def register(sub) -> None:
    from nodesvc.cli import add_command, config_flag

    p = add_command(sub, "status", _run, "show nodes, lent memory, aggregation load and schedulers")
    config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for retained state")
