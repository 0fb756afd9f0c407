"""The whole path with real processes: `dlshare sched`, real node daemons (`dlshare node`,
simulated GPUs), a real mosquitto.  Faults: a node daemon killed with SIGKILL under load,
the service killed with SIGKILL mid-stream and restarted, the broker restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodesvc import cgroups
from nodesvc.bus.procs import stop_proc, wait_until
from scheduler.client import SchedulerApiError
from tests.scheduler.service.svc_helpers import ROOT, SchedProc

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _node(broker_url: str, node_id: str, tmp, gpus: int = 2) -> subprocess.Popen:
    log = open(tmp / f"{node_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "nodesvc.cli", "node", "--broker", broker_url, "--node-id", node_id,
         "--interval", "0.5", "--metrics-listen", "127.0.0.1:-1", "--fake-gpus", str(gpus), "--allow-run", "--allow-root-jobs"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "DLSHARE_NODE_STATE_DIR": str(tmp / node_id)})


def _wait(pred, timeout=20.0, what="condition"):
    """Poll the service's API until ``pred`` holds (an API error counts as "not yet")."""
    return wait_until(pred, timeout=timeout, what=what, interval=0.2, ignore=(SchedulerApiError,))


def _online(c, n):
    return sum(1 for x in c.cluster()["nodes"] if x["status"] == "online") >= n


def _end_jobs_of(node_ids) -> None:
    """A node daemon's jobs outlive it (a restarted daemon adopts them): end the ones the test's daemons
    started, found in their cgroups (cgroup v1, where the daemons enforce), so none runs on after the test."""
    own = cgroups.own_cgroup(1).get("cpu")
    if own is None:
        return
    for nid in node_ids:
        for procs in Path("/sys/fs/cgroup/cpu", own.lstrip("/"), "dlshare", nid).glob("*/cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass  # ended on its own meanwhile


@pytest.fixture
def stack(mosquitto, tmp_path):
    procs = {}
    sched = SchedProc(tmp_path, mosquitto.url, profile="fifo")
    yield sched, procs
    for p in procs.values():
        stop_proc(p)
    _end_jobs_of(procs)
    sched.stop()


def test_node_killed_under_load_then_service_killed_then_broker_restarted(stack, mosquitto, tmp_path):
    sched, procs = stack
    procs["n1"] = _node(mosquitto.url, "n1", tmp_path)
    sched.start()
    c = sched.client()
    _wait(lambda: _online(c, 1), what="n1 online")
    gpu = [c.submit({"model": "resnet50", "gpus": 1, "cpus": 0.25, "memory_bytes": 64 << 20, "command": SLEEP})["id"]
           for _ in range(2)]
    cpu = c.submit({"kind": "data_prep", "gpus": 0, "cpus": 0.25, "memory_bytes": 64 << 20, "command": SLEEP})["id"]
    _wait(lambda: all(c.get(j)["state"] == "running" for j in gpu + [cpu]), what="all running on n1")
    procs["n2"] = _node(mosquitto.url, "n2", tmp_path, gpus=3)
    _wait(lambda: _online(c, 2), what="n2 online")

    # 1. SIGKILL the node daemon that runs everything: its Last Will requeues the jobs onto n2.
    procs["n1"].send_signal(signal.SIGKILL)
    procs["n1"].wait()
    _wait(lambda: all(c.get(j)["state"] == "running" and c.get(j)["allocation"]["node"] == "n2"
                      for j in gpu + [cpu]), timeout=25, what="jobs requeued onto n2")
    for j in gpu + [cpu]:
        kinds = [e["kind"] for e in c.events(j)]
        assert "requeued" in kinds and kinds.count("placed") == 2, kinds

    # 2. SIGKILL the service while a submitter streams jobs at it; every accepted job survives.
    accepted, stop = [], threading.Event()

    def submitter():
        from scheduler.client import SchedulerClient
        with SchedulerClient(sched.url, c.http.headers["Authorization"].split()[1], timeout=2) as sc:
            i = 0
            while not stop.is_set():
                try:
                    accepted.append(sc.submit({"id": f"stream-{i}", "kind": "data_prep", "gpus": 0, "cpus": 0.01,
                                               "memory_bytes": 1 << 20, "command": ["true"]})["id"])
                    i += 1
                except SchedulerApiError:
                    time.sleep(0.05)

    t = threading.Thread(target=submitter)
    t.start()
    _wait(lambda: len(accepted) >= 20, what="a stream of submissions")
    sched.kill9()
    stop.set()
    t.join()
    sched.start()
    c = sched.client()
    ids = {j["id"] for j in c.list(limit=10_000)}
    missing = set(accepted) - ids
    assert not missing, f"accepted jobs lost by the SIGKILL: {sorted(missing)[:5]}"
    for j in gpu + [cpu]:
        row = c.get(j)
        assert row["state"] == "running" and row["allocation"]["node"] == "n2", row
    states = {j["id"]: j["state"] for j in c.list(limit=10_000)}
    assert set(states.values()) <= {"queued", "running", "done", "failed"}, states

    # 3. Restart the broker: the service and the node reconnect; a new job still gets placed.
    mosquitto.stop()
    time.sleep(0.5)
    mosquitto.start()
    late = c.submit({"model": "vgg16", "gpus": 1, "cpus": 0.25, "memory_bytes": 64 << 20, "command": SLEEP})["id"]
    _wait(lambda: c.get(late)["state"] == "running", timeout=30, what="placement after the broker restart")
    assert c.get(late)["allocation"]["node"] == "n2"
    for j in gpu + [cpu, late]:
        assert c.cancel(j)["state"] == "cancelled"
