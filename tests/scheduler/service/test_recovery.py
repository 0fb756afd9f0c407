"""Restart in-process (no broker): the service rebuilds its core from the event log it wrote,
including a log written before the event convention renamed ``id`` to ``stimulus_id``."""

from __future__ import annotations

import json
import logging
import sqlite3

from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import telemetry
from nodesvc.bus.messages import telemetry_from

GPU_JOB = {"model": "resnet50", "batch_size": 32, "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30,
           "command": ["python", "train.py"]}


def _placements(svc: SchedulerService) -> dict[str, tuple]:
    return {j: r.shards for j, r in svc.core.records.items() if r.shards}


async def test_a_database_logged_with_the_old_event_keys_replays_after_an_upgrade(tmp_path, caplog):
    db = tmp_path / "s.db"
    svc = SchedulerService(JobStore(db, synchronous="NORMAL"), profile="fifo")
    svc.translator.on_telemetry(telemetry_from(telemetry("n1", gpus=2)))
    jobs = [svc.submit(dict(GPU_JOB))[0].id for _ in range(3)]
    svc.round()  # one logged batch: the node, three arrivals; two placements
    before = _placements(svc)
    assert len(before) == 2 and set(svc.core.waiting) == set(jobs) - set(before)
    await svc.stop()  # before any command could leave (there is no broker)
    svc.store.close()

    # Rewrite the log as the version before the convention wrote it: "id", not "stimulus_id".
    con = sqlite3.connect(db)
    rows = con.execute("SELECT seq, payload FROM core_events").fetchall()
    assert rows
    for seq, payload in rows:
        body = json.loads(payload)
        body["id"] = body.pop("stimulus_id")
        con.execute("UPDATE core_events SET payload=? WHERE seq=?", (json.dumps(body, sort_keys=True), seq))
    con.commit()
    con.close()

    caplog.set_level(logging.WARNING)
    svc2 = SchedulerService(JobStore(db, synchronous="NORMAL"), profile="fifo")
    try:
        assert _placements(svc2) == before  # the same decisions, from the old log
        assert set(svc2.core.waiting) == set(jobs) - set(before)
        # and what it re-sends are the decisions the table has pending (same ids): nothing new
        assert svc2.recovery.resend
        assert {did for did, _ in svc2.recovery.resend} == {r.id for r in svc2.store.pending_decisions()}
        assert not [r for r in caplog.records if "unreadable" in r.getMessage()]
    finally:
        await svc2.stop()
        svc2.store.close()
