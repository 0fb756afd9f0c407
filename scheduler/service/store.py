"""Durable state of the scheduler service: jobs, their events and the decisions sent to nodes.

SQLite in WAL mode.  A job is acknowledged to its launcher only after its row
is committed, so ``kill -9`` of the service loses no accepted job (WAL with
``synchronous=FULL`` also survives a power cut; ``NORMAL`` survives a process
kill and is faster).

Decisions are keyed by their id: :meth:`JobStore.record_decision` returns
False for an id it has seen, so a decision replayed after a restart is not
applied twice, and a command is re-sent with the same id until a node acks it.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    allocation TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    exit_code INTEGER,
    attained_service REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    job TEXT,
    node TEXT,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job, seq);
CREATE TABLE IF NOT EXISTS decisions (
    id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    job TEXT,
    node TEXT,
    data TEXT NOT NULL,
    state TEXT NOT NULL,
    reply TEXT
);
CREATE INDEX IF NOT EXISTS decisions_state ON decisions(state);
CREATE TABLE IF NOT EXISTS core_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    batch INTEGER NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS core_events_batch ON core_events(batch, seq);
"""


@dataclass
class JobRow:
    """One job as stored; ``spec`` and ``allocation`` are plain dicts."""

    id: str
    spec: dict[str, Any]
    state: str
    submitted_at: float
    seq: int = 0
    reason: str | None = None
    allocation: dict[str, Any] | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    attained_service: float = 0.0
    attempts: int = 0
    updated_at: float = 0.0

    def as_api(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "id", "spec", "state", "reason", "allocation", "submitted_at", "started_at",
            "finished_at", "exit_code", "attained_service", "attempts")}


@dataclass
class DecisionRow:
    id: str
    kind: str
    job: str | None
    node: str | None
    data: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    ts: float = 0.0
    reply: dict[str, Any] | None = None


class ConflictError(ValueError):
    """A job id that exists with a different spec."""


def _row_to_job(r: sqlite3.Row) -> JobRow:
    return JobRow(
        id=r["id"], spec=json.loads(r["spec"]), state=r["state"], submitted_at=r["submitted_at"], seq=r["seq"],
        reason=r["reason"], allocation=json.loads(r["allocation"]) if r["allocation"] else None,
        started_at=r["started_at"], finished_at=r["finished_at"], exit_code=r["exit_code"],
        attained_service=r["attained_service"], attempts=r["attempts"], updated_at=r["updated_at"],
    )


