"""A job's remote memory from its node daemon: ``run`` with ``remote_memory_bytes`` puts the budget in the
job's environment, ``rdma.region_from_env()`` maps it with no broker address in the job's code, and
``dlshare status`` shows it as borrowed memory."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from nodesvc.bus import messages
from nodesvc.bus.procs import stop_proc, wait_until
from nodesvc.bus.rpc import CommandError, NodeClient
from nodesvc.cli import status
from nodesvc.node_core import RunSpec, parse_op
from rdma.env import budget_from_env
from tests.rdma.donors import ROOT, SLAB

MIB = 1 << 20


def test_the_budget_is_read_from_the_environment():
    env = {"DLSHARE_BROKER": "mqtt://b:1883", "DLSHARE_REMOTE_MEMORY_BYTES": str(64 * MIB)}
    g = budget_from_env(env)
    assert g["region_bytes"] == 32 * MIB and g["replicas"] == 2 and g["local_bytes"] == 32 * MIB
    g = budget_from_env({**env, "DLSHARE_MEMORY_BYTES": str(64 * MIB), "DLSHARE_REMOTE_REPLICAS": "1"})
    assert g["region_bytes"] == 64 * MIB and g["local_bytes"] == 16 * MIB  # a quarter of the job's limit
    assert budget_from_env({**env, "DLSHARE_REGION_LOCAL_BYTES": str(3 * MIB)})["local_bytes"] == 3 * MIB
    assert g["rebuild_bytes_per_s"] == 0  # no cap unless asked
    assert budget_from_env({**env, "DLSHARE_REBUILD_BYTES_PER_S": str(100 * MIB)})["rebuild_bytes_per_s"] == 100 * MIB
    with pytest.raises(ValueError, match="DLSHARE_REBUILD_BYTES_PER_S.*whole number"):
        budget_from_env({**env, "DLSHARE_REBUILD_BYTES_PER_S": "fast"})
    with pytest.raises(LookupError, match="DLSHARE_REMOTE_MEMORY_BYTES.*remote_memory_bytes"):
        budget_from_env({"DLSHARE_BROKER": "mqtt://b:1883"})
    with pytest.raises(LookupError, match="DLSHARE_BROKER"):
        budget_from_env({"DLSHARE_REMOTE_MEMORY_BYTES": "100"})
    with pytest.raises(ValueError, match="whole number"):
        budget_from_env({**env, "DLSHARE_REMOTE_MEMORY_BYTES": "lots"})
    with pytest.raises(ValueError, match="not be negative"):
        budget_from_env({**env, "DLSHARE_REMOTE_MEMORY_BYTES": "-5"})
    with pytest.raises(ValueError, match="too small"):
        budget_from_env({**env, "DLSHARE_REMOTE_MEMORY_BYTES": "4096"})


def test_run_takes_a_remote_budget_and_refuses_bad_ones():
    def run(**args):
        return parse_op(messages.Command(id="c1", op="run", args={"job": "j", "argv": ["true"], **args}))

    assert run(remote_memory_bytes=8 * MIB) == RunSpec("j", ("true",), remote_memory_bytes=8 * MIB)
    assert run().remote_memory_bytes is None and run(remote_memory_bytes=0).remote_memory_bytes is None
    for bad, why in ((-1, "between 0 and 1 PiB"), (1 << 51, "between 0 and 1 PiB"), (True, "not bool"),
                     ("8M", "must be int"), (1.5, "must be int")):
        with pytest.raises(messages.PayloadError, match=why):
            run(remote_memory_bytes=bad)


JOB = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import rdma

    region = rdma.region_from_env(local_bytes=1 << 20)  # no broker address here: the environment has it
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    ok = bool(np.array_equal(a, np.arange(len(a), dtype=np.uint32)))
    print(json.dumps({"ok": ok, "nbytes": region.nbytes, "evicted": region.stats()["evicted_dirty"],
                      "budget": os.environ["DLSHARE_REMOTE_MEMORY_BYTES"]}), flush=True)
    while not os.path.exists(sys.argv[1]):  # hold the region while the test looks at dlshare status
        time.sleep(0.1)
    region.close()
""")


