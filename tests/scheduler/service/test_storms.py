"""The live loop under load: a node's queued reports reach the core as the latest one, a storm of
lost nodes goes to the core in slices, losing nothing (the log replays the same), and a snapshot
comes once the core has worked long enough that a restart would replay too much."""

from __future__ import annotations

from scheduler import NodeLost, NodeReport, SchedulerState
from scheduler.service.core_log import decode_event
from scheduler.service.journal import replay_check
from scheduler.service.live import SchedulerService

from tests.scheduler.service.svc_helpers import service_with_nodes, telemetry
from nodesvc.bus.messages import telemetry_from

GPU_JOB = {"model": "resnet50", "batch_size": 32, "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30,
           "command": ["python", "train.py"]}


def _quiet(svc: SchedulerService) -> SchedulerService:
    # No broker here: the decisions' commands are not the subject (the rows and the log are).
    svc.commands.spawn = lambda coro, key=None: coro.close()
    return svc


def _logged(svc: SchedulerService) -> list[list]:
    return [[decode_event(p) for p in payloads] for _, payloads in svc.journal.batches(0)]


def test_a_nodes_queued_reports_reach_the_core_as_the_latest_one(store):
    svc = _quiet(service_with_nodes(store, {"n1": (2, 8), "n2": (2, 8)}))
    before = len(_logged(svc))
    for cpus in (9, 10, 11):  # each one changes the node: each one is a report
        svc.translator.on_telemetry(telemetry_from(telemetry("n1", 2, cpus)))
    svc.translator.on_telemetry(telemetry_from(telemetry("n2", 2, 16)))
    assert sum(isinstance(e, NodeReport) for e in svc._events) == 4
    svc.round()
    assert svc.core.nodes["n1"].node.cores == 11 and svc.core.nodes["n2"].node.cores == 16
    batch = _logged(svc)[before]
    reports = [e for e in batch if isinstance(e, NodeReport)]
    assert [(r.node.id, r.node.cores) for r in reports] == [("n1", 11), ("n2", 16)]
    assert svc.stats.coalesced == 2 and not svc._events
    assert svc.translator.published == {} or all(k in {r.stimulus_id for r in reports}
                                                 for k in svc.translator.published)


def test_a_storm_of_lost_nodes_goes_to_the_core_in_slices_and_loses_nothing(store):
    nodes = {f"n{i:02d}": (1, 8) for i in range(30)}
    svc = _quiet(service_with_nodes(store, nodes))
    svc.batch_max_lost = 4
    jobs = [svc.submit({**GPU_JOB, "id": f"j{i:02d}"})[0].id for i in range(30)]
    svc.round()
    assert len(svc.core.running) == 30
    where = {j: svc.core.records[j].shards[0].node for j in jobs}
    lost = sorted(nodes)[:18]
    batches_before = len(_logged(svc))
    for n in lost:
        svc.translator.on_node_state(n, {"status": "offline"})
    svc.translator.on_telemetry(telemetry_from(telemetry("n29", 1, 12)))  # a survivor's report, queued behind the storm
    rounds = 0
    while svc._events:
        svc.round()
        rounds += 1
        assert rounds < 50, "the storm never drained"
    slices = _logged(svc)[batches_before:]
    per_slice = [sum(isinstance(e, NodeLost) for e in b) for b in slices]
    assert sum(per_slice) == 18 and max(per_slice) <= 4 and len(slices) >= 5
    assert svc.core.nodes["n29"].node.cores == 12
    # Nothing lost: every job runs on a node that is still there (the lost nodes' jobs where a
    # survivor's GPU could be shared, the others where they ran) or waits, and its row says the same.
    requeued = 0
    for j in jobs:
        rec, row = svc.core.records[j], svc.store.get_job(j)
        if rec.job.state.value == "running":
            node = rec.shards[0].node
            assert node not in lost and row.state == "running" and row.allocation.node == node
            assert where[j] in lost or node == where[j]
        else:
            assert where[j] in lost and rec.job.state.value in ("queued", "preempted") and row.state == "queued"
        requeued += where[j] in lost and "requeued" in [e["kind"] for e in svc.store.events(job=j)]
    assert requeued == 18
    # The log, cut in slices, replays to the same decisions.
    check = replay_check(svc.journal, lambda: SchedulerState(svc.profile_obj, rules=svc.rules))
    assert check.events > 0 and check.differences == [] and check.unreadable == []


def test_a_snapshot_comes_once_the_core_worked_snapshot_core_s_on_the_batches_since_the_last(store):
    svc = _quiet(service_with_nodes(store, {"n1": (2, 8)}))
    svc.snapshot_events, svc.snapshot_s = 10**9, 10**9  # neither the count nor the clock would call one
    svc.snapshot_core_s = float("inf")
    svc.submit({**GPU_JOB, "id": "a"})
    svc.round()
    assert svc.journal.latest_snapshot() is None and svc.carrier.core_s > 0
    svc.snapshot_core_s = svc.carrier.core_s / 2  # the core's work since the last snapshot is past it
    svc.submit({**GPU_JOB, "id": "b"})
    svc.round()
    snap = svc.journal.latest_snapshot()
    assert snap is not None and snap.batch == svc.carrier.batch and svc.carrier.core_s == 0.0
    assert svc.journal.events_after(snap.batch) == 0  # the log it covers is compacted away