class JobStore:
    """All SQL lives here.  One connection, used from the service's event loop thread
    (a lock guards the rare use from another thread, e.g. a test)."""

    def __init__(self, path: str | os.PathLike[str], synchronous: str = "FULL", clock=time.time) -> None:
        """``synchronous`` applies to what a caller is told is accepted (a job, a cancel); the loop's
        own bookkeeping commits with NORMAL, which survives a process kill and is made durable by
        the next FULL commit or checkpoint."""
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous!r}")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._lock = threading.RLock()
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if self.path != ":memory:" and mode.lower() != "wal":
            raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode})")
        self.durable_level = synchronous.upper()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(_DDL)
        with self.tx():
            got = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if got is None:
                self.db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(got[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"{self.path}: database schema {got[0]}, this service needs {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self.db.close()

    @contextmanager
    def tx(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if durable and self.durable_level != "NORMAL":
                self.db.execute(f"PRAGMA synchronous={self.durable_level}")
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            finally:
                if durable and self.durable_level != "NORMAL" and not self.db.in_transaction:
                    self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("COMMIT")
            if durable and self.durable_level != "NORMAL":
                self.db.execute("PRAGMA synchronous=NORMAL")

    # --- jobs -------------------------------------------------------------------------------

    def add_job(self, job_id: str | None, spec: dict[str, Any]) -> tuple[JobRow, bool]:
        """Insert a queued job and its ``submitted`` event in one transaction.

        Returns (job, created).  Resubmitting an existing id with an equal spec
        returns the stored job (created=False); with a different spec it raises
        :class:`ConflictError`.
        """
        res = self.add_jobs([(job_id, spec)])[0]
        if isinstance(res, Exception):
            raise res
        return res

    def add_jobs(self, items: list[tuple[str | None, dict[str, Any]]]) -> list[tuple[JobRow, bool] | ConflictError]:
        """:meth:`add_job` for several submissions in ONE durable transaction (group commit:
        one fsync for all of them).  A clashing id yields a ConflictError in its slot only."""
        now = self.clock()
        out: list[tuple[JobRow, bool] | ConflictError] = []
        with self.tx(durable=True) as db:
            for job_id, spec in items:
                jid = job_id or f"job-{uuid.uuid4().hex[:12]}"
                body = json.dumps({**spec, "id": jid}, sort_keys=True)
                old = db.execute("SELECT * FROM jobs WHERE id=?", (jid,)).fetchone()
                if old is not None:
                    if json.loads(old["spec"]) != json.loads(body):
                        out.append(ConflictError(f"job {jid} exists with a different spec"))
                    else:
                        out.append((_row_to_job(old), False))
                    continue
                cur = db.execute(
                    "INSERT INTO jobs (id, spec, state, submitted_at, updated_at) VALUES (?,?,?,?,?)",
                    (jid, body, "queued", now, now))
                self._event(db, "submitted", job=jid, data={"gpus": spec.get("gpus", 0), "cpus": spec.get("cpus")})
                out.append((JobRow(id=jid, spec=json.loads(body), state="queued", submitted_at=now,
                                   seq=cur.lastrowid, updated_at=now), True))
        return out

    def get_job(self, job_id: str) -> JobRow | None:
        with self._lock:
            r = self.db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _row_to_job(r) if r else None

    def list_jobs(self, states: Iterable[str] | None = None, limit: int = 1000, offset: int = 0) -> tuple[list[JobRow], int]:
        q, args = "FROM jobs", []
        states = list(states or [])
        if states:
            q += " WHERE state IN (%s)" % ",".join("?" * len(states))
            args += states
        with self._lock:
            total = self.db.execute(f"SELECT COUNT(*) {q}", args).fetchone()[0]
            rows = self.db.execute(f"SELECT * {q} ORDER BY seq LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()
        return [_row_to_job(r) for r in rows], total

    def count_by_state(self) -> dict[str, int]:
        with self._lock:
            rows = self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {r[0]: r[1] for r in rows}

    def update_job(self, job_id: str, event: str | None = None, event_data: dict[str, Any] | None = None,
                   node: str | None = None, durable: bool = False, **fields: Any) -> None:
        """Change a job's columns and log one event about it, atomically."""
        allowed = {"state", "reason", "allocation", "started_at", "finished_at", "exit_code",
                   "attained_service", "attempts"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown job fields {sorted(bad)}")
        if "allocation" in fields and fields["allocation"] is not None:
            fields["allocation"] = json.dumps(fields["allocation"], sort_keys=True)
        fields["updated_at"] = self.clock()
        sets = ", ".join(f"{k}=?" for k in fields)
        with self.tx(durable) as db:
            db.execute(f"UPDATE jobs SET {sets} WHERE id=?", [*fields.values(), job_id])
            if event:
                self._event(db, event, job=job_id, node=node, data=event_data or {})

    def set_service(self, amounts: dict[str, float]) -> None:
        """Record attained service (GPU- or CPU-seconds) of running jobs, in one transaction."""
        if not amounts:
            return
        with self.tx() as db:
            db.executemany("UPDATE jobs SET attained_service = ? WHERE id=?", [(v, k) for k, v in amounts.items()])

    # --- events -----------------------------------------------------------------------------

    def _event(self, db: sqlite3.Connection, kind: str, job: str | None = None, node: str | None = None,
               data: dict[str, Any] | None = None, event_id: str | None = None) -> str:
        eid = event_id or f"ev-{uuid.uuid4().hex[:16]}"
        db.execute("INSERT OR IGNORE INTO events (id, ts, kind, job, node, data) VALUES (?,?,?,?,?,?)",
                   (eid, self.clock(), kind, job, node, json.dumps(data or {}, sort_keys=True, default=str)))
        return eid

    def log_event(self, kind: str, job: str | None = None, node: str | None = None,
                  data: dict[str, Any] | None = None, event_id: str | None = None) -> str:
        with self.tx() as db:
            return self._event(db, kind, job, node, data, event_id)

    def events(self, job: str | None = None, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM events WHERE seq > ?", [after]
        if job is not None:
            q += " AND job=?"
            args.append(job)
        q += " ORDER BY seq LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self.db.execute(q, args).fetchall()
        return [{"seq": r["seq"], "id": r["id"], "ts": r["ts"], "kind": r["kind"], "job": r["job"],
                 "node": r["node"], "data": json.loads(r["data"])} for r in rows]

    # --- decisions ----------------------------------------------------------------------------

    def record_decision(self, d: DecisionRow) -> bool:
        """Persist a decision before it is carried out; False if this id was already recorded."""
        with self.tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO decisions (id, ts, kind, job, node, data, state) VALUES (?,?,?,?,?,?,?)",
                (d.id, self.clock(), d.kind, d.job, d.node, json.dumps(d.data, sort_keys=True), d.state))
            return cur.rowcount == 1

    def decision(self, decision_id: str) -> DecisionRow | None:
        with self._lock:
            r = self.db.execute("SELECT * FROM decisions WHERE id=?", (decision_id,)).fetchone()
        if r is None:
            return None
        return DecisionRow(id=r["id"], kind=r["kind"], job=r["job"], node=r["node"], data=json.loads(r["data"]),
                           state=r["state"], ts=r["ts"], reply=json.loads(r["reply"]) if r["reply"] else None)

    def set_decision_state(self, decision_id: str, state: str, reply: dict[str, Any] | None = None) -> None:
        with self.tx() as db:
            db.execute("UPDATE decisions SET state=?, reply=? WHERE id=?",
                       (state, json.dumps(reply) if reply is not None else None, decision_id))

    def record_batch(self, batch: int, events: list[tuple[str, str]], decisions: list[DecisionRow]) -> list[bool]:
        """Log one batch of core events (id, JSON payload) and the decisions it produced, atomically.
        Returns, per decision, True if it is new (False: replayed, already recorded)."""
        out = []
        with self.tx() as db:
            db.executemany("INSERT OR IGNORE INTO core_events (id, batch, payload) VALUES (?,?,?)",
                           [(eid, batch, payload) for eid, payload in events])
            now = self.clock()
            for d in decisions:
                cur = db.execute(
                    "INSERT OR IGNORE INTO decisions (id, ts, kind, job, node, data, state) VALUES (?,?,?,?,?,?,?)",
                    (d.id, now, d.kind, d.job, d.node, json.dumps(d.data, sort_keys=True), d.state))
                out.append(cur.rowcount == 1)
        return out

    def core_batches(self) -> Iterator[tuple[int, list[str]]]:
        """The logged core events, batch by batch, in order (for replay at start)."""
        with self._lock:
            rows = self.db.execute("SELECT batch, payload FROM core_events ORDER BY seq").fetchall()
        cur_batch, acc = None, []
        for b, payload in rows:
            if b != cur_batch and acc:
                yield cur_batch, acc
                acc = []
            cur_batch = b
            acc.append(payload)
        if acc:
            yield cur_batch, acc

    def last_batch(self) -> int:
        with self._lock:
            r = self.db.execute("SELECT MAX(batch) FROM core_events").fetchone()
        return int(r[0] or 0)

    def decision_states(self) -> dict[str, str]:
        with self._lock:
            return {r[0]: r[1] for r in self.db.execute("SELECT id, state FROM decisions").fetchall()}

    def pending_decisions(self) -> list[DecisionRow]:
        with self._lock:
            ids = [r[0] for r in self.db.execute(
                "SELECT id FROM decisions WHERE state IN ('pending','sent') ORDER BY ts").fetchall()]
        return [d for d in (self.decision(i) for i in ids) if d is not None]


def load_or_create_token(db_path: str, configured: str = "") -> str:
    """The bearer token: the configured one, else the one stored beside the DB (mode 0600),
    else a new random one written there at first start."""
    if configured:
        return configured
    tpath = Path(db_path).with_name(Path(db_path).name + ".token") if db_path != ":memory:" else None
    if tpath is None:
        return secrets.token_urlsafe(32)
    if tpath.exists():
        try:
            tok = tpath.read_bytes()[:4096].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"token file {tpath} does not hold a text token; remove it to have a new one made")
        if tok:
            return tok
    tpath.parent.mkdir(parents=True, exist_ok=True)
    tok = secrets.token_urlsafe(32)
    fd = os.open(tpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(tok + "\n")
    os.chmod(tpath, 0o600)
    return tok
