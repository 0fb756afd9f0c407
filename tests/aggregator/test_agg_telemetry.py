"""MQTT telemetry, retained state with Last Will, and commands, against a real mosquitto."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import aiomqtt
import numpy as np

from aggregator import Client
from aggregator.cli import resolve
from aggregator.server import serve
from nodesvc.bus import config, messages
from nodesvc.bus.procs import free_port
from tests.aggregator.aggtest import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _watch(port: int, topic: str, until, publish=None, timeout: float = 20.0) -> list[tuple[str, dict]]:
    got: list[tuple[str, dict]] = []
    async with aiomqtt.Client("127.0.0.1", port, identifier=f"agg-test-{id(got)}") as c:
        await c.subscribe(topic, qos=1)

        async def loop():
            sent = False
            async for m in c.messages:
                if str(m.topic).endswith("/cmd"):
                    continue
                got.append((str(m.topic), json.loads(m.payload)))
                if publish and not sent and any(t.endswith("/state") for t, _ in got):
                    await publish(c)
                    sent = True
                if until(got):
                    return

        await asyncio.wait_for(loop(), timeout)
    return got


async def test_telemetry_state_and_commands(mosquitto):
    port = free_port()
    cfg = resolve(config.load(env={}, flags={
        "agg": {"listen": f"127.0.0.1:{port}", "id": "aggT", "telemetry_interval_s": 0.3, "max_cores": 2},
        "dlshare": {"broker": mosquitto.url}}))
    stop, ready = threading.Event(), threading.Event()
    th = threading.Thread(target=serve, args=(cfg, stop, ready), daemon=True)
    th.start()
    assert await asyncio.to_thread(ready.wait, 10)

    def work(rank):
        with Client([f"127.0.0.1:{port}"], "tele", rank, 2) as c:
            x = np.ones(100_000, np.float32)
            c.allreduce(x)
            return x

    await asyncio.to_thread(run_ranks, 2, work)
    clients = [Client([f"127.0.0.1:{port}"], "tele2", r, 2) for r in range(2)]
    for c in clients:
        c.links[f"127.0.0.1:{port}"].ensure()

    async def commands(c):
        await c.publish(messages.topic("agg", "aggT", "cmd"), messages.command("ping", "c1"), qos=1)
        await c.publish(messages.topic("agg", "aggT", "cmd"), b"{not json", qos=1)
        await c.publish(messages.topic("agg", "aggT", "cmd"), messages.command("drain", "c2"), qos=1)

    def done(got):
        replies = [b for t, b in got if t.endswith("/reply")]
        tele = [b for t, b in got if t.endswith("/telemetry") and "tele2" in b["jobs"]]
        states = [b for t, b in got if t.endswith("/state") and "tele2" in b.get("summary", {}).get("jobs", [])]
        # the retained state follows each telemetry message: wait for one that shows the drain too
        return len(replies) >= 3 and tele and tele[-1]["draining"] and states and states[-1]["summary"]["draining"]

    got = await _watch(_port(mosquitto.url), "dlshare/v1/agg/aggT/#", done, publish=commands)
    state = [b for t, b in got if t.endswith("/state")]
    assert state[0]["status"] == "online" and state[0]["address"] == f"127.0.0.1:{port}"
    summ = state[-1]["summary"]  # the load summary `dlshare status` reads from retained state
    assert summ["draining"]
    assert summ["min_cores"] == 1 and summ["max_cores"] == 2 and 1 <= summ["cores"] <= 2
    assert "tele2" in summ["jobs"] and 0.0 <= summ["busy"] <= 1.0
    replies = {b.get("id"): b for t, b in got if t.endswith("/reply")}
    assert replies["c1"]["ok"] and replies["c1"]["result"] == {"pong": True}
    assert replies["c2"]["ok"] and replies["c2"]["result"] == {"draining": True}
    assert not replies[None]["ok"] and "not JSON" in replies[None]["error"]
    tele = [b for t, b in got if t.endswith("/telemetry")][-1]
    assert tele["schema"] == 1 and tele["server"] == "aggT" and tele["bytes_in"] >= 2 * 400_000
    assert {"size", "min", "max", "busy_fraction", "cores_avg"} <= set(tele["pool"])
    assert tele["jobs"]["tele2"]["world"] == 2 and "bytes_in_per_s" in tele
    for c in clients:
        c.close()
    stop.set()
    await asyncio.to_thread(th.join, 10)
    got = await _watch(_port(mosquitto.url), "dlshare/v1/agg/aggT/state", lambda g: len(g) >= 1)
    assert got[-1][1]["status"] == "offline"  # retained, published on an orderly stop


async def test_last_will_marks_a_killed_server_offline(mosquitto):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--listen", f"127.0.0.1:{port}", "--broker",
                          mosquitto.url, "--id", "aggW"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        mport = _port(mosquitto.url)
        got = await _watch(mport, "dlshare/v1/agg/aggW/state", lambda g: g[-1][1]["status"] == "online")
        p.kill()
        p.wait(timeout=10)
        got = await _watch(mport, "dlshare/v1/agg/aggW/state", lambda g: g[-1][1]["status"] == "offline")
        assert got[-1][1]["server"] == "aggW"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
