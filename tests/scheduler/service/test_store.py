"""SQLite store (WAL, idempotent decisions, token file) and the core event log codec."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Job, JobArrived, JobFinished, JobSample, Node, NodeLost, NodeReport, Tick
from scheduler.service.core_log import CoreLogError, decode_event, encode_event
from scheduler.service.journal import Journal
from scheduler.service.rows import ConflictError, DecisionRow, JobAllocation, Owner, WaitingLimits
from scheduler.service.store import SCHEMA_VERSION, JobStore, load_or_create_token


def test_wal_mode_and_job_round_trip(tmp_path):
    s = JobStore(tmp_path / "a.db")
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    row, created = s.add_job("j1", {"gpus": 1, "command": ["x"]})
    assert created and row.state == "queued"
    assert s.add_job("j1", {"gpus": 1, "command": ["x"]})[1] is False
    with pytest.raises(ConflictError):
        s.add_job("j1", {"gpus": 2, "command": ["x"]})
    alloc = JobAllocation("n1", (0,), 1.0, 1 << 30, (("n1", (0,)),))
    s.update_job("j1", event="placed", node="n1", state="running", allocation=alloc)
    s.close()
    s2 = JobStore(tmp_path / "a.db")
    j = s2.get_job("j1")
    assert j.state == "running" and j.allocation == alloc and j.as_api()["allocation"]["gpus"] == [0]
    assert [e["kind"] for e in s2.events(job="j1")] == ["submitted", "placed"]
    with pytest.raises(ValueError, match="unknown job fields"):
        s2.update_job("j1", colour="red")
    # A job that is over stays over: the loop's later bookkeeping cannot revive it.
    assert s2.update_job("j1", event="cancelled", state="cancelled", only_active=True)
    assert not s2.update_job("j1", event="placed", state="running", only_active=True)
    assert s2.get_job("j1").state == "cancelled" and [e["kind"] for e in s2.events(job="j1")][-1] == "cancelled"


def test_decisions_are_idempotent_by_id(store):
    d = DecisionRow(id="ev-1/place/j1", kind="place", job="j1", node="n1", data={"gpus": [0]})
    j = Journal(store)
    j.record_batch(1, [("ev-1", '{"type":"Tick","stimulus_id":"ev-1","now":1.0}')], [{"type": "Wakeup"}], [d])
    j.record_batch(1, [("ev-1", '{"type":"Tick","stimulus_id":"ev-1","now":1.0}')], [{"type": "Wakeup"}], [d])
    assert store.record_decision(d) is False
    assert [r.id for r in store.pending_decisions()] == [d.id] and store.pending_decisions()[0].batch == 1
    store.set_decision_state(d.id, "acked", {"pid": 7})
    assert store.decision(d.id).state == "acked" and store.decision(d.id).reply == {"pid": 7}
    assert store.pending_decisions() == []
    assert [b for b, _ in j.batches()] == [1] and j.recorded_decisions() == {1: [{"type": "Wakeup"}]}
    assert j.last_batch() == 1


def test_a_snapshot_compacts_the_log_in_one_transaction(store):
    j = Journal(store)
    for b in range(1, 6):
        rows = [DecisionRow(id=f"d{b}", kind="place", job=f"j{b}", node=None, state="acked" if b < 3 else "pending")]
        j.record_batch(b, [(f"e{b}", f'{{"type":"Tick","stimulus_id":"e{b}","now":{b}}}')], [], rows)
    # A fault inside the transaction leaves everything as it was (as a kill -9 would).
    real = store.clock

    def boom():
        raise RuntimeError("killed mid-compaction")

    store.clock = boom
    with pytest.raises(RuntimeError):
        j.write_snapshot(3, b"snap", {"batch": 3})
    store.clock = real
    assert j.latest_snapshot() is None and [b for b, _ in j.batches()] == [1, 2, 3, 4, 5]
    assert j.write_snapshot(3, b"snap", {"batch": 3}) == 3
    snap = j.latest_snapshot()
    assert (snap.batch, snap.data, snap.header) == (3, b"snap", {"batch": 3})
    assert [b for b, _ in j.batches()] == [4, 5] and j.first_batch() == 4 and j.last_batch() == 5
    assert store.decision("d1") is None and store.decision("d3") is not None  # pending rows stay
    assert j.events_after(3) == 2


def test_a_version_1_database_is_upgraded_in_place(tmp_path):
    import sqlite3

    path = tmp_path / "v1.db"
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
        CREATE TABLE decisions (id TEXT PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, job TEXT, node TEXT,
                                data TEXT NOT NULL, state TEXT NOT NULL, reply TEXT);
        INSERT INTO decisions VALUES ('old/place/j', 1.0, 'place', 'j', NULL, '{}', 'pending', NULL);
    """)
    con.commit()
    con.close()
    s = JobStore(path)
    assert [r.id for r in s.pending_decisions()] == ["old/place/j"] and s.pending_decisions()[0].batch is None
    assert s.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == str(SCHEMA_VERSION)
    s.close()


