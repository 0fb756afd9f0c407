"""Lent memory in the live service, in-process on an injected clock (no broker): a job's lent
budget reaches the node's ``run`` command, a donor whose lendable memory falls below what the core
promised on it becomes ``DonorReclaimed``, a lost donor takes its lent memory back, and bad budgets
get clear errors."""

from __future__ import annotations

import asyncio

from scheduler import DonorReclaimed, JobState
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from scheduler.service.translate import donor_reclaim
from tests.scheduler.service.svc_helpers import telemetry
from nodesvc.bus.messages import telemetry_from

GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def donor_telemetry(node: str, lendable: int, lent: int = 0) -> dict:
    t = telemetry(node, gpus=0)
    t["donor"] = {"enabled": True, "lendable_bytes": lendable, "lent_bytes": lent, "slab_bytes": GiB}
    return t


def service(tmp_path, clock, sent):
    svc = SchedulerService(JobStore(tmp_path / "t.db", synchronous="NORMAL"), profile="dlshare", clock=clock,
                           node_timeout_s=10.0, report_s=5.0)

    async def send(node, op, args, cmd_id, stages=None):
        sent.append((node, op, args))
        return {"ok": True}

    svc.commands.send = send
    svc.commands.spawn = lambda coro, key=None: asyncio.run(coro)
    return svc


def spec(**kw):
    return {"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": GiB, "command": ["python", "train.py"], **kw}


def test_a_lent_budget_reaches_the_run_command_and_a_reclaim_shrinks_it(tmp_path):
    clock, sent = Clock(), []
    svc = service(tmp_path, clock, sent)
    svc.translator.on_telemetry(telemetry_from(telemetry("gpu0", gpus=1)))
    svc.translator.on_telemetry(telemetry_from(donor_telemetry("prep0", 40 * GiB)))
    svc.round()
    assert svc.core.ledger.pool.total_capacity() == 40 * GiB
    job = svc.submit(spec(remote_memory_bytes=8 * GiB))[0].id
    svc.round()
    runs = [a for _, op, a in sent if op == "run"]
    assert runs and runs[0]["job"] == job and runs[0]["remote_memory_bytes"] == 8 * GiB
    assert svc.core.ledger.pool.promised_on("prep0") == 8 * GiB
    # The donor lends 8 GiB to the job now and needs most of its memory back: 2 GiB free + 4 GiB lent.
    clock.t += 1.0
    svc.translator.on_telemetry(telemetry_from(donor_telemetry("prep0", 2 * GiB, 4 * GiB)))
    reclaims = [e for e in svc._events if isinstance(e, DonorReclaimed)]
    assert [(e.node, e.bytes) for e in reclaims] == [("prep0", 34 * GiB)]
    svc.round()
    rec = svc.core.records[job]
    assert rec.job.state is JobState.RUNNING  # never stopped for it
    assert rec.allocation["gpu0"].remote_bytes == 6 * GiB
    assert svc.core.ledger.pool.reclaimed_bytes == 2 * GiB


def test_a_lost_donor_takes_its_lent_memory_back_and_the_job_runs_on(tmp_path):
    clock, sent = Clock(), []
    svc = service(tmp_path, clock, sent)
    svc.translator.on_telemetry(telemetry_from(telemetry("gpu0", gpus=1)))
    svc.translator.on_telemetry(telemetry_from(donor_telemetry("prep0", 40 * GiB)))
    svc.round()
    job = svc.submit(spec(remote_memory_bytes=4 * GiB))[0].id
    svc.round()
    svc.translator.on_node_state("prep0", {"status": "offline"})
    svc.round()
    rec = svc.core.records[job]
    assert rec.job.state is JobState.RUNNING and rec.allocation["gpu0"].remote_bytes == 0
    assert svc.core.ledger.pool.total_capacity() == 0


def test_donor_reclaim_is_posted_only_when_promises_are_hit(tmp_path):
    clock, sent = Clock(), []
    svc = service(tmp_path, clock, sent)
    svc.translator.on_telemetry(telemetry_from(telemetry("gpu0", gpus=1)))
    svc.translator.on_telemetry(telemetry_from(donor_telemetry("prep0", 40 * GiB)))
    svc.round()
    assert donor_reclaim(svc.core, "prep0", 1 * GiB, 0.0) is None  # nothing promised on it yet
    assert donor_reclaim(svc.core, "nope", 0, 0.0) is None
    svc.submit(spec(remote_memory_bytes=8 * GiB))
    svc.round()
    assert donor_reclaim(svc.core, "prep0", 20 * GiB, 0.0) is None  # still covers the promise
    ev = donor_reclaim(svc.core, "prep0", 6 * GiB, 5.0)
    assert ev is not None and ev.bytes == 34 * GiB and ev.now == 5.0 and ev.stimulus_id


def test_a_budget_larger_than_the_donors_lend_is_rejected_with_the_reason(tmp_path):
    clock, sent = Clock(), []
    svc = service(tmp_path, clock, sent)
    svc.translator.on_telemetry(telemetry_from(telemetry("gpu0", gpus=1)))
    svc.translator.on_telemetry(telemetry_from(donor_telemetry("prep0", 40 * GiB)))
    svc.round()
    job = svc.submit(spec(remote_memory_bytes=100 * GiB))[0].id
    svc.round()
    row = svc.store.get_job(job)
    assert row.state == "failed" and "donors lend at most" in (row.reason or "")
    assert not [a for _, op, a in sent if op == "run"]

