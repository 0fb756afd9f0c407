"""Node messages into core events, in-process on an injected clock (no broker): silence is judged
against the other nodes, idle nodes' reports are not repeated, a started job a node never lists
reaches the core, and a stale exit from a node a job has left changes nothing."""

from __future__ import annotations

from scheduler import JobStarted, NodeLost, NodeReport
from scheduler.service.core_log import new_event_id
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import telemetry
from nodesvc.bus.messages import telemetry_from


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def service(tmp_path, clock) -> SchedulerService:
    svc = SchedulerService(JobStore(tmp_path / "t.db", synchronous="NORMAL"), profile="fifo", clock=clock,
                           node_timeout_s=10.0, report_s=5.0)
    svc.commands.spawn = lambda coro, key=None: coro.close()  # no broker: decisions are logged, not sent
    return svc


def posted(svc, kind):
    return [e for e in svc._events if isinstance(e, kind)]


def test_silence_is_judged_against_the_other_nodes(tmp_path):
    clock = Clock()
    svc = service(tmp_path, clock)
    for n in ("a", "b"):
        svc.translator.on_telemetry(telemetry_from(telemetry(n, gpus=1)))
    svc.round()
    clock.t += 60.0  # the loop heard nothing for a minute (it fell behind, or the broker was slow)
    svc.round()
    assert svc.core.nodes["a"].alive and svc.core.nodes["b"].alive
    svc.translator.on_telemetry(telemetry_from(telemetry("b", gpus=1)))  # b speaks; a stays silent
    clock.t += 11.0
    svc.translator.on_telemetry(telemetry_from(telemetry("b", gpus=1)))
    svc.translator.check_stale(clock.t)
    assert [e.node for e in posted(svc, NodeLost)] == ["a"]
    svc.round()
    assert not svc.core.nodes["a"].alive and svc.nodes["a"].status == "offline"


def test_idle_nodes_are_not_reported_again_and_busy_ones_are_every_report_s(tmp_path):
    clock = Clock()
    svc = service(tmp_path, clock)
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))
    svc.round()
    clock.t += 30.0
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))
    assert not posted(svc, NodeReport)  # idle, unchanged: nothing new for the core
    job = svc.submit({"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})[0].id
    svc.round()
    t = telemetry("a", gpus=1)
    t["jobs"] = {job: {"pids": [1], "state": "running"}}
    svc.translator.on_telemetry(telemetry_from(t))
    [r] = posted(svc, NodeReport)
    assert r.running == (job,)
    svc.round()
    clock.t += 1.0
    svc.translator.on_telemetry(telemetry_from(t))
    assert not posted(svc, NodeReport)  # unchanged, within report_s
    clock.t += 5.0
    svc.translator.on_telemetry(telemetry_from(t))
    assert posted(svc, NodeReport)  # a busy node's periodic report (the predictors' samples)


def test_a_started_job_its_node_never_lists_reaches_the_core(tmp_path):
    clock = Clock()
    svc = service(tmp_path, clock)
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))
    svc.round()
    job = svc.submit({"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})[0].id
    svc.round()
    rec = svc.core.records[job]
    svc.post(JobStarted(new_event_id(), svc.now(), job, "a", rec.placed_by))
    svc.round()
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))  # it lists nothing, as before the start
    [r] = posted(svc, NodeReport)
    assert r.running == ()
    svc.round()
    assert (job, "a") in svc.core.watch.missing_since


def test_an_exit_from_a_node_the_job_has_left_is_ignored(tmp_path):
    clock = Clock()
    svc = service(tmp_path, clock)
    for n in ("a", "b"):
        svc.translator.on_telemetry(telemetry_from(telemetry(n, gpus=1)))
    svc.round()
    job = svc.submit({"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})[0].id
    svc.round()
    where = svc.core.records[job].shards[0].node
    other = "b" if where == "a" else "a"
    svc.translator.job_exited(other, job, 0, "")
    assert not svc._events and svc.store.get_job(job).state == "running"
    svc.translator.job_exited(where, job, 0, "")
    svc.translator.job_exited(where, job, 0, "")  # the event and the telemetry both say so: once
    svc.round()
    assert svc.store.get_job(job).state == "done" and svc.core.records[job].job.state.value == "done"


def test_the_exit_of_an_earlier_run_on_the_same_node_ends_nothing(tmp_path):
    """A node lost (its Last Will at a broker restart) and back: the job placed there again must not
    be ended by the exit of the run stopped meanwhile; the exit of the current run ends it."""
    clock = Clock()
    svc = service(tmp_path, clock)
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))
    svc.round()
    job = svc.submit({"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})[0].id
    svc.round()
    first = svc.core.records[job].placed_by
    svc.translator.on_node_state("a", {"status": "offline"})
    svc.round()
    svc.translator.on_node_state("a", {"status": "online"})
    svc.translator.on_telemetry(telemetry_from(telemetry("a", gpus=1)))
    svc.round()
    rec = svc.core.records[job]
    assert rec.job.state.value == "running" and rec.shards[0].node == "a" and rec.placed_by != first
    svc.translator.on_event("a", {"event": "job_exit", "job": job, "exit_code": -15, "run_id": first})
    assert not svc._events and svc.store.get_job(job).state == "running"
    svc.translator.on_event("a", {"event": "job_exit", "job": job, "exit_code": 0, "run_id": rec.placed_by})
    svc.round()
    assert svc.store.get_job(job).state == "done"
