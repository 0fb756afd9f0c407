"""Lent memory end to end with real processes: `dlshare sched` (profile dlshare), two real donor
node daemons (`dlshare node` with lend = true, 1 MiB slabs, 6 slabs each), a real node daemon with a
simulated GPU and a real mosquitto.  A job that asks for lent memory starts with the budget in its
`run` command, maps it with `rdma.region_from_env()` and its borrowed bytes appear at the donors; a
donor that reclaims its memory makes the scheduler take its promise back (the job keeps running on
what is left)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

from nodesvc.bus.procs import stop_proc, wait_until
from nodesvc.bus.rpc import NodeClient
from nodesvc.cli import status
from scheduler.client import SchedulerApiError
from tests.rdma.donors import SLAB, DonorProc
from tests.scheduler.service.svc_helpers import ROOT, SchedProc

JOB = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import rdma

    region = rdma.region_from_env(local_bytes=1 << 20)  # the budget and the broker come from the environment
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    print(json.dumps({"ok": bool(np.array_equal(a, np.arange(len(a), dtype=np.uint32))),
                      "nbytes": region.nbytes}), flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
""")


def _gpu_node(url: str, tmp) -> subprocess.Popen:
    log = open(tmp / "g1.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "nodesvc.cli", "node", "--broker", url, "--node-id", "g1", "--interval", "0.3",
         "--metrics-listen", "127.0.0.1:-1", "--fake-gpus", "1", "--allow-run", "--allow-root-jobs"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "DLSHARE_NODE_STATE_DIR": str(tmp / "state-g1"),
             "PYTHONUNBUFFERED": "1"})


def _lent_to(url: str, consumer: str) -> dict[str, int]:
    """What each donor says it lends to ``consumer`` now (its telemetry, through `dlshare status`)."""
    doc = status.summarize(asyncio.run(status.gather(url, timeout_s=2.0)))
    row = next((n for n in doc["nodes"] if n["node"] == consumer), {})
    return dict(row.get("borrowed_from") or {})


def _wait(pred, timeout=30.0, what="condition"):
    return wait_until(pred, timeout=timeout, what=what, interval=0.3, ignore=(SchedulerApiError,))


def test_a_job_borrows_at_the_donors_and_a_reclaim_takes_the_promise_back(mosquitto, tmp_path):
    donors = [DonorProc(f"donor{i}", mosquitto.url, tmp_path, max_slabs=6) for i in range(2)]
    node = _gpu_node(mosquitto.url, tmp_path)
    sched = SchedProc(tmp_path, mosquitto.url, profile="dlshare").start()
    go = tmp_path / "go"
    try:
        c = sched.client()
        _wait(lambda: sum(1 for n in c.cluster()["nodes"] if n["status"] == "online") == 3, what="3 nodes online")
        budget = 8 * SLAB  # every copy counted: a 4 MiB region with 2 copies
        job = c.submit({"model": "resnet50", "gpus": 1, "cpus": 0.25, "memory_bytes": 64 << 20,
                        "remote_memory_bytes": budget, "command": [sys.executable, "-c", JOB, str(go)],
                        "cwd": str(ROOT)})["id"]
        row = _wait(lambda: (r := c.get(job))["state"] == "running" and r, what="the job running")
        assert row["allocation"]["remote_memory_bytes"] == budget
        events = c.events(job)
        placed = next(e for e in events if e["kind"] == "placed")
        assert placed["data"]["remote_memory_bytes"] == budget
        # The job maps its budget on the donors: they say so in their telemetry.
        lent = _wait(lambda: (x := _lent_to(mosquitto.url, "g1")) and sum(x.values()) == budget and x,
                     what="the donors to lend the job's budget")
        assert set(lent) == {"donor0", "donor1"}
        g1 = next(n for n in c.cluster()["nodes"] if n["id"] == "g1")  # the scheduler's books
        assert g1["borrowed_bytes"] == budget and sum(g1["borrowed_from"].values()) == budget
        # donor0 takes all its memory back and stops lending for a minute: the scheduler takes back
        # what it promised on donor0; the job keeps running on what is left (donor1's 6 slabs).
        async def reclaim():
            async with NodeClient(mosquitto.url) as nc:
                return await nc.call("donor0", "reclaim", bytes=6 * SLAB, pause_s=60.0)

        asyncio.run(reclaim())
        row = _wait(lambda: (r := c.get(job))["allocation"]["remote_memory_bytes"] < budget and r,
                    what="the scheduler to take donor0's promise back")
        assert row["state"] == "running" and row["allocation"]["remote_memory_bytes"] == 6 * SLAB
    finally:
        go.touch()
        sched.stop()
        stop_proc(node)
        for d in donors:
            d.stop()
