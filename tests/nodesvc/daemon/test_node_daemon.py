"""The node daemon as a real process against real brokers (mosquitto and the embedded amqtt)."""

import asyncio
import json
import os
import sys
import time
import urllib.request

import aiomqtt
import pytest

from nodesvc.bus import messages
from nodesvc.bus.mqtt import parse_broker_url
from nodesvc.bus.procs import wait_until
from nodesvc.bus.rpc import CommandError, NodeClient


async def next_message(url: str, topic: str, pred=lambda obj: True, timeout: float = 15.0) -> dict:
    a = parse_broker_url(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with aiomqtt.Client(a.host, a.port, identifier=f"t-{time.monotonic_ns()}") as c:
                await c.subscribe(topic, qos=1)
                it = c.messages.__aiter__()
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no matching message on {topic}")
                    msg = await asyncio.wait_for(it.__anext__(), timeout=left)
                    obj = messages.decode(msg.payload)
                    if pred(obj):
                        return obj
        except aiomqtt.MqttError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_telemetry_and_retained_online_state(broker, node_daemons):
    p = node_daemons(broker.url, "n-tele", "--fake-gpus", "2")
    t = await next_message(broker.url, "dlshare/v1/node/n-tele/telemetry")
    messages.parse_telemetry(json.dumps(t))
    assert t["node"] == "n-tele" and t["memory"]["total_bytes"] > 0
    assert len(t["cpu"]["per_core"]) == t["cpu"]["count"]
    if os.path.exists("/proc/pressure/memory"):
        assert "some_avg10" in t["memory"]["psi"]
    else:
        assert t["memory"]["psi"]["reason"]
    assert len(t["gpus"]["devices"]) == 2 and t["gpus"]["simulated"] is True
    assert t["rdma"]["devices"] == [] and t["rdma"]["reason"]
    st = await next_message(broker.url, "dlshare/v1/node/n-tele/state")  # retained: arrives at once
    assert st["status"] == "online"
    # the Prometheus endpoint serves node_exporter and DCGM names
    body = urllib.request.urlopen(f"http://127.0.0.1:{st['metrics_port']}/metrics", timeout=5).read().decode()
    assert "node_memory_MemAvailable_bytes" in body and 'DCGM_FI_DEV_GPU_UTIL{' in body
    assert "node_cpu_seconds_total{" in body
    p.stop()
    st = await next_message(broker.url, "dlshare/v1/node/n-tele/state")
    assert st["status"] == "offline" and st["reason"] == "stopped"


async def test_kill_9_turns_state_offline_through_last_will(broker, node_daemons):
    p = node_daemons(broker.url, "n-will")
    await next_message(broker.url, "dlshare/v1/node/n-will/state", lambda o: o["status"] == "online")
    p.kill9()
    st = await next_message(broker.url, "dlshare/v1/node/n-will/state", lambda o: o["status"] == "offline")
    assert st["reason"] == "connection lost"  # the Last Will, not a clean stop


async def test_broker_restart_daemon_reconnects(broker, node_daemons):
    p = node_daemons(broker.url, "n-rec")
    await next_message(broker.url, "dlshare/v1/node/n-rec/state", lambda o: o["status"] == "online")
    broker.stop()
    # the daemon has seen the broker go (it now retries with backoff) before the broker comes back
    wait_until(lambda: "unreachable" in p.output(), timeout=20, what="the daemon to notice the broker is gone")
    broker.start()  # same port, empty broker: no retained state survives
    st = await next_message(broker.url, "dlshare/v1/node/n-rec/state", lambda o: o["status"] == "online",
                            timeout=20)
    assert st["node"] == "n-rec"
    await next_message(broker.url, "dlshare/v1/node/n-rec/telemetry", timeout=10)
    async with NodeClient(broker.url) as nc:
        assert (await nc.call("n-rec", "ping"))["node"] == "n-rec"
    assert p.poll() is None


async def test_malformed_commands_get_error_replies_and_daemon_lives(broker, node_daemons):
    p = node_daemons(broker.url, "n-bad")
    await next_message(broker.url, "dlshare/v1/node/n-bad/state", lambda o: o["status"] == "online")
    async with NodeClient(broker.url) as nc:
        cases = [
            (b"not json at all", None, "malformed command"),
            (b'{"schema":1,"id":"b1"}', "b1", "'op'"),
            (b'{"schema":7,"id":"b2","op":"ping"}', "b2", "schema"),
            (messages.command("allocate", "b3", job="j", cpus="lots"), "b3", "cpus"),
            (messages.command("launch-missiles", "b4"), "b4", "unknown op"),
            (messages.command("run", "b5", job="j", argv=[]), "b5", "argv"),
            (messages.command("stop", "b6", job="nosuchjob"), "b6", "no job"),
            (b"\x00\xff" * 100, None, "malformed"),
        ]
        for payload, cid, needle in cases:
            r = await nc.send_raw("n-bad", payload, cid)
            assert r.get("ok") is False and needle in r.get("error", ""), (payload, r)
        assert (await nc.call("n-bad", "ping"))["node"] == "n-bad"
    assert p.poll() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")
async def test_run_under_allocation_reports_usage_and_exit(mosquitto, node_daemons):
    node_daemons(mosquitto.url, "n-run", "--allow-run", "--allow-root-jobs")
    await next_message(mosquitto.url, "dlshare/v1/node/n-run/state", lambda o: o["status"] == "online")
    async with NodeClient(mosquitto.url) as nc:
        busy = "import time\nt=time.time()\nwhile time.time()-t<4: pass\n"
        res = await nc.call("n-run", "run", job="busy", argv=[sys.executable, "-c", busy], cpus=0.5,
                            memory_bytes=128 << 20, run_id="place-7", cmd_id="run-1")
        assert res["pid"] > 0
        # a replayed command id is answered again without starting a second process
        again = await nc.call("n-run", "run", job="busy", argv=[sys.executable, "-c", busy], cmd_id="run-1")
        assert again["pid"] == res["pid"]
        t = await next_message(
            mosquitto.url, "dlshare/v1/node/n-run/telemetry",
            lambda o: o["jobs"].get("busy", {}).get("cpu_percent", 0) > 5)
        j = t["jobs"]["busy"]
        assert j["cpu_percent"] < 70 and j["memory_limit_bytes"] == 128 << 20 and j["run_id"] == "place-7"
        assert t["memory"]["promised_bytes"] == 128 << 20
        with pytest.raises(CommandError, match="already running"):
            await nc.call("n-run", "run", job="busy", argv=["true"])
        ev = await asyncio.wait_for(nc.events.get(), timeout=15)
        assert ev == {**ev, "event": "job_exit", "job": "busy", "exit_code": 0, "run_id": "place-7"}
        assert (await nc.call("n-run", "release", job="busy"))["released"] is True


async def test_run_is_refused_unless_allowed_and_protected_pids_are_refused(mosquitto, node_daemons):
    p = node_daemons(mosquitto.url, "n-safe")
    await next_message(mosquitto.url, "dlshare/v1/node/n-safe/state", lambda o: o["status"] == "online")
    async with NodeClient(mosquitto.url) as nc:
        with pytest.raises(CommandError, match="allow_run"):
            await nc.call("n-safe", "run", job="x", argv=["/bin/true"])
        with pytest.raises(CommandError, match="cannot be allocated"):
            await nc.call("n-safe", "allocate", job="x", pids=[p.pid], memory_bytes=1 << 20)
    assert p.poll() is None


async def test_flood_of_random_payloads_never_kills_the_daemon(mosquitto, node_daemons):
    import random

    p = node_daemons(mosquitto.url, "n-flood")
    await next_message(mosquitto.url, "dlshare/v1/node/n-flood/state", lambda o: o["status"] == "online")
    rnd = random.Random(1234)
    a = parse_broker_url(mosquitto.url)
    async with aiomqtt.Client(a.host, a.port, identifier="flooder") as c:
        for i in range(300):
            kind = rnd.randrange(4)
            if kind == 0:
                payload = rnd.randbytes(rnd.randrange(0, 2000))
            elif kind == 1:
                payload = json.dumps({"schema": 1, "id": f"f{i}", "op": rnd.choice(
                    ["run", "allocate", "stop", "release", "ping", "x"]),
                    "args": {rnd.choice(["job", "argv", "cpus", "pids", "cpuset"]): rnd.choice(
                        [None, -1, 1e308, "", "0-", [1, "a"], {"a": 1}, "j" * 300])}}).encode()
            elif kind == 2:
                payload = b"{" * rnd.randrange(1, 100_000)  # deep nesting
            else:
                payload = json.dumps({"schema": 1, "id": f"f{i}", "op": "allocate",
                                      "args": {"job": "../../etc", "pids": [0, -5]}}).encode()
            await c.publish("dlshare/v1/node/n-flood/cmd", payload, qos=1)
    async with NodeClient(mosquitto.url) as nc:
        assert (await nc.call("n-flood", "ping", timeout=20))["node"] == "n-flood"
    assert p.poll() is None


def test_sd_notify_sends_ready_to_systemd_socket(tmp_path, monkeypatch):
    import socket as so

    from nodesvc.daemon.node import sd_notify

    path = str(tmp_path / "notify.sock")
    s = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    s.bind(path)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        sd_notify("READY=1\nSTATUS=ok")
        s.settimeout(2)
        assert s.recv(100) == b"READY=1\nSTATUS=ok"
    finally:
        s.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    sd_notify("READY=1")  # outside systemd: nothing to do, no error
