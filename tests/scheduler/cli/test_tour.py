"""The scheduler's part of `dlshare up --tour`, against a real stack: mosquitto, `dlshare sched`,
two real node daemons with simulated GPUs; real PyTorch and data-preparation jobs."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

from rich.console import Console

from nodesvc.bus.procs import stop_proc
from scheduler.cli.tour import run_tour
from tests.scheduler.service.svc_helpers import ROOT, TOKEN, SchedProc


def _node(url: str, nid: str, tmp) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nodesvc.cli", "node", "--broker", url, "--node-id", nid, "--interval", "0.5",
         "--metrics-listen", "127.0.0.1:-1", "--fake-gpus", "2", "--allow-run", "--allow-root-jobs"],
        cwd=ROOT, stdout=open(tmp / f"{nid}.log", "ab"), stderr=subprocess.STDOUT,
        env={**__import__("os").environ, "DLSHARE_NODE_STATE_DIR": str(tmp / nid)})


async def test_tour_runs_real_jobs_through_the_api(mosquitto, tmp_path):
    nodes = [_node(mosquitto.url, f"tour-n{i}", tmp_path) for i in (1, 2)]
    sched = SchedProc(tmp_path, mosquitto.url, profile="dlshare")
    sched.start({"DLSHARE_SCHED_PREDICTORS": "data"})  # as `dlshare up` runs it
    try:
        st = SimpleNamespace(sched_url=sched.url, sched_token=TOKEN, broker_url=mosquitto.url,
                             node_ids=["tour-n1", "tour-n2"], agg_addr=None, lending=False, net=None)
        out = io.StringIO()
        ok = await run_tour(st, Console(file=out, width=200), timeout_s=90)
        text = out.getvalue()
        assert ok, text
        assert "Placed and allocated" in text and "5/5 jobs done" in text
        assert "co-located on tour-n" in text  # trainings beside data preparation on one node
        assert "422 invalid request" in text  # the malformed spec shown to be refused
        jobs = sched.client().all()
        assert len(jobs) == 5 and all(j["state"] == "done" for j in jobs)
        assert {j["spec"]["kind"] for j in jobs} == {"training", "data_prep"}
    finally:
        sched.stop()
        for p in nodes:
            stop_proc(p)
