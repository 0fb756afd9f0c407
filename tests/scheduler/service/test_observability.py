"""What the service tells operators: its own Prometheus metrics (counters that follow real jobs),
the cluster's bounded history (kept across a restart, served as columns, downsampled), the waiting
jobs' rows and events, and the charts the page draws (pure SVG)."""

from __future__ import annotations

import math
import re
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus.procs import until
from scheduler import Job, JobArrived, JobFinished, Node, SchedulerState, Tick
from scheduler.service.api import create_app
from scheduler.service.metrics import SchedulerMetrics
from scheduler.service.charts import line_chart
from scheduler.service.history import FIELDS, ClusterHistory, downsample
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import TOKEN, auth

JOB = {"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["python", "train.py"]}


def client(svc) -> httpx.AsyncClient:
    """The API in the test's own loop (the live service's): its calls to the loop run in place."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc, TOKEN)), base_url="http://testserver")


def sample(text: str, name: str, labels: str = "") -> float:
    """One sample of the Prometheus text ``text`` (``labels``: the exact label set, as written)."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in the metrics"
    return float(m.group(1))


async def test_the_metrics_follow_real_jobs(fake_node, live_service):
    n1 = await fake_node("n1", cpus=8, gpus=1)
    svc = await live_service.start(profile="fifo", reasons_s=0.05)
    await until(lambda: "n1" in svc.core.nodes, what="node registered")
    a, _ = svc.submit(dict(JOB))
    b, _ = svc.submit(dict(JOB))  # waits for the one GPU
    await until(lambda: a.id in n1.running, what="the first job runs")
    await until(lambda: svc.pending.info(b.id), what="the second explained")
    async with client(svc) as c:
        text = (await c.get("/metrics", headers=auth())).text
        assert (await c.get("/metrics")).status_code == 401  # a token, like the rest of the API
        assert sample(text, "dlshare_sched_jobs", '{state="running"}') == 1
        assert sample(text, "dlshare_sched_queue_length", '{reason="Resources"}') == 1
        assert sample(text, "dlshare_sched_gpus") == 1 and sample(text, "dlshare_sched_gpus_allocated") == 1
        assert sample(text, "dlshare_sched_jobs_submitted_total") == 2
        assert sample(text, "dlshare_sched_decisions_total", '{kind="place"}') >= 1
        assert sample(text, "dlshare_sched_job_wait_seconds_count") == 1
        assert sample(text, "dlshare_sched_queue_wait_longest_seconds") >= 0
        assert sample(text, "dlshare_sched_info", '{profile="fifo",version="0.1.0"}') == 1
        await n1.finish(a.id, 0)
        await until(lambda: b.id in n1.running, what="the second job starts in its place")
        svc.cancel(b.id)
        await until(lambda: svc.store.get_job(b.id).state == "cancelled", what="cancelled")
        await until(lambda: svc.metrics.finished.labels("cancelled")._value.get() == 1, what="the cancel counted")
        text = (await c.get("/metrics", headers=auth())).text
        assert sample(text, "dlshare_sched_jobs_finished_total", '{state="done"}') == 1
        assert sample(text, "dlshare_sched_job_completion_seconds_count") == 1  # JCT of the done job only
        assert sample(text, "dlshare_sched_job_wait_seconds_count") == 2
        assert sample(text, "dlshare_sched_decision_latency_seconds_count") >= 4
        assert "_created" not in text
    events = [e for e in svc.store.events(job=b.id) if e["kind"] == "waiting"]
    assert [(e["data"]["code"], e["data"]["reason"]) for e in events] == [("Resources", "needs 1 GPU; 0 free")]


def test_an_end_counts_once_when_later_events_share_its_batch():
    """The live loop hands the core a batch of events; the core's clock ends at the last one.  A job
    that finished at an earlier event of the batch is counted once, with its JCT (under load the
    batches grow: the counter missed such ends, seen in CI)."""
    core = SchedulerState("fifo", [Node("n0", 1, 8, 1 << 30)])
    m = SchedulerMetrics("fifo", "test")
    for batch in ([JobArrived("a", 1.0, Job("x", "m", gpus=1)), Tick("t0", 1.5)],
                  [JobFinished("f", 5.0, "x"), Tick("t1", 6.0), Tick("t2", 7.0)],
                  [Tick("t3", 9.0)]):
        m.batch(batch, core.handle(*batch), core, 0.001)
    assert m.finished.labels("done")._value.get() == 1
    rec = core.records["x"]
    assert rec.finished_at == 5.0
    assert m.jct._sum.get() == pytest.approx(5.0 - rec.job.arrival)  # one JCT, this job's
    assert m.wait._sum.get() == pytest.approx(rec.first_start - rec.job.arrival)  # one wait


async def test_the_history_is_bounded_kept_across_a_restart_and_served_as_columns(fake_node, live_service, tmp_path):
    await fake_node("n1", cpus=8, gpus=2)
    db = tmp_path / "h.db"
    t0 = time.time()
    svc = await live_service.start(db, profile="fifo", history_step_s=0.05, history_keep_s=1.0)
    await until(lambda: svc.history.points and svc.history.points[0]["ts"] > t0 + 0.5, timeout=30,
                what="the oldest points dropped: a second kept")
    assert len(svc.history.points) <= 21  # bounded: keep_s / step_s (+1)
    await until(lambda: svc.history.points[-1]["gpus_total"] == 2, what="the node in the history")
    async with client(svc) as c:
        h = (await c.get("/v1/history", headers=auth())).json()
        assert h["step_s"] == 0.05 and h["fields"] == list(FIELDS) and len(h["ts"]) == len(h["gpus_total"])
        assert h["gpus_total"][-1] == 2 and h["nodes_online"][-1] == 1 and h["cpus_total"][-1] == 8
        assert h["ts"] == sorted(h["ts"]) and h["ts"][-1] - h["ts"][0] <= 1.0 + 0.2
        few = (await c.get("/v1/history", params={"points": 3}, headers=auth())).json()
        assert len(few["ts"]) == 3 and few["ts"][-1] >= h["ts"][-1]  # the newest point kept whole
        later = await c.get("/v1/history", params={"since": h["ts"][-1] + 1000}, headers=auth())
        assert later.json()["ts"] == []
        for bad in ({"points": 0}, {"since": -1}, {"points": "x"}, {"nope": 1}):
            assert (await c.get("/v1/history", params=bad, headers=auth())).status_code == 422, bad
        assert (await c.get("/v1/history")).status_code == 401
    last = svc.history.points[-1]["ts"]
    await live_service.stop(svc)
    again = ClusterHistory(JobStore(db), 0.05, 1.0)
    assert again.points and again.points[-1]["ts"] == last  # the day survives a restart


def test_downsampling_keeps_the_present_exact_and_averages_the_rest():
    pts = [{"ts": float(i), **{k: None for k in FIELDS}, "gpus_allocated": float(i % 2)} for i in range(101)]
    out = downsample(pts, 11)
    assert len(out) == 11 and out[-1] is pts[-1]
    assert all(p["gpus_allocated"] == pytest.approx(0.5) for p in out[:-1]) and out[0]["gpu_util_percent"] is None
    assert downsample(pts[:5], 11) == pts[:5]
    with pytest.raises(ValueError):
        downsample(pts, 0)
    with pytest.raises(ValueError):
        ClusterHistory(None, step_s=10, keep_s=5)


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.floats(-1e15, 1e15, allow_nan=False)), max_size=40),
       unit=st.sampled_from(["count", "percent", "bytes", "bytes/s", "seconds"]),
       label=st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=20))
