"""The status page in real headless Chromium (Debian's chromium): load it from a running
`dlshare sched`, assert on the rendered DOM, and take a screenshot."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus
from nodesvc.bus.procs import until
from tests.scheduler.service.svc_helpers import TOKEN, SchedProc

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a closed network, as root (see the machine notes): no sandbox, no background traffic.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


async def _chromium(tmp, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_status_page_in_headless_chromium(mosquitto, fake_node, tmp_path):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: `make deps` installs Debian's chromium package")
    await fake_node("page-node", cpus=8, gpus=2)
    agg = Bus(mosquitto.url, "fake-agg")
    agg_task = asyncio.create_task(agg.run())
    sched = SchedProc(tmp_path, mosquitto.url, profile="dlshare")
    await asyncio.to_thread(sched.start)
    try:
        c = sched.client()
        await asyncio.wait_for(agg.connected.wait(), 10)
        await agg.publish(messages.topic("agg", "agg-1", "telemetry"), messages.encode(
            {"server": "agg-1", "address": "127.0.0.1:7700", "pool": {"size": 3, "demand_cores": 1.5},
             "jobs": {"ddp-a": {}, "ddp-b": {}}, "bytes_in_per_s": 2048.0}))
        await until(lambda: any(n["status"] == "online" for n in c.cluster()["nodes"]), what="node online")
        job = c.submit({"id": "page-train", "name": "resnet <demo>", "model": "resnet50", "gpus": 1, "cpus": 1.0,
                        "memory_bytes": 1 << 30, "command": ["python", "train.py"]})
        await until(lambda: c.get(job["id"])["state"] == "running", what="job running")
        await until(lambda: c.cluster()["aggregation"]["servers"] == 1, what="aggregation telemetry")
        url = f"{sched.url}/?token={TOKEN}&refresh=2"
        dom = await _chromium(tmp_path, "--dump-dom", url)
        assert "<title>dlshare scheduler</title>" in dom
        assert 'data-node="page-node"' in dom and ">online<" in dom
        assert 'data-job="page-train"' in dom and "resnet &lt;demo&gt;" in dom  # escaped, not markup
        assert 'id="gpus">1/2<' in dom  # one of the node's two GPUs allocated
        assert 'id="lent">1.0 GiB<' in dom  # the donor telemetry's lent memory
        assert "2 jobs, 1.50 of 3 pool cores busy" in dom
        assert 'http-equiv="refresh" content="2;' in dom
        shot = tmp_path / "status.png"
        await _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,800", url)
        data = shot.read_bytes()
        if os.environ.get("DLSHARE_KEEP_SCREENSHOT"):
            shutil.copy(shot, os.environ["DLSHARE_KEEP_SCREENSHOT"])
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        denied = await _chromium(tmp_path, "--dump-dom", f"{sched.url}/")
        assert "the status page needs the token" in denied and "page-train" not in denied
    finally:
        sched.stop()
        await agg.publish(messages.topic("agg", "agg-1", "state"), b"", 1, True)
        agg_task.cancel()
