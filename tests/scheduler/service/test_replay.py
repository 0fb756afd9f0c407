"""A recorded live run replays through the core the simulator drives to the same decisions; the
service snapshots its core and compacts the log, and a restart replays only what came after."""

from __future__ import annotations

import subprocess
import sys

from nodesvc.bus.procs import until
from scheduler import Job, SchedulerState
from scheduler.service.journal import Journal, replay_check
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import FAST_RULES, ROOT

GPU_JOB = {"model": "resnet50", "batch_size": 32, "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30,
           "command": ["python", "train.py"]}
CPU_JOB = {"kind": "data_prep", "gpus": 0, "cpus": 3.0, "memory_bytes": 2 << 30, "command": ["python", "prep.py"]}


async def _a_busy_run(svc, n1, n2):
    """GPU and CPU jobs, a refused start (backoff, placed again), exits, a cancel, a bound pod, a node lost."""
    await until(lambda: {"n1", "n2"} <= set(svc.core.nodes), what="both nodes registered")
    n1.refuse["run"] = 1
    gpu = [svc.submit(dict(GPU_JOB))[0].id for _ in range(3)]
    cpu = [svc.submit(dict(CPU_JOB))[0].id for _ in range(3)]
    # two on n1's two GPUs, or three when the dlshare profile co-locates a pair (it may, depending on
    # when the refused start comes back from its backoff): the run is only a varied one to record
    await until(lambda: sum(j in n1.running for j in gpu) >= 2, what="GPU jobs on n1's two GPUs")
    await until(lambda: sum(j in n1.running or j in n2.running for j in cpu) == 3, what="the CPU jobs running")
    first = next(j for j in gpu if j in n1.running)
    await n1.finish(first, 0)
    await until(lambda: all(j in n1.running for j in gpu if j != first), what="the third GPU job started")
    on2 = next(j for j in cpu if j in n2.running)
    await n2.finish(on2, 3)
    other = next(j for j in cpu if j != on2)
    svc.cancel(other)
    assert svc.bind(Job("k8s.ml.p", "unknown", gpus=0, cpus=0.5, memory_bytes=1 << 28), "n1") == ""
    await until(lambda: "k8s.ml.p" in svc.core.records, what="the pod bound")
    await until(lambda: svc.store.get_job(other).state == "cancelled" and other not in n1.running
                and other not in n2.running, what="the cancelled job stopped")
    await n2.stop()  # its Last Will: its jobs are requeued on n1 where they fit
    await until(lambda: not svc.core.nodes["n2"].alive, what="n2 lost")
    await until(lambda: not svc.store.pending_decisions(), timeout=20, what="every decision carried out")
    return gpu + cpu


async def test_a_recorded_live_run_replays_to_the_same_decisions(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=2)
    n2 = await fake_node("n2", cpus=8, gpus=0)
    db = tmp_path / "run.db"
    svc = await live_service.start(db, profile="dlshare", snapshot_events=1 << 30)
    await _a_busy_run(svc, n1, n2)
    await live_service.stop(svc)

    store = JobStore(db, synchronous="NORMAL")
    try:
        journal = Journal(store)
        recorded = journal.recorded_decisions()
        kinds = {d["type"] for ds in recorded.values() for d in ds}
        assert {"Place", "Allocate", "Release", "Wakeup"} <= kinds, kinds
        res = replay_check(journal, lambda: SchedulerState("dlshare", rules=FAST_RULES))
        assert res.start == "a fresh core" and res.batches == len(recorded) > 5 and not res.unreadable
        assert res.differences == []
        # The check can fail: another policy, or other rules, depart somewhere and say where.
        other = replay_check(journal, lambda: SchedulerState("dlshare"))  # no backoff: placed again at once
        assert other.differences and other.differences[0].startswith("batch ")
    finally:
        store.close()
    # The command line says the same.
    p = subprocess.run([sys.executable, "-m", "nodesvc.cli", "sim", "replay", "--db", str(db)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "the same decisions" in p.stdout


async def test_snapshots_bound_the_replay_and_the_restarted_core_goes_on_alike(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=2)
    n2 = await fake_node("n2", cpus=8, gpus=0)
    db = tmp_path / "snap.db"
    svc = await live_service.start(db, profile="dlshare", snapshot_events=12)
    jobs = await _a_busy_run(svc, n1, n2)
    await until(lambda: svc.stats.snapshot, what="a snapshot written")
    before = {j: (r.job.state, r.shards) for j, r in svc.core.records.items() if r.job.state.active}
    assert before and svc.journal.first_batch() != 1  # compacted: the log no longer starts at batch 1
    await live_service.stop(svc)
    svc2 = await live_service.start(db, profile="dlshare", snapshot_events=12)
    rep = svc2.recovery.report
    assert rep["from"].startswith("snapshot after batch") and rep["events"] <= 12 + 40, rep
    after = {j: (r.job.state, r.shards) for j, r in svc2.core.records.items() if r.job.state.active}
    assert after == before
    assert "k8s.ml.p" in after  # the bound pod was replayed like any other core event
    assert svc2.recovery.resend == []
    # It goes on: a new job is placed, and no job of the run is started again.
    runs = len(n1.ops("run"))
    late = svc2.submit(dict(GPU_JOB))[0].id
    running = [j for j in jobs if svc2.store.get_job(j).state == "running"]
    await until(lambda: late in n1.running or svc2.store.get_job(late).state == "queued", what="the late job seen")
    assert all(c["args"]["job"] == late for c in n1.ops("run")[runs:]), "a job of the run was started again"
    assert running


async def test_a_changed_profile_rebuilds_the_core_and_stops_what_ran(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=2)
    db = tmp_path / "p.db"
    svc = await live_service.start(db, profile="dlshare", snapshot_events=3)
    job = svc.submit(dict(GPU_JOB))[0].id
    await until(lambda: job in n1.running, what="the job runs")
    await until(lambda: svc.stats.snapshot, what="a snapshot written")
    await live_service.stop(svc)
    svc2 = await live_service.start(db, profile="fifo")  # the snapshot's profile is gone: nothing can replay
    assert svc2.recovery.rebuilt and "rebuilt" in svc2.recovery.report["from"]
    await until(lambda: [c for c in n1.ops("stop") if c["args"]["job"] == job], what="the old run stopped")
    await until(lambda: job in n1.running and len([c for c in n1.ops("run") if c["args"]["job"] == job]) == 2,
                what="placed again by the new profile")
    ops = [(c["op"], c["id"]) for c in n1.commands if c["args"].get("job") == job]
    stop_at = next(i for i, (op, _) in enumerate(ops) if op == "stop")
    runs_at = [i for i, (op, _) in enumerate(ops) if op == "run"]
    assert runs_at[0] < stop_at < runs_at[1], ops  # the old run is stopped before the new one starts
    kinds = [e["kind"] for e in svc2.store.events(job=job)]
    assert "requeued" in kinds and kinds.count("placed") == 2