def test_a_version_2_database_keeps_its_jobs_without_an_owner(tmp_path):
    """Promise: a database from before jobs had owners is upgraded in place: its jobs stay, owned
    by nobody (an admin sees them; they run as the bootstrap token's user), and new jobs get one."""
    s = JobStore(tmp_path / "v2.db")
    s.add_job("old", {"gpus": 0, "cpus": 1.0, "command": ["x"]})
    s.db.execute("UPDATE meta SET value='2' WHERE key='schema'")
    s.close()
    con = sqlite3.connect(tmp_path / "v2.db")  # as version 2 had it: no owner columns, no tokens
    con.executescript("DROP INDEX IF EXISTS jobs_owner; DROP INDEX IF EXISTS jobs_account; DROP TABLE tokens;"
                      "ALTER TABLE jobs DROP COLUMN user; ALTER TABLE jobs DROP COLUMN account;")
    con.close()
    s = JobStore(tmp_path / "v2.db")
    old = s.get_job("old")
    assert old is not None and (old.user, old.account) == ("", "")
    row, _ = s.add_job("new", {"gpus": 0, "cpus": 1.0, "command": ["x"]}, Owner("alice", "vision"))
    assert (s.get_job("new").user, s.get_job("new").account) == ("alice", "vision")
    assert [r.id for r in s.list_jobs(user="alice")[0]] == ["new"]
    assert s.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == str(SCHEMA_VERSION)
    s.close()


def test_the_database_is_private(tmp_path):
    """Promise: the database (token digests, the aggregation key) is readable by its owner only,
    even when an older one was not."""
    s = JobStore(tmp_path / "p.db")
    s.add_job("j", {"gpus": 0, "cpus": 1.0, "command": ["x"]})
    s.close()
    assert os.stat(tmp_path / "p.db").st_mode & 0o777 == 0o600
    os.chmod(tmp_path / "p.db", 0o644)
    JobStore(tmp_path / "p.db").close()
    assert os.stat(tmp_path / "p.db").st_mode & 0o777 == 0o600


def test_waiting_limits_count_a_burst_in_one_transaction(tmp_path):
    """Promise: the per-user and per-account admission limits count the jobs of the same group
    commit, and only waiting (queued or preempted) jobs count."""
    s = JobStore(tmp_path / "q.db")
    lim = WaitingLimits(per_user=2, per_account=3)
    spec = {"gpus": 0, "cpus": 1.0, "command": ["x"]}
    out = s.add_jobs([(f"a{i}", spec, Owner("alice", "lab")) for i in range(3)]
                     + [(f"b{i}", spec, Owner("bob", "lab")) for i in range(2)], lim)
    kinds = [type(r).__name__ if isinstance(r, Exception) else "ok" for r in out]
    assert kinds == ["ok", "ok", "QuotaError", "ok", "QuotaError"], kinds
    assert "sched.max_waiting_per_account" in str(out[4]) and "sched.max_waiting_per_user" in str(out[2])
    s.update_job("a0", state="running")
    assert not isinstance(s.add_jobs([("a3", spec, Owner("alice", "other"))], lim)[0], Exception)
    assert s.add_job("a1", spec, Owner("alice", "lab"), lim)[1] is False  # resubmitting is not a new job
    with pytest.raises(ConflictError):
        s.add_job("a1", spec, Owner("bob", "lab"))  # another user's id
    s.close()


def test_each_thread_has_its_own_connection(tmp_path):
    import threading

    s = JobStore(tmp_path / "t.db")
    mine = s.db
    seen = []
    t = threading.Thread(target=lambda: (seen.append(s.db), s.add_job("from-thread", {"gpus": 0, "command": ["x"]})))
    t.start()
    t.join()
    assert seen[0] is not mine and s.get_job("from-thread") is not None
    s.close()


def test_token_generated_once_with_mode_0600(tmp_path):
    db = str(tmp_path / "x" / "s.db")
    t1 = load_or_create_token(db)
    assert len(t1) >= 32 and load_or_create_token(db) == t1
    mode = stat.S_IMODE(os.stat(db + ".token").st_mode)
    assert mode == 0o600
    assert load_or_create_token(db, "configured") == "configured"


EVENTS = [
    JobArrived("e1", 1.0, Job("j", "resnet50", batch_size=32, gpus=2, cpus=1.5, memory_bytes=1 << 30,
                              features={"flops": 1e9})),
    JobFinished("e2", 2.0, "j", failed=True, reason="exit 3"),
    NodeReport("e3", 3.0, Node("n", gpus=4, cores=16, memory_bytes=64 << 30, lendable_bytes=5),
               gpu_util=(1.0, 2.0), cpu_percent=3.0, memory_available_bytes=7, jobs={"j": JobSample(sm_percent=40.0)}),
    NodeLost("e4", 4.0, "n"),
    Tick("e5", 5.0),
]


@pytest.mark.parametrize("ev", EVENTS, ids=lambda e: type(e).__name__)
def test_core_events_round_trip(ev):
    assert decode_event(encode_event(ev)) == ev


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.builds(lambda d: json.dumps(d),
                                          st.dictionaries(st.sampled_from(["type", "stimulus_id", "id", "now", "job", "node"]),
                                                          st.none() | st.text(max_size=5) | st.integers() |
                                                          st.sampled_from(["Tick", "JobArrived", "NodeReport"]))))
def test_fuzz_decode_raises_only_core_log_error(text):
    try:
        ev = decode_event(text)
    except CoreLogError as exc:
        assert str(exc)
    else:
        assert decode_event(encode_event(ev)) == ev


def test_a_line_logged_before_the_event_convention_decodes():
    for ev in EVENTS:
        body = json.loads(encode_event(ev))
        body["id"] = body.pop("stimulus_id")  # how the log was written before the convention
        assert decode_event(json.dumps(body)) == ev
