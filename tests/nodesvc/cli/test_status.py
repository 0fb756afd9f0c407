"""``dlshare status``: the cluster summarised from retained state messages, and its table."""

import time

from nodesvc.cli import status


def test_summarize_status_document():
    states = {
        "dlshare/v1/node/a/state": {"status": "online", "ts": time.time(), "summary": {
            "cpu_count": 8, "cpu_percent": 10.0, "memory_total_bytes": 64 << 30, "memory_available_bytes": 40 << 30,
            "gpus": 4, "gpu_util_percent": [1, 2, 3, 4], "jobs_running": 2,
            "donor": {"lendable_bytes": 8 << 30, "lent_bytes": 2 << 30, "lent_to": {"b": 2 << 30}}}},
        "dlshare/v1/node/b/state": {"status": "offline", "reason": "connection lost"},
        "dlshare/v1/agg/s1/state": {"status": "online", "summary": {"cores": 2, "min_cores": 1, "max_cores": 8,
                                                                   "busy": 0.5, "jobs": ["j1"]}},
        "garbage/topic": {"status": "online"},
        "dlshare/v1/cache/imagenet-224/manifest": {"v": 1, "cache": "imagenet-224", "box": "...",
                                                   "public": {"owner": "b", "slots": 1281167, "donor_bytes": 3 << 30}},
        "dlshare/v1/cache/junk/manifest": {"public": "not an object"},
    }
    doc = status.summarize(states)
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    a, b = doc["nodes"]
    assert a["lent_bytes"] == 2 << 30 and b["borrowed_bytes"] == 2 << 30 and a["borrowed_bytes"] == 0
    assert b["status"] == "offline" and b["reason"] == "connection lost"
    assert doc["aggregators"][0]["cores"] == 2
    assert doc["caches"][0] == {"cache": "imagenet-224", "owner": "b", "slots": 1281167, "donor_bytes": 3 << 30,
                                "copies": None}
    assert doc["caches"][1]["owner"] is None  # malformed public part: shown as missing
    from rich.console import Console

    c = Console(record=True, width=160)
    status.render(doc, c)
    text = c.export_text()
    assert "online" in text and "offline" in text and "aggregation servers" in text
    assert "imagenet-224" in text and "sample caches" in text


async def test_the_tours_final_status_waits_for_the_nodes_and_the_scheduler_to_report_their_jobs_gone(mosquitto):
    """The tour's last table comes after a node's sample, and a scheduler's state, that count no job
    (those taken before the jobs ended still counted them), through a real broker's retained messages."""
    import asyncio

    import aiomqtt

    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import parse_broker_url
    from nodesvc.cli.tour import settled_status

    addr = parse_broker_url(mosquitto.url)

    async def say(jobs: int) -> None:
        async with aiomqtt.Client(addr.host, addr.port, identifier=f"t-{time.monotonic_ns()}") as c:
            await c.publish("dlshare/v1/node/n1/state", messages.encode(
                {"status": "online", "ts": time.time(), "summary": {"jobs_running": jobs}}), qos=1, retain=True)

    await say(3)
    waiting = asyncio.create_task(settled_status(mosquitto.url, timeout_s=30))
    await asyncio.sleep(1.5)
    assert not waiting.done()  # the node still counts 3 jobs
    await say(0)
    doc = await asyncio.wait_for(waiting, 30)
    assert [n["jobs_running"] for n in doc["nodes"]] == [0]
    await say(2)  # a node that keeps a job: the status comes after the timeout, as it is
    doc = await asyncio.wait_for(settled_status(mosquitto.url, timeout_s=1.0), 30)
    assert [n["jobs_running"] for n in doc["nodes"]] == [2]
    await say(0)

    async def sched_says(running: int) -> None:  # the scheduler's state lags its last job's end too
        async with aiomqtt.Client(addr.host, addr.port, identifier=f"t-{time.monotonic_ns()}") as c:
            await c.publish("dlshare/v1/sched/s1/state", messages.encode(
                {"status": "online", "url": "http://x", "jobs": {"waiting": 0, "running": running}}), qos=1, retain=True)

    await sched_says(1)
    waiting = asyncio.create_task(settled_status(mosquitto.url, timeout_s=30))
    await asyncio.sleep(1.5)
    assert not waiting.done()  # the scheduler still counts a running job
    await sched_says(0)
    doc = await asyncio.wait_for(waiting, 30)
    assert doc["schedulers"][0]["jobs"] == {"waiting": 0, "running": 0}


async def test_status_ends_once_the_retained_burst_is_over_while_services_keep_publishing(broker):
    """Live state updates (a busy cluster sends them every few seconds per service) do not keep
    ``dlshare status`` waiting to its timeout: only the retained messages sent at the subscription
    do.  Without that, this gather would last its 60 s timeout."""
    import asyncio

    import aiomqtt

    from nodesvc.bus import messages
    from nodesvc.bus.mqtt import parse_broker_url

    addr = parse_broker_url(broker.url)
    async with aiomqtt.Client(addr.host, addr.port, identifier=f"pub-{time.monotonic_ns()}") as pub:
        for n in ("n1", "n2", "n3"):
            await pub.publish(f"dlshare/v1/node/{n}/state", messages.encode(
                {"status": "online", "ts": time.time(), "summary": {"jobs_running": 0}}), qos=1, retain=True)
        stop = asyncio.Event()

        async def chatter() -> None:  # one service publishing its state every 50 ms
            k = 0
            while not stop.is_set():
                k += 1
                await pub.publish("dlshare/v1/node/n2/state", messages.encode(
                    {"status": "online", "ts": time.time(), "summary": {"jobs_running": k}}), qos=1, retain=True)
                await asyncio.sleep(0.05)

        task = asyncio.create_task(chatter())
        try:
            t0 = time.monotonic()
            states = await status.gather(broker.url, settle_s=0.4, timeout_s=60.0)
            took = time.monotonic() - t0
        finally:
            stop.set()
            await task
    assert took < 30, f"status waited {took:.1f}s: live updates kept it waiting"
    assert sorted(states) == [f"dlshare/v1/node/{n}/state" for n in ("n1", "n2", "n3")]
    assert all(s["status"] == "online" for s in states.values())
