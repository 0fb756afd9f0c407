"""The live loop against fake nodes that speak the node-daemon MQTT contract over a real broker."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodesvc.bus.procs import until
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore

GPU_JOB = {"model": "resnet50", "batch_size": 32, "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30,
           "command": ["python", "train.py"]}
CPU_JOB = {"kind": "data_prep", "gpus": 0, "cpus": 2.0, "memory_bytes": 4 << 30, "command": ["python", "prep.py"]}


async def _barrier(svc: SchedulerService, node: str, tag: str) -> None:
    """Returns once ``node`` has answered a command sent after everything the service published
    to it before: QoS 1 from one client on one topic arrives in order, so what was not there by
    then was never sent."""
    await svc.commands.send(node, "ping", {}, f"barrier/{tag}")


async def test_gpu_and_cpu_jobs_are_placed_run_and_finish(fake_node, live_service):
    n1 = await fake_node("n1", cpus=8, gpus=2)
    svc = await live_service.start()
    await until(lambda: "n1" in svc.core.nodes, what="node registered with the core")
    g, _ = svc.submit(dict(GPU_JOB))
    c, _ = svc.submit(dict(CPU_JOB))
    await until(lambda: g.id in n1.running and c.id in n1.running, what="both jobs started")
    gj = svc.store.get_job(g.id)
    assert gj.state == "running" and gj.allocation.node == "n1" and len(gj.allocation.gpus) == 1
    run = next(x for x in n1.ops("run") if x["args"]["job"] == g.id)
    assert run["args"]["argv"] == ["python", "train.py"] and run["args"]["gpus"] == list(gj.allocation.gpus)
    crun = [x for x in n1.ops("run") if x["args"]["job"] == c.id]
    assert len(crun) == 1 and crun[0]["args"]["cpus"] == 2.0 and crun[0]["args"]["memory_bytes"] == 4 << 30
    await n1.finish(g.id, 0)
    await n1.finish(c.id, 3)
    await until(lambda: svc.store.get_job(g.id).state == "done" and svc.store.get_job(c.id).state == "failed",
                what="exits recorded")
    assert svc.store.get_job(c.id).exit_code == 3
    assert svc.core.records[g.id].job.state.value == "done"
    await until(lambda: {x["args"]["job"] for x in n1.ops("release")} >= {g.id, c.id}, what="releases")
    kinds = [e["kind"] for e in svc.store.events(job=g.id)]
    assert kinds[:2] == ["submitted", "placed"] and "exited" in kinds
    assert svc.store.get_job(g.id).attained_service > 0


async def test_a_node_that_goes_offline_has_its_jobs_requeued_elsewhere(fake_node, live_service):
    n1 = await fake_node("n1", cpus=4, gpus=1)
    svc = await live_service.start()
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    g, _ = svc.submit(dict(GPU_JOB))
    c, _ = svc.submit(dict(CPU_JOB))
    await until(lambda: {g.id, c.id} <= set(n1.running), what="jobs on n1")
    n2 = await fake_node("n2", cpus=4, gpus=1)
    await until(lambda: "n2" in svc.core.nodes, what="n2 registered")
    await n1.stop()  # publishes offline, as its Last Will would
    await until(lambda: {g.id, c.id} <= set(n2.running), timeout=15, what="jobs restarted on n2")
    for j in (g, c):
        row = svc.store.get_job(j.id)
        assert row.state == "running" and row.allocation.node == "n2" and row.attempts == 2
        assert "requeued" in [e["kind"] for e in svc.store.events(job=j.id)]


async def test_restart_replays_the_log_and_sends_nothing_twice(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=2)
    db = tmp_path / "s.db"
    svc = await live_service.start(db, profile="fifo")  # fifo never shares a GPU
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    jobs = [svc.submit(dict(GPU_JOB))[0].id for _ in range(3)]
    await until(lambda: len(n1.running) == 2, what="two jobs on two GPUs")
    await until(lambda: not svc.store.pending_decisions(), what="every decision acknowledged")
    await live_service.stop(svc)
    runs_before = len(n1.ops("run"))
    svc2 = await live_service.start(db, profile="fifo")
    assert {j for j in jobs if j in svc2.core.running} == set(n1.running)
    assert [svc2.store.get_job(j).state for j in jobs].count("running") == 2
    assert svc2.recovery.resend == [], "the replay found acknowledged decisions to send again"
    await _barrier(svc2, "n1", "after-restart")
    assert len(n1.ops("run")) == runs_before, "a replayed placement was sent again"
    first = next(j for j in jobs if j in n1.running)
    third = next(j for j in jobs if svc2.store.get_job(j).state == "queued")
    await n1.finish(first, 0)
    await until(lambda: third in n1.running, what="the queued job starts after the restart")


async def test_a_cpu_job_whose_start_was_in_flight_at_a_crash_is_started_after_restart(
        fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=0)
    n1.drop_ops = {"run"}  # the node gets the command, but the service dies before any reply
    db = tmp_path / "s.db"
    svc = await live_service.start(db)
    await until(lambda: "n1" in svc.nodes and svc.nodes["n1"].status == "online", what="n1 online")
    job = svc.submit(dict(CPU_JOB))[0].id
    await until(lambda: n1.ops("run"), what="the run command reached the node")
    await live_service.stop(svc)  # before the command's timeout: its decision stays unacknowledged
    assert job not in n1.running
    n1.drop_ops = set()
    svc2 = await live_service.start(db)
    await until(lambda: job in n1.running, what="the unacknowledged start is sent again")
    # Telemetry for longer than the vanish limit (1.5 s) with the job in it: it is not taken for vanished.
    start = n1.reports
    await until(lambda: n1.reports > start + 8, what="telemetry reports after the restart")
    assert not svc2.core.watch.missing_since and svc2.core.watch.started == {job: {"n1"}}
    assert svc2.store.get_job(job).state == "running"
    assert len({c["id"] for c in n1.commands if c["op"] == "run"}) == 1  # the same command id, re-sent


async def test_a_job_its_node_stops_listing_vanishes_and_is_released(fake_node, live_service):
    n1 = await fake_node("n1", cpus=8, gpus=1)
    svc = await live_service.start()
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    job = svc.submit(dict(GPU_JOB))[0].id
    await until(lambda: job in svc.core.watch.started, what="the node confirmed the start")
    n1.hidden.add(job)  # the node forgets the job without an exit (a daemon restarted, a lost event)
    await until(lambda: svc.store.get_job(job).state == "failed", timeout=15, what="the vanished job failed")
    row = svc.store.get_job(job)
    assert "no longer reports the job" in row.reason and row.allocation is None
    await until(lambda: any(c["args"]["job"] == job for c in n1.ops("release")), what="released on its node")
    assert svc.core.records[job].job.state.value == "failed" and svc.core.free_gpus == 1


_TOPICS = st.sampled_from(["dlshare/v1/node/n1/telemetry", "dlshare/v1/node/n1/state", "dlshare/v1/node/n1/reply",
                           "dlshare/v1/node/n1/events", "dlshare/v1/agg/a1/telemetry", "dlshare/v1/agg/a1/state",
                           "dlshare/v1/sched/x/state", "garbage/topic", "dlshare/v1/node/n1/telemetry/extra"])
_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(
                            st.sampled_from(["schema", "node", "ts", "cpu", "memory", "gpus", "rdma", "jobs", "donor",
                                             "status", "id", "ok", "event", "job", "exit_code", "devices", "count",
                                             "total_bytes", "available_bytes", "pool", "state"]), c, max_size=6),
                        max_leaves=25)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(topic=_TOPICS, body=_JSONISH, raw=st.binary(max_size=40), use_raw=st.booleans())
async def test_fuzz_the_message_handler_never_raises(topic, body, raw, use_raw):
    svc = SchedulerService(JobStore(":memory:"), profile="fifo")
    payload = raw if use_raw else json.dumps({"schema": 1, **body} if isinstance(body, dict) else body).encode()
    try:
        await svc.on_message(topic, payload)
        svc.round()  # and the loop digests whatever it made of it
        assert set(svc.cluster()) >= {"nodes", "jobs_by_state", "gpus_total"}
    finally:
        await svc.stop()


async def test_a_decision_unacknowledged_at_a_restart_is_resent_with_its_id(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=1)
    n1.drop_ops = {"run"}  # the first `run` is received but its reply never comes back
    db = tmp_path / "s.db"
    svc = await live_service.start(db, profile="fifo")
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    job = svc.submit(dict(GPU_JOB))[0].id
    await until(lambda: n1.ops("run"), what="the run command sent")
    await live_service.stop(svc)  # down before any reply: the decision is still `sent`
    first = n1.ops("run")[0]
    pending = JobStore(db).pending_decisions()
    assert [d.job for d in pending] == [job]
    n1.drop_ops = set()
    svc2 = await live_service.start(db, profile="fifo")
    await until(lambda: job in n1.running, what="the re-sent run applied")
    runs = n1.ops("run")
    assert len(runs) == 2 and runs[1]["id"] == first["id"], "re-sent under another id"
    await until(lambda: svc2.store.decision(pending[0].id).state == "acked", what="decision acked")
    assert svc2.store.get_job(job).state == "running"
    assert len(svc2.core.running) == 1  # the replay did not place it a second time


async def test_las_preempts_through_wakeup_ticks_and_resumes(fake_node, live_service, tmp_path):
    profile = tmp_path / "las-fast.toml"
    profile.write_text('name = "las-fast"\n[order]\nplugin = "las"\nargs = { quantum_s = 1.0 }\n'
                       '[[score]]\nplugin = "consolidate"\n')
    n1 = await fake_node("n1", cpus=8, gpus=1)
    svc = await live_service.start(profile=str(profile))
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    a = svc.submit(dict(GPU_JOB))[0].id
    await until(lambda: a in n1.running, what="a running")
    b = svc.submit(dict(GPU_JOB))[0].id
    assert svc.store.get_job(b).state == "queued"  # one GPU: b waits for the next round
    await until(lambda: b in n1.running, timeout=10, what="LAS gives the GPU to b at the quantum")
    assert a not in n1.running and any(c["args"]["job"] == a for c in n1.ops("stop"))
    assert "preempted" in [e["kind"] for e in svc.store.events(job=a)]
    await until(lambda: a in n1.running, timeout=10, what="a resumed at a later quantum")
    assert svc.core.records[a].preemptions >= 1


async def test_stop_ends_the_loop_in_whatever_step_a_wake_up_lands(tmp_path):
    """stop() cancels the loop while a wake-up is on its way through the event loop: at every
    offset of a few steps, the loop must end (a ``wait_for`` that returned the wake-up instead of
    the cancel left it running for ever, and stop() with it)."""
    for steps in range(8):
        svc = SchedulerService(JobStore(tmp_path / f"s{steps}.db"), profile="dlshare", tick_s=0.05)
        await svc.start()
        await asyncio.sleep(0.01)  # the loop waits on its wake-up event
        svc.wake()
        for _ in range(steps):
            await asyncio.sleep(0)
        try:
            async with asyncio.timeout(5):
                await svc.stop()  # cancels the loop at once: no broker to say goodbye to
        except TimeoutError:
            raise AssertionError(f"stop() hung with the wake-up {steps} steps old") from None
        finally:
            svc.store.close()


async def test_a_crash_between_logging_a_placement_and_acting_on_it(fake_node, live_service, tmp_path):
    n1 = await fake_node("n1", cpus=8, gpus=1)
    db = tmp_path / "s.db"
    svc = await live_service.start(db, profile="fifo")
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    # Die right after the batch and its decisions are logged: no row update, no command.
    svc.carrier.mark_placed = lambda *a, **k: None
    svc.commands.spawn = lambda coro, key=None: coro.close()
    job = svc.submit(dict(GPU_JOB))[0].id
    await until(lambda: job in svc.core.running, what="the core placed it")
    assert svc.store.get_job(job).state == "queued" and not n1.ops("run")
    await live_service.stop(svc)
    svc2 = await live_service.start(db, profile="fifo")
    await until(lambda: job in n1.running, what="the logged placement carried out after the restart")
    row = svc2.store.get_job(job)
    assert row.state == "running" and row.allocation.node == "n1" and len(n1.ops("run")) == 1
