"""The core's journal: every batch of events with the decisions it produced, and snapshots.

The live loop hands the core one batch of events at a time.  Each batch is
logged, in one transaction, with the decisions it produced (the replayable
record, ``core_events`` and ``core_decisions``) and the decisions' rows (the
commands still to carry out, ``decisions``), before any command leaves.

Every ``snapshot_events`` events the loop writes a snapshot of the whole core
(:mod:`scheduler.snapshot`) and compacts: in ONE transaction it stores the
snapshot, drops the older ones, the logged batches it covers and the decision
rows of those batches that were carried out.  A ``kill -9`` at any moment,
during that transaction too, leaves either the old snapshot and the whole log
after it, or the new snapshot and the log after it: never a gap.  A restart
therefore loads one snapshot and replays at most ``snapshot_events`` events.

All SQL on the store's connections (the tables are in
:mod:`scheduler.service.store`'s schema).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from scheduler import SchedulerState, snapshot
from scheduler.replay import differences, replay
from scheduler.service.core_log import CoreLogError, decode_event
from scheduler.service.rows import DecisionRow
from scheduler.service.store import JobStore


@dataclass(frozen=True)
class StoredSnapshot:
    batch: int  # the last batch it includes
    ts: float
    header: dict[str, Any]
    data: bytes


class Journal:
    """The core's log and snapshots in the service's database (see the module docstring)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def record_batch(self, batch: int, events: list[tuple[str, str]], decisions: list[dict[str, Any]],
                     rows: list[DecisionRow]) -> None:
        """Log batch ``batch``: its events (stimulus_id, JSON), every decision it produced
        (codec dicts, in order) and the rows of the decisions to carry out, atomically."""
        with self.store.tx() as db:
            db.executemany("INSERT OR IGNORE INTO core_events (id, batch, payload) VALUES (?,?,?)",
                           [(sid, batch, payload) for sid, payload in events])
            db.execute("INSERT OR REPLACE INTO core_decisions (batch, payload) VALUES (?,?)",
                       (batch, json.dumps(decisions, sort_keys=True, separators=(",", ":"))))
            now = self.store.clock()
            db.executemany(
                "INSERT OR IGNORE INTO decisions (id, ts, kind, job, node, data, state, batch) VALUES (?,?,?,?,?,?,?,?)",
                [(d.id, now, d.kind, d.job, d.node, json.dumps(d.data, sort_keys=True), d.state, batch) for d in rows])

    def batches(self, after: int = 0) -> Iterator[tuple[int, list[str]]]:
        """The logged events of the batches after ``after``, batch by batch, in order."""
        with self.store.read() as db:
            rows = db.execute("SELECT batch, payload FROM core_events WHERE batch > ? ORDER BY seq",
                              (after,)).fetchall()
        cur, acc = None, []
        for b, payload in rows:
            if b != cur and acc:
                yield cur, acc
                acc = []
            cur = b
            acc.append(payload)
        if acc:
            yield cur, acc

    def recorded_decisions(self, after: int = 0) -> dict[int, list[dict[str, Any]]]:
        """The decisions each logged batch after ``after`` produced (codec dicts, in order)."""
        with self.store.read() as db:
            rows = db.execute("SELECT batch, payload FROM core_decisions WHERE batch > ? ORDER BY batch",
                              (after,)).fetchall()
        return {int(b): json.loads(p) for b, p in rows}

    def last_batch(self) -> int:
        """The number of the last batch logged (or covered by a snapshot)."""
        with self.store.read() as db:
            a = db.execute("SELECT MAX(batch) FROM core_events").fetchone()[0]
            b = db.execute("SELECT MAX(batch) FROM snapshots").fetchone()[0]
            c = db.execute("SELECT MAX(batch) FROM core_decisions").fetchone()[0]
        return int(max(a or 0, b or 0, c or 0))

    def events_after(self, batch: int) -> int:
        with self.store.read() as db:
            return int(db.execute("SELECT COUNT(*) FROM core_events WHERE batch > ?", (batch,)).fetchone()[0])

    def first_batch(self) -> int | None:
        """The first batch still in the log (None: empty)."""
        with self.store.read() as db:
            v = db.execute("SELECT MIN(batch) FROM core_events").fetchone()[0]
        return None if v is None else int(v)

    def latest_snapshot(self) -> StoredSnapshot | None:
        with self.store.read() as db:
            r = db.execute("SELECT batch, ts, header, data FROM snapshots ORDER BY batch DESC LIMIT 1").fetchone()
        if r is None:
            return None
        return StoredSnapshot(int(r[0]), float(r[1]), json.loads(r[2]), bytes(r[3]))

    def write_snapshot(self, batch: int, data: bytes, header: dict[str, Any]) -> int:
        """Store the snapshot taken after ``batch`` and compact, in one transaction (see the module
        docstring).  Returns how many logged events it dropped."""
        with self.store.tx() as db:
            db.execute("INSERT OR REPLACE INTO snapshots (batch, ts, header, data) VALUES (?,?,?,?)",
                       (batch, self.store.clock(), json.dumps(header, sort_keys=True), data))
            db.execute("DELETE FROM snapshots WHERE batch < ?", (batch,))
            dropped = db.execute("DELETE FROM core_events WHERE batch <= ?", (batch,)).rowcount
            db.execute("DELETE FROM core_decisions WHERE batch <= ?", (batch,))
            db.execute("DELETE FROM decisions WHERE batch <= ? AND state NOT IN ('pending','sent')", (batch,))
        return dropped

    def meta(self, key: str) -> str | None:
        with self.store.read() as db:
            r = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if r is None else str(r[0])

    def set_meta(self, key: str, value: str) -> None:
        with self.store.tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


@dataclass
class ReplayCheck:
    """What :func:`replay_check` found: where the replay started, how much it replayed, and where
    its decisions departed from the recorded ones (empty: nowhere)."""

    start: str
    batches: int = 0
    events: int = 0
    differences: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def replay_check(journal: Journal, fresh: Callable[[], SchedulerState]) -> ReplayCheck:
    """Replay a service's logged run through the core the simulator drives, from its latest
    snapshot (else from ``fresh()``, built as the service built its core), and compare every
    batch's decisions with the ones the service recorded."""
    snap = journal.latest_snapshot()
    if snap is not None:
        state, after, start = snapshot.load(snap.data), snap.batch, f"the snapshot after batch {snap.batch}"
    else:
        state, after, start = fresh(), 0, "a fresh core"
    out = ReplayCheck(start)
    batches = []
    for n, payloads in journal.batches(after):
        try:
            batches.append((n, [decode_event(p) for p in payloads]))
        except CoreLogError as exc:
            out.unreadable.append(f"batch {n}: {exc}")
    out.batches = len(batches)
    out.events = sum(len(evs) for _, evs in batches)
    out.differences = differences(journal.recorded_decisions(after), replay(state, batches))
    return out