def test_a_chart_is_well_formed_svg_for_any_values(values, unit, label):
    import xml.etree.ElementTree as ET

    ts = [100.0 + i for i in range(len(values))]
    svg = line_chart("c1", f"t <{label}>", ts, [("k", label, values)], unit, now=100.0 + len(values), window_s=60)
    assert svg.startswith("<svg class='chart' id='c1'") and svg.endswith("</svg>")
    # every text escaped: the chart parses as XML and the label is text in it, never markup (a bare "<c"
    # in the SVG proved nothing: "<circle" has it)
    assert label in "".join(ET.fromstring(svg).itertext())
    drawn = sum(1 for v in values[-61:] if v is not None)
    assert f"data-points='{min(len(values), 61)}'" in svg or len(values) > 61
    if drawn:
        assert "polyline data-series='k'" in svg or "circle data-series='k'" in svg
    nums = [float(x) for x in re.findall(r"(?:points|cx|cy)='([-\d.]+)", svg)]
    assert all(math.isfinite(x) for x in nums)


def test_a_waiting_jobs_events_follow_its_cause_at_once_and_its_numbers_at_most_every_gap(store):
    """Promise: a new cause (code, or words beyond their numbers) is an event at once; the cluster
    moving under the same cause (``1 free`` -> ``4 free``) at most every ``event_gap_s``, the latest
    words logged once it passed; the row's reason is always the current one."""
    from scheduler import Job, JobArrived, JobFinished, Node, SchedulerState
    from scheduler.model import GiB
    from scheduler.service.pending import PendingJobs
    from scheduler.service.rows import Owner

    core = SchedulerState("fifo", [Node(f"n{i}", 4, 16, 64 * GiB) for i in range(2)])
    pending = PendingJobs(store, event_gap_s=100.0, prior=lambda: None)
    for jid, g, t in (("a", 4, 0.0), ("b", 3, 0.0), ("w", 8, 1.0)):
        store.add_job(jid, {"gpus": g, "command": ["x"]}, Owner("u"))
        core.handle(JobArrived(f"e-{jid}", t, Job(jid, "m", gpus=g)))

    def waits() -> list[str]:
        return [e["data"]["reason"] for e in store.events(job="w") if e["kind"] == "waiting"]

    pending.refresh(core, 10.0)
    assert waits() == ["needs 8 GPUs on 2 nodes; 1 free"] and store.get_job("w").reason == waits()[0]
    core.handle(JobFinished("f", 20.0, "b"))
    pending.refresh(core, 20.0)
    assert waits() == ["needs 8 GPUs on 2 nodes; 1 free"]  # the same cause, new numbers: not yet
    assert store.get_job("w").reason == "needs 8 GPUs on 2 nodes; 4 free"  # the row says it at once
    pending.refresh(core, 30.0)
    assert len(waits()) == 1
    pending.refresh(core, 111.0)  # the gap passed: the latest words logged
    assert waits() == ["needs 8 GPUs on 2 nodes; 1 free", "needs 8 GPUs on 2 nodes; 4 free"]
    assert pending.info("w")["position"] == 1 and pending.info("a") is None
