"""Why a job waits, from end to end, and the status page in real headless Chromium (Debian's,
driven over the DevTools protocol: tests/browser.py).

One running `dlshare sched` and two fake nodes of 4 GPUs: jobs of 4 and 3 GPUs run, an 8-GPU job
waits.  Its reason (``needs 8 GPUs on 2 nodes; 1 free``), queue position and estimated start are
read from the API, from `dlshare job list` (80 columns, no library logs) and `dlshare job show`,
and from the page; when the 3-GPU job ends the reason changes everywhere, and the job's events
list both reasons and, once the 4-GPU job ends, its placement.  The page is opened through its
login form (the token kept in an HttpOnly cookie, never in a URL), draws the cluster's history as
charts that carry data and grow as the page refreshes itself, and is screenshotted
(``DLSHARE_KEEP_SCREENSHOT=docs/status-page.png`` keeps the picture).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus
from nodesvc.bus.procs import until
from tests.browser import Chromium
from tests.scheduler.service.svc_helpers import ROOT, TOKEN, SchedProc
from tests.teardown import within

FAST = {"DLSHARE_SCHED_HISTORY_STEP_S": "0.25", "DLSHARE_SCHED_REASONS_S": "0.2", "DLSHARE_SCHED_FORECAST_S": "0.5",
        "DLSHARE_SCHED_REASON_EVENT_GAP_S": "0.5"}


async def cli(sched: SchedProc, *args: str) -> subprocess.CompletedProcess:
    """`dlshare job ARGS`, run in a thread: the fake nodes' telemetry and MQTT keep-alives share this
    event loop, and a loaded machine once kept it blocked long enough for the broker to drop them."""
    env = {**os.environ, "DLSHARE_SCHED_URL": sched.url, "DLSHARE_SCHED_TOKEN": TOKEN, "COLUMNS": "80"}
    env.pop("DLSHARE_LOG_LEVEL", None)
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "nodesvc.cli", "job", *args], cwd=ROOT,
                                   env=env, capture_output=True, text=True, timeout=60)


async def cli_says(sched: SchedProc, text: str, *args: str) -> str:
    r = await cli(sched, *args)
    return r.stdout if r.returncode == 0 and text in r.stdout else ""


async def test_a_waiting_job_says_why_everywhere_and_the_page_shows_the_cluster_over_time(mosquitto, fake_node,
                                                                                          tmp_path):
    n1 = await fake_node("page-1", cpus=16, gpus=4)
    n2 = await fake_node("page-2", cpus=16, gpus=4)
    agg = Bus(mosquitto.url, "fake-agg")
    agg_task = asyncio.create_task(agg.run())
    sched = SchedProc(tmp_path, mosquitto.url, profile="fifo")
    await asyncio.to_thread(sched.start, FAST)
    browser = None
    try:
        c = sched.client()
        await asyncio.wait_for(agg.connected.wait(), 10)
        telemetry = messages.encode({"server": "agg-1", "address": "127.0.0.1:7700",
                                     "pool": {"size": 3, "demand_cores": 1.5},
                                     "jobs": {"ddp-a": {}, "ddp-b": {}}, "bytes_in_per_s": 2048.0})

        # Sent every half second until seen, as a real server's periodic telemetry is: the scheduler's
        # HTTP side may answer before its MQTT subscription is in place, and one early message is lost.
        deadline = asyncio.get_running_loop().time() + 30
        while c.cluster()["aggregation"]["servers"] != 1:
            assert asyncio.get_running_loop().time() < deadline, "the scheduler never saw the agg telemetry"
            await agg.publish(messages.topic("agg", "agg-1", "telemetry"), telemetry)
            await asyncio.sleep(0.5)
        await until(lambda: sum(n["status"] == "online" for n in c.cluster()["nodes"]) == 2, what="nodes online")
        spec = {"model": "resnet50", "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["python", "train.py"]}
        c.submit({**spec, "id": "big4", "name": "resnet <demo>", "gpus": 4})
        c.submit({**spec, "id": "three", "gpus": 3})
        await until(lambda: all(c.get(j)["state"] == "running" for j in ("big4", "three")), what="7 GPUs in use")
        c.submit({**spec, "id": "gang8", "gpus": 8})

        # --- the API ----------------------------------------------------------------------
        first = "needs 8 GPUs on 2 nodes; 1 free"
        job = await until(lambda: (j := c.get("gang8"))["waiting"] and j["waiting"]["estimated_start"] and j,
                          what="a reason and an estimate")
        w = job["waiting"]
        assert (job["state"], job["reason"], w["code"], w["reason"]) == ("queued", first, "Resources", first)
        assert (w["position"], w["queue_length"]) == (1, 1) and w["nodes"].startswith("0/2 nodes are available")
        assert w["estimated_start"] > job["submitted_at"] and w["estimated_at"] >= job["submitted_at"]
        assert c.get("big4")["waiting"] is None  # a running job waits for nothing

        # --- the CLI: 80 columns, no library logs, the reason; show is for people ---------------
        r = await cli(sched, "list")
        assert r.returncode == 0 and r.stderr == "", r.stderr  # no httpx INFO lines
        lines = r.stdout.splitlines()
        assert lines[0].split() == ["JOB", "STATE", "GPUS", "NODE", "AGE", "REASON"]
        assert all(len(x) <= 80 for x in lines), lines
        row = next(x for x in lines if x.startswith("gang8"))
        assert row.split()[:3] == ["gang8", "queued", "8"] and "Resources: needs 8 GPUs on 2 nodes" in row
        assert next(x for x in lines if x.startswith("big4")).split()[:4] == ["big4", "running", "4", "page-1"] \
            or next(x for x in lines if x.startswith("big4")).split()[:4] == ["big4", "running", "4", "page-2"]
        loud = await cli(sched, "--log-level", "info", "list")  # asked for: the library's request lines
        assert "HTTP Request: GET" in loud.stderr and "gang8" in loud.stdout
        show = await cli(sched, "show", "gang")  # a unique prefix names the job
        assert show.returncode == 0, show.stderr
        assert f"Reason:          Resources: {first}" in show.stdout and "Position:        1 of 1" in show.stdout
        assert "Estimated start: in " in show.stdout and "Events:" in show.stdout
        assert json.loads((await cli(sched, "list", "-o", "json")).stdout)[2]["waiting"]["code"] == "Resources"
        assert "1/1" in (await cli(sched, "list", "-o", "wide")).stdout

        # --- the page in Chromium: the login form, the cookie, the charts ---------------------
        browser = await Chromium(tmp_path).start()
        page = await browser.page()
        await page.goto(f"{sched.url}/?refresh=1&window=15m")
        assert await page.eval("!!document.querySelector('form#login input[name=token]')")
        await page.eval(f"document.querySelector('input[name=token]').value = {json.dumps(TOKEN)};"
                        "document.getElementById('login').submit(); true")
        await page.wait_for("!!document.getElementById('charts')", what="the page after logging in")
        assert TOKEN not in await page.eval("location.href") and await page.eval("document.cookie") == ""  # HttpOnly
        cookies = (await page.call("Network.getAllCookies"))["cookies"]
        assert [(k["name"], k["httpOnly"], k["sameSite"]) for k in cookies] == [("dlshare_token", True, "Strict")]
        dom = await page.eval("document.documentElement.outerHTML")
        assert TOKEN not in dom and 'data-job="big4"' in dom and "resnet &lt;demo&gt;" in dom  # escaped
        assert await page.eval("document.getElementById('gpus').textContent") == "7/8"
        assert "2 jobs, 1.50 of 3 pool cores busy" in await page.eval("document.getElementById('agg').textContent")
        reason = "document.querySelector('tr[data-job=gang8] td.reason').textContent"
        assert await page.eval(reason) == f"Resources {first}"
        assert await page.eval("document.querySelector('tr[data-job=gang8] td.position').textContent") == "1 of 1"
        assert (await page.eval("document.querySelector('tr[data-job=gang8] td.starts').textContent")).startswith("in ")
        charts = ("[...document.querySelectorAll('svg.chart')].map(s => [s.id, +s.dataset.points, "
                  "s.querySelectorAll('polyline[points]:not([points=\"\"]), circle').length])")
        drawn = await page.eval(charts)
        assert {c[0] for c in drawn} >= {"chart-gpus", "chart-cpus", "chart-lent", "chart-queue", "chart-agg",
                                         "chart-wait", "chart-memory", "chart-gpu-util"}
        assert all(points > 0 and lines > 0 for _, points, lines in drawn), drawn
        gpus_line = "document.querySelector('#chart-gpus [data-series=gpus_allocated]').dataset.last"
        assert float(await page.eval(gpus_line)) == 7.0  # the chart carries the cluster's data
        before = dict((c[0], c[1]) for c in drawn)["chart-gpus"]
        await page.wait_for(f"+document.getElementById('chart-gpus').dataset.points > {before}", 30,
                            "the page refreshing itself with more history")

        # --- the cause changes: the 3-GPU job ends ------------------------------------------
        await n2.finish("three") if "three" in n2.running else await n1.finish("three")
        second = "needs 8 GPUs on 2 nodes; 4 free"
        await until(lambda: c.get("gang8")["reason"] == second, what="the reason following its cause")
        await until(lambda: cli_says(sched, f"Reason:          Resources: {second}", "show", "gang8"),
                    what="job show with the new reason")
        await page.wait_for(f"document.querySelector('tr[data-job=gang8] td.reason').textContent === "
                            f"{json.dumps('Resources ' + second)}", 30, "the page with the new reason")
        shot = tmp_path / "status.png"
        data = await page.screenshot(shot)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        if os.environ.get("DLSHARE_KEEP_SCREENSHOT"):
            shutil.copy(shot, os.environ["DLSHARE_KEEP_SCREENSHOT"])
        await n1.finish("big4") if "big4" in n1.running else await n2.finish("big4")
        await until(lambda: c.get("gang8")["state"] == "running", what="the 8-GPU job placed on both nodes")
        events = c.events("gang8")
        waits = [e["data"]["reason"] for e in events if e["kind"] == "waiting"]
        assert waits == [first, second], events
        assert "placed" in [e["kind"] for e in events]
        r = await cli(sched, "events", "gang8")
        assert "waiting" in r.stdout and "Resources: needs 8 GPUs on 2 nodes; 4 free" in r.stdout

        # --- a fresh browser tab without the cookie gets the form; logging out forgets it ------
        await page.eval("document.querySelector('form[action=\"/logout\"]').submit(); true")
        await page.wait_for("!!document.querySelector('form#login')", 30, "the login form after logging out")
    finally:
        if browser is not None:
            await within(browser.stop(), 20, "stopping chromium")
        await asyncio.to_thread(sched.stop)
        await agg.publish(messages.topic("agg", "agg-1", "state"), b"", 1, True)
        agg_task.cancel()
