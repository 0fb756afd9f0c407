"""kill -9 in the middle of a compaction: a child process runs the real service (in-process, no
broker) over a stream of events, then snapshots and compacts, and SIGKILLs itself right after one
of the compaction's statements, before the commit.  The database it leaves must restore the core
exactly as it was before the compaction: the old snapshot (or none) and the whole log after it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scheduler.service.journal import Journal
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import ROOT

CHILD = r'''
import json, os, signal, sys
from nodesvc.bus.messages import telemetry_from
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import telemetry

db, out, kill_after, first_snapshot = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
svc = SchedulerService(JobStore(db, synchronous="NORMAL"), profile="dlshare", snapshot_events=1 << 30)
svc.commands.spawn = lambda coro, key=None: coro.close()  # no broker: decisions are logged, not sent
t = 1000.0
svc.clock = lambda: t
svc.carrier.clock = svc.clock


def step(i):
    global t
    t += 1.0
    tel = telemetry(f"n{i % 4}", gpus=2, cpus=16)
    svc.translator.on_telemetry(telemetry_from(tel))
    if i % 2 == 0:
        svc.submit({"model": "resnet50", "gpus": 1 + i % 2, "cpus": 1.0, "memory_bytes": 1 << 30,
                    "command": ["x"]})
    if i % 5 == 0:
        svc.submit({"kind": "data_prep", "gpus": 0, "cpus": 2.0, "memory_bytes": 1 << 30, "command": ["y"]})
    svc.round()
    running = sorted(svc.core.running)
    if i % 3 == 0 and running:
        j = running[0]
        node = svc.core.records[j].shards[0].node
        svc.translator.job_exited(node, j, 0, "")
        svc.round()


for i in range(40):
    step(i)
if first_snapshot:
    assert svc.maybe_snapshot(t, force=True)
    for i in range(40, 70):
        step(i)
state = {j: [r.job.state.value, [[s.node, list(s.gpus)] for s in r.shards]]
         for j, r in svc.core.records.items() if r.job.state.active}
open(out, "w").write(json.dumps({"state": state, "batch": svc.carrier.batch}))

real = JobStore.db.fget


class Killing:
    """This thread's connection, but the process dies right after the statement that starts with kill_after."""

    def __init__(self, con):
        self.con = con

    def execute(self, sql, *args):
        cur = self.con.execute(sql, *args)
        if sql.lstrip().upper().startswith(kill_after.upper()):
            os.kill(os.getpid(), signal.SIGKILL)
        return cur

    def __getattr__(self, name):
        return getattr(self.con, name)


JobStore.db = property(lambda self: Killing(real(self)))
svc.maybe_snapshot(t + 1, force=True)
print("the compaction finished: the kill never came", flush=True)
'''

# After the first, a middle and the last statement of the compaction's transaction.
POINTS = ["INSERT OR REPLACE INTO snapshots", "DELETE FROM core_events", "DELETE FROM decisions"]


@pytest.mark.parametrize("first_snapshot", [False, True], ids=["no-snapshot-yet", "after-a-snapshot"])
@pytest.mark.parametrize("kill_after", POINTS)
def test_a_kill_inside_the_compaction_restores_the_core_as_it_was(tmp_path, kill_after, first_snapshot):
    db, out = tmp_path / "c.db", tmp_path / "expected.json"
    p = subprocess.run([sys.executable, "-c", CHILD, str(db), str(out), kill_after, "1" if first_snapshot else "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr[-2000:])
    expected = json.loads(out.read_text())
    store = JobStore(db, synchronous="NORMAL")
    try:
        journal = Journal(store)
        snap = journal.latest_snapshot()
        assert (snap is not None) == first_snapshot  # the new snapshot never landed
        first = journal.first_batch()
        # No gap: the log continues right after the snapshot (or starts at the first batch).
        assert first == (snap.batch + 1 if snap else 1) and journal.last_batch() == expected["batch"]
        svc = SchedulerService(store, profile="dlshare")
        state = {j: [r.job.state.value, [[s.node, list(s.gpus)] for s in r.shards]]
                 for j, r in svc.core.records.items() if r.job.state.active}
        assert state == expected["state"] and len(state) > 5
        assert svc.recovery.report["from"] == (f"snapshot after batch {snap.batch}" if snap else "the whole log")
    finally:
        store.close()
