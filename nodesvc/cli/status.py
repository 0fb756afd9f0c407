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

from nodesvc.bus import messages
from nodesvc.bus.commands import check_broker
from nodesvc.bus.mqtt import parse_broker_url


def _gib(n: Any) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{n / 2**30:.1f}"


def _d(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _num(v: Any) -> float | int | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _borrowed(n: dict[str, Any]) -> str:
    total = _gib(n["borrowed_bytes"])
    donors = n.get("borrowed_from") or {}
    return f"{total} from {', '.join(donors)}" if donors else total


def summarize(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pure: retained state payloads by topic -> the status document (also the --json output).

    Anyone may publish a retained message, so every field is type-checked: a
    malformed one shows as missing, never as a crash.
    """
    nodes, aggs, scheds, caches = [], [], [], []
    borrowed: dict[str, dict[str, int]] = {}  # consumer -> donor -> bytes
    for topic, st in states.items():
        try:
            kind, ident, leaf = messages.parse_topic(topic)
        except messages.PayloadError:
            continue
        if kind == "cache" and leaf == "manifest" and isinstance(st, dict):
            # a named sample cache's manifest: its sealed part is for the jobs that know the secret;
            # the public part says whose it is and what it holds on donors
            pub = _d(st.get("public"))
            caches.append({"cache": ident, "owner": _str(pub.get("owner")), "slots": _num(pub.get("slots")),
                           "donor_bytes": _num(pub.get("donor_bytes")), "copies": _num(pub.get("copies"))})
            continue
        if leaf != "state" or not isinstance(st, dict):
            continue
        status = _str(st.get("status")) or "unknown"
        if kind == "node":
            s = _d(st.get("summary"))
            donor = _d(s.get("donor"))
            for consumer, nbytes in _d(donor.get("lent_to")).items():
                if isinstance(nbytes, int) and not isinstance(nbytes, bool):
                    by_donor = borrowed.setdefault(consumer, {})
                    by_donor[ident] = by_donor.get(ident, 0) + nbytes
            utils = s.get("gpu_util_percent")
            ts = _num(st.get("ts"))
            nodes.append({
                "node": ident,
                "status": status,
                "cpus": _num(s.get("cpu_count")),
                "cpu_percent": _num(s.get("cpu_percent")),
                "memory_total_bytes": _num(s.get("memory_total_bytes")),
                "memory_available_bytes": _num(s.get("memory_available_bytes")),
                "gpus": _num(s.get("gpus")),
                "gpu_util_percent": [_num(u) for u in utils] if isinstance(utils, list) else [],
                "gpus_simulated": bool(s.get("gpus_simulated")),
                "jobs_running": _num(s.get("jobs_running")),
                "lendable_bytes": _num(donor.get("lendable_bytes")),
                "lent_bytes": _num(donor.get("lent_bytes")),
                "age_s": round(time.time() - ts, 1) if ts is not None else None,
                "reason": _str(st.get("reason")),
            })
        elif kind == "agg":
            s = _d(st.get("summary")) or st
            aggs.append({"server": ident, "status": status,
                         "addr": _str(st.get("addr")) or _str(st.get("address")),
                         "cores": _num(s.get("cores")), "min_cores": _num(s.get("min_cores")),
                         "max_cores": _num(s.get("max_cores")), "busy": _num(s.get("busy", s.get("load"))),
                         "jobs": s.get("jobs") if isinstance(s.get("jobs"), (list, dict, int)) else None,
                         "draining": s.get("draining") is True, "drained": s.get("drained") is True})
        elif kind == "sched":
            scheds.append({"scheduler": ident, "status": status, "url": _str(st.get("url")),
                           "jobs": st.get("jobs") if isinstance(st.get("jobs"), (dict, int)) else None})
    for n in nodes:
        # what the node's jobs (regions, spill caches: consumers named after their node) borrow, and from whom
        n["borrowed_from"] = dict(sorted(borrowed.get(n["node"], {}).items()))
        n["borrowed_bytes"] = sum(n["borrowed_from"].values())
    key = lambda r: str(next(iter(r.values())))  # noqa: E731
    return {"nodes": sorted(nodes, key=key), "aggregators": sorted(aggs, key=key), "schedulers": sorted(scheds, key=key),
            "caches": sorted(caches, key=key)}


async def gather(broker: str, settle_s: float = 0.4, timeout_s: float = 3.0) -> dict[str, dict[str, Any]]:
    """Collect retained state messages until none arrive for ``settle_s`` (or ``timeout_s``).

    The broker sends what it retains, flagged as retained, in a burst right after the subscription;
    what the services publish after that arrives unflagged.  Only the retained ones keep the wait
    going: a busy cluster publishes state every few seconds per service, so a wait for the bus to go
    quiet would always run to ``timeout_s``.  A live update that arrives before the end is kept (it is
    newer than the retained copy of its topic)."""
    import aiomqtt

    addr = parse_broker_url(broker)
    states: dict[str, dict[str, Any]] = {}
    async with aiomqtt.Client(**addr.client_args(), identifier=f"dlshare-status-{time.monotonic_ns()}",
                              timeout=5) as client:
        await client.subscribe("dlshare/v1/+/+/state", qos=1)
        await client.subscribe("dlshare/v1/cache/+/manifest", qos=1)
        deadline = time.monotonic() + timeout_s
        quiet_at = time.monotonic() + settle_s  # when the retained burst counts as over
        it = client.messages.__aiter__()
        while (wait := min(deadline, quiet_at) - time.monotonic()) > 0:
            try:
                msg = await asyncio.wait_for(it.__anext__(), timeout=wait)
            except TimeoutError:
                break
            if msg.retain:
                quiet_at = time.monotonic() + settle_s
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
        cpu = "-" if n["cpus"] is None or n["cpu_percent"] is None else f"{n['cpu_percent']:.0f}%/{n['cpus']}"
        t.add_row(n["node"], f"[green]{n['status']}[/]" if online else f"[red]{n['status']}[/]", cpu,
                  f"{_gib(n['memory_available_bytes'])}/{_gib(n['memory_total_bytes'])}", gpus,
                  _gib(n["lendable_bytes"]), _gib(n["lent_bytes"]), _borrowed(n),
                  "-" if n["jobs_running"] is None else str(n["jobs_running"]))
    console.print(t)
    if doc["aggregators"]:
        a = Table(title="aggregation servers", title_justify="left")
        for col in ("server", "status", "address", "cores (min-max)", "busy", "jobs"):
            a.add_column(col)
        for s in doc["aggregators"]:
            jobs = s["jobs"]
            cores = "-" if s["cores"] is None else f"{s['cores']} ({s['min_cores']}-{s['max_cores']})"
            busy = "-" if s["busy"] is None else f"{s['busy']:.2f}"
            status = s["status"]
            if s.get("draining") and status == "online":
                status += " [yellow](drained)[/]" if s.get("drained") else " [yellow](draining)[/]"
            a.add_row(s["server"], status, str(s["addr"] or "-"), cores, busy,
                      "-" if jobs is None else str(len(jobs) if isinstance(jobs, (list, dict)) else jobs))
        console.print(a)
    if doc["schedulers"]:
        s_t = Table(title="schedulers", title_justify="left")
        for col in ("scheduler", "status", "url", "jobs"):
            s_t.add_column(col)
        for s in doc["schedulers"]:
            jobs = s["jobs"]
            if isinstance(jobs, dict):  # {"waiting": 3, "running": 5}: "3 waiting, 5 running"
                jobs = ", ".join(f"{v} {k}" for k, v in jobs.items())
            s_t.add_row(s["scheduler"], s["status"], str(s["url"] or "-"), str(jobs) if jobs not in (None, "") else "-")
        console.print(s_t)
    _render_caches(doc, console)


def _render_caches(doc: dict[str, Any], console) -> None:
    from rich.table import Table

    if not doc.get("caches"):
        return
    t = Table(title="named sample caches (on donors, GiB, every copy)", title_justify="left")
    for col in ("cache", "owner", "samples", "on donors"):
        t.add_column(col)
    for c in doc["caches"]:
        t.add_row(c["cache"], c["owner"] or "-", "-" if c["slots"] is None else str(c["slots"]), _gib(c["donor_bytes"]))
    console.print(t)


def _run(args, cfg) -> int:
    import aiomqtt

    shown = check_broker(cfg["dlshare"]["broker"])
    try:
        states = asyncio.run(gather(cfg["dlshare"]["broker"], timeout_s=args.timeout))
    except aiomqtt.MqttError as exc:  # a TLS handshake that fails too (its certificate, its name)
        print(f"dlshare status: cannot reach broker {shown}: {exc}", file=sys.stderr)
        return 1
    doc = summarize(states)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render(doc)
    return 0


def register(cli) -> None:
    p = cli.add("status", _run, "show nodes, lent memory, aggregation load and schedulers", quiet=True)
    cli.config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for retained state")