def start_node(url: str, node: str, tmp_path, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{node}.log", "ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1", DLSHARE_NODE_ENFORCE="0", DLSHARE_NODE_INTERVAL="0.3",
               DLSHARE_NODE_METRICS_LISTEN="127.0.0.1:-1", DLSHARE_NODE_STATE_DIR=str(tmp_path / f"state-{node}"))
    return subprocess.Popen([sys.executable, "-m", "nodesvc.cli", "node", "--node-id", node, "--broker", url, *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def borrowed(url: str, node: str) -> dict:
    doc = status.summarize(asyncio.run(status.gather(url, timeout_s=2.0)))
    return next((n for n in doc["nodes"] if n["node"] == node), {})


async def _run_job(url: str, go: str, budget: int) -> dict:
    async with NodeClient(url) as nc:
        with pytest.raises(CommandError, match="remote_memory_bytes"):
            await nc.call("n-job", "run", job="bad", argv=["true"], remote_memory_bytes=-1)
        return await nc.call("n-job", "run", job="emb", argv=[sys.executable, "-c", JOB, go],
                             remote_memory_bytes=budget, cwd=str(ROOT))


def test_a_job_started_with_a_remote_budget_maps_it_and_status_shows_it_borrowed(mosquitto, donor_factory,
                                                                                tmp_path):
    donor_factory(mosquitto.url, 2)
    node = start_node(mosquitto.url, "n-job", tmp_path, "--allow-run", "--allow-root-jobs")
    try:
        wait_until(lambda: borrowed(mosquitto.url, "n-job").get("status") == "online", 30, "the job's node")
        go = tmp_path / "go"
        budget = 8 * SLAB  # every copy counted: a 4 MiB region with 2 copies
        res = asyncio.run(_run_job(mosquitto.url, str(go), budget))
        log = res["log"]
        wait_until(lambda: '"ok"' in open(log).read(), 60, "the job to map and fill its region")
        said = json.loads(open(log).read().strip().splitlines()[-1])
        assert said["ok"] is True and said["nbytes"] == budget // 2 and said["budget"] == str(budget)
        assert said["evicted"] > 0  # 4 MiB through 1 MiB of local memory
        row = wait_until(lambda: (r := borrowed(mosquitto.url, "n-job")).get("borrowed_bytes") == budget and r,
                         30, "dlshare status to show the borrowed memory")
        assert sum(row["borrowed_from"].values()) == budget and set(row["borrowed_from"]) <= {"donor0", "donor1"}
        go.touch()
        wait_until(lambda: borrowed(mosquitto.url, "n-job").get("borrowed_bytes") == 0, 30,
                   "the job to give the memory back")
    finally:
        stop_proc(node)


def test_a_spill_cache_from_the_environment_spills_to_donors_within_the_budget(mosquitto, donor_factory,
                                                                              monkeypatch):
    """Promise: with only the environment a node daemon gives a job, spill_cache_from_env() keeps its
    local tier to the size asked, puts the rest on donors, reads every entry back intact, and never
    holds more on donors than the budget allows (every copy counted)."""
    from rdma.env import spill_cache_from_env

    donor_factory(mosquitto.url, 2)
    budget = 8 * SLAB  # 2 copies: 4 slabs' worth of entries on donors at most
    monkeypatch.setenv("DLSHARE_BROKER", mosquitto.url)
    monkeypatch.setenv("DLSHARE_REMOTE_MEMORY_BYTES", str(budget))
    monkeypatch.setenv("DLSHARE_NODE_ID", "n-cache")
    cache = spill_cache_from_env(capacity_bytes=MIB, arena_bytes=SLAB)
    try:
        assert cache.remote_capacity == budget // 2 and cache.capacity == MIB
        values = {k: os.urandom(64 << 10) for k in range(48)}  # 3 MiB through a 1 MiB local tier
        for k, v in values.items():
            cache.put(k, v)
        assert cache.stats.spilled > 0 and cache.stats.local_bytes <= MIB
        assert 0 < cache.stats.remote_bytes <= budget // 2
        assert all(cache.get(k) == v for k, v in values.items())  # nothing dropped: it all fits the budget
        assert cache.stats.remote_hits > 0
    finally:
        cache.close()
    monkeypatch.delenv("DLSHARE_REMOTE_MEMORY_BYTES")
    with pytest.raises(LookupError, match="DLSHARE_REMOTE_MEMORY_BYTES"):
        spill_cache_from_env()
