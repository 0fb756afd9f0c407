"""Durable state of the scheduler service: jobs, their events and the decisions sent to nodes.

SQLite in WAL mode.  A job is acknowledged to its launcher only after its row
is committed, so ``kill -9`` of the service loses no accepted job (WAL with
``synchronous=FULL`` also survives a power cut; ``NORMAL`` survives a process
kill and is faster).

Each thread gets its own connection (the HTTP API's thread inserts jobs while
the live loop's thread logs batches and updates rows; WAL lets readers and one
writer go on together, and ``busy_timeout`` queues writers).  An in-memory
database (tests) has one connection behind a lock.

Decisions are keyed by their id: :meth:`JobStore.record_decision` returns
False for an id it has seen, so a decision replayed after a restart is not
applied twice, and a command is re-sent with the same id until a node acks it.
The core's event log and its snapshots live in the same file
(:mod:`scheduler.service.journal`), and so do the users' tokens (:mod:`scheduler.service.tokens`).
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nodesvc.bus.ids import stimulus_id
from scheduler.service.rows import (
    TERMINAL, ConflictError, DecisionRow, JobAllocation, JobRow, Owner, QuotaError, WaitingLimits,
)

# 2: decisions.batch, core_decisions, snapshots; 3: jobs.user/account (a job's owner) and tokens.
# An older database is upgraded in place, in one transaction.
SCHEMA_VERSION = 3

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
    updated_at REAL NOT NULL,
    user TEXT NOT NULL DEFAULT '',
    account TEXT NOT NULL DEFAULT ''
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
    reply TEXT,
    batch INTEGER
);
CREATE INDEX IF NOT EXISTS decisions_state ON decisions(state);
CREATE TABLE IF NOT EXISTS core_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    batch INTEGER NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS core_events_batch ON core_events(batch, seq);
CREATE TABLE IF NOT EXISTS core_decisions (
    batch INTEGER PRIMARY KEY,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    user TEXT NOT NULL,
    account TEXT NOT NULL DEFAULT '',
    admin INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    revoked_at REAL,
    note TEXT NOT NULL DEFAULT '',
    created_by TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS snapshots (
    batch INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    header TEXT NOT NULL,
    data BLOB NOT NULL
);
"""
_UPGRADES = {  # from version -> the columns (table, column, declaration) that bring a database to the next one
    1: [("decisions", "batch", "INTEGER")],
    2: [("jobs", "user", "TEXT NOT NULL DEFAULT ''"),  # jobs from before: no owner (they run as the
        ("jobs", "account", "TEXT NOT NULL DEFAULT ''")],  # bootstrap token's user); tokens: CREATE IF NOT EXISTS
}
class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()


def _row_to_job(r: sqlite3.Row) -> JobRow:
    return JobRow(
        id=r["id"], spec=json.loads(r["spec"]), state=r["state"], submitted_at=r["submitted_at"], seq=r["seq"],
        reason=r["reason"], allocation=JobAllocation.from_json(json.loads(r["allocation"])) if r["allocation"] else None,
        started_at=r["started_at"], finished_at=r["finished_at"], exit_code=r["exit_code"],
        attained_service=r["attained_service"], attempts=r["attempts"], updated_at=r["updated_at"],
        user=r["user"], account=r["account"],
    )


class JobStore:
    """All SQL lives here (and in :mod:`scheduler.service.journal` and :mod:`scheduler.service.tokens`, on
    the same connections):
    one connection per thread (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], synchronous: str = "FULL", clock=time.time) -> None:
        """``synchronous`` applies to what a caller is told is accepted (a job, a cancel); the loop's
        own bookkeeping commits with NORMAL, which survives a process kill and is made durable by
        the next FULL commit or checkpoint."""
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous!r}")
        self.path = str(path)
        self.memory = self.path == ":memory:"
        if not self.memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            _private_file(self.path)
        self.clock = clock
        self.durable_level = synchronous.upper()
        self._lock = threading.RLock()  # only an in-memory database shares one connection between threads
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._closed = False
        db = self.db
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if not self.memory and mode.lower() != "wal":
            raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode})")
        db.executescript(_DDL)
        with self.tx():
            got = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            version = SCHEMA_VERSION if got is None else int(got[0])
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path}: database schema {version}, this service reads up to {SCHEMA_VERSION}")
            while version < SCHEMA_VERSION:
                for table, column, decl in _UPGRADES[version]:
                    # A table the DDL above just made has its columns already.
                    if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                version += 1
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        db.execute("CREATE INDEX IF NOT EXISTS decisions_batch ON decisions(batch)")
        db.execute("CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(user, state)")
        db.execute("CREATE INDEX IF NOT EXISTS jobs_account ON jobs(account, state)")

    @property
    def db(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        if self.memory and self._all:
            return self._all[0]
        con = getattr(self._local, "con", None)
        if con is None:
            if self._closed:
                raise sqlite3.ProgrammingError("the store is closed")
            con = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
            con.row_factory = sqlite3.Row
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("PRAGMA busy_timeout=30000")
            self._local.con = con
            with self._lock:
                self._all.append(con)
        return con

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for con in self._all:
                try:
                    con.close()
                except sqlite3.Error:
                    pass
            self._all.clear()
        self._local = threading.local()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection for a read (under the lock only for an in-memory database)."""
        if self.memory:
            with self._lock:
                yield self.db
        else:
            yield self.db

    @contextmanager
    def tx(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction on this thread's connection.  Nested, it joins the outer one (the live
        loop writes a batch's log and every row it changes in one transaction)."""
        if getattr(self._local, "depth", 0):
            self._local.depth += 1
            try:
                yield self.db
            finally:
                self._local.depth -= 1
            return
        with self._lock if self.memory else _NO_LOCK:
            self._local.depth = 1
            try:
                with self._tx(durable) as db:
                    yield db
            finally:
                self._local.depth = 0

    @contextmanager
    def _tx(self, durable: bool) -> Iterator[sqlite3.Connection]:
        db = self.db
        strict = durable and self.durable_level != "NORMAL"
        if strict:
            db.execute(f"PRAGMA synchronous={self.durable_level}")
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            if strict:
                db.execute("PRAGMA synchronous=NORMAL")

    # --- jobs -------------------------------------------------------------------------------

    def add_job(self, job_id: str | None, spec: dict[str, Any], owner: Owner = Owner(),
                limits: WaitingLimits = WaitingLimits()) -> tuple[JobRow, bool]:
        """Insert a queued job and its ``submitted`` event in one transaction.

        Returns (job, created).  Resubmitting an existing id with an equal spec and owner
        returns the stored job (created=False); with a different spec, or by another owner, it
        raises :class:`ConflictError`; over the owner's ``limits``, :class:`QuotaError`.
        """
        res = self.add_jobs([(job_id, spec, owner)], limits)[0]
        if isinstance(res, Exception):
            raise res
        return res

    def add_jobs(self, items: list[tuple[str | None, dict[str, Any], Owner]],
                 limits: WaitingLimits = WaitingLimits()) -> list[tuple[JobRow, bool] | ConflictError | QuotaError]:
        """:meth:`add_job` for several submissions in ONE durable transaction (group commit:
        one fsync for all of them).  A clashing id yields a ConflictError in its slot only, a
        submission over its owner's limit a QuotaError; the limits count the jobs this
        transaction adds, so a burst cannot slip past them."""
        now = self.clock()
        out: list[tuple[JobRow, bool] | ConflictError | QuotaError] = []
        waiting: dict[tuple[str, str], int] = {}  # ("user"|"account", name) -> jobs waiting

        def count(col: str, name: str, db: sqlite3.Connection) -> int:
            if (col, name) not in waiting:
                waiting[(col, name)] = db.execute(
                    f"SELECT COUNT(*) FROM jobs WHERE {col}=? AND state IN ('queued','preempted')", (name,)).fetchone()[0]
            return waiting[(col, name)]

        with self.tx(durable=True) as db:
            for job_id, spec, owner in items:
                jid = job_id or f"job-{uuid.uuid4().hex[:12]}"
                body = json.dumps({**spec, "id": jid}, sort_keys=True)
                old = db.execute("SELECT * FROM jobs WHERE id=?", (jid,)).fetchone()
                if old is not None:
                    if (old["user"], old["account"]) != (owner.user, owner.account):
                        out.append(ConflictError(f"job id {jid} is taken; choose another"))
                    elif json.loads(old["spec"]) != json.loads(body):
                        out.append(ConflictError(f"job {jid} exists with a different spec"))
                    else:
                        out.append((_row_to_job(old), False))
                    continue
                over = self._over_limit(owner, limits, lambda col, name: count(col, name, db))
                if over:
                    out.append(QuotaError(over))
                    continue
                cur = db.execute(
                    "INSERT INTO jobs (id, spec, state, submitted_at, updated_at, user, account) VALUES (?,?,?,?,?,?,?)",
                    (jid, body, "queued", now, now, owner.user, owner.account))
                waiting[("user", owner.user)] = count("user", owner.user, db) + 1
                if owner.account:
                    waiting[("account", owner.account)] = count("account", owner.account, db) + 1
                self._event(db, "submitted", job=jid, data={"gpus": spec.get("gpus", 0), "cpus": spec.get("cpus"),
                                                            "user": owner.user, "account": owner.account})
                out.append((JobRow(id=jid, spec=json.loads(body), state="queued", submitted_at=now,
                                   seq=cur.lastrowid, updated_at=now, user=owner.user, account=owner.account), True))
        return out

    @staticmethod
    def _over_limit(owner: Owner, limits: WaitingLimits, count: Callable[[str, str], int]) -> str:
        """Why a new job of ``owner`` would be over ``limits`` ("" when it is not)."""
        if limits.per_user > 0:
            n = count("user", owner.user)
            if n >= limits.per_user:
                return (f"user {owner.user or '(none)'} has {n} jobs waiting; the limit is {limits.per_user} per "
                        f"user (sched.max_waiting_per_user): wait until some start, or cancel some")
        if limits.per_account > 0 and owner.account:
            n = count("account", owner.account)
            if n >= limits.per_account:
                return (f"account {owner.account} has {n} jobs waiting; the limit is {limits.per_account} per "
                        f"account (sched.max_waiting_per_account): wait until some start, or cancel some")
        return ""

    def get_job(self, job_id: str) -> JobRow | None:
        with self.read() as db:
            r = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _row_to_job(r) if r else None

    def list_jobs(self, states: Iterable[str] | None = None, limit: int = 1000, offset: int = 0,
                  user: str | None = None) -> tuple[list[JobRow], int]:
        """Jobs in submission order (``user``: only that user's), and how many match in all."""
        where, args = [], []
        states = list(states or [])
        if states:
            where.append("state IN (%s)" % ",".join("?" * len(states)))
            args += states
        if user is not None:
            where.append("user=?")
            args.append(user)
        q = "FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        with self.read() as db:
            total = db.execute(f"SELECT COUNT(*) {q}", args).fetchone()[0]
            rows = db.execute(f"SELECT * {q} ORDER BY seq LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()
        return [_row_to_job(r) for r in rows], total

    def active_states(self) -> dict[str, str]:
        """id -> state of every job not over (queued, running, preempted): cheap, no row decoded."""
        with self.read() as db:
            rows = db.execute("SELECT id, state FROM jobs WHERE state IN ('queued','running','preempted')").fetchall()
        return {r[0]: r[1] for r in rows}

    def count_by_state(self) -> dict[str, int]:
        with self.read() as db:
            rows = db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {r[0]: r[1] for r in rows}

    def update_job(self, job_id: str, event: str | None = None, event_data: dict[str, Any] | None = None,
                   node: str | None = None, durable: bool = False, only_active: bool = False,
                   **fields: Any) -> bool:
        """Change a job's columns and log one event about it, atomically.  ``only_active``: leave
        a job that is over (done, failed, cancelled) as it is.  Returns whether a row changed."""
        allowed = {"state", "reason", "allocation", "started_at", "finished_at", "exit_code",
                   "attained_service", "attempts"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown job fields {sorted(bad)}")
        if "allocation" in fields and fields["allocation"] is not None:
            a = fields["allocation"]
            fields["allocation"] = json.dumps(a.to_json() if isinstance(a, JobAllocation) else a, sort_keys=True)
        fields["updated_at"] = self.clock()
        sets = ", ".join(f"{k}=?" for k in fields)
        where = "id=?" + (" AND state NOT IN ('done','failed','cancelled')" if only_active else "")
        with self.tx(durable) as db:
            changed = db.execute(f"UPDATE jobs SET {sets} WHERE {where}", [*fields.values(), job_id]).rowcount == 1
            if event and changed:
                self._event(db, event, job=job_id, node=node, data=event_data or {})
        return changed

    def set_allocations(self, changes: list[tuple]) -> None:
        """New cores, memory and lent memory of running jobs on their first node ((job, node, cpus,
        memory[, remote memory])), without reading the rows (the core re-splits a node's share often)."""
        if not changes:
            return
        with self.tx() as db:
            db.executemany(
                "UPDATE jobs SET allocation = json_set(allocation, '$.cpus', ?, '$.memory_bytes', ?, "
                "'$.remote_memory_bytes', ?) WHERE id=? AND state='running' AND json_extract(allocation, '$.node') = ?",
                [(float(c[2]), int(c[3]), int(c[4]) if len(c) > 4 else 0, c[0], c[1]) for c in changes])

    def set_reasons(self, changes: list[tuple[str, str, dict[str, Any] | None]]) -> None:
        """Why waiting jobs wait ((job, reason, event data or None)), in one transaction: each
        still-waiting job's ``reason``, and a ``waiting`` event where data is given."""
        if not changes:
            return
        with self.tx() as db:
            for job, reason, data in changes:
                changed = db.execute("UPDATE jobs SET reason=? WHERE id=? AND state IN ('queued','preempted')",
                                     (reason, job)).rowcount == 1
                if changed and data is not None:
                    self._event(db, "waiting", job=job, data=data)

    def set_service(self, amounts: dict[str, float]) -> None:
        """Record attained service (GPU- or CPU-seconds) of running jobs, in one transaction."""
        if not amounts:
            return
        with self.tx() as db:
            db.executemany("UPDATE jobs SET attained_service = ? WHERE id=?", [(v, k) for k, v in amounts.items()])

    # --- events -----------------------------------------------------------------------------

    def _event(self, db: sqlite3.Connection, kind: str, job: str | None = None, node: str | None = None,
               data: dict[str, Any] | None = None, event_id: str | None = None) -> str:
        eid = event_id or stimulus_id("ev")
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
        with self.read() as db:
            rows = db.execute(q, args).fetchall()
        return [{"seq": r["seq"], "id": r["id"], "ts": r["ts"], "kind": r["kind"], "job": r["job"],
                 "node": r["node"], "data": json.loads(r["data"])} for r in rows]

    # --- decisions ----------------------------------------------------------------------------

    @staticmethod
    def _decision_row(r: sqlite3.Row) -> DecisionRow:
        return DecisionRow(id=r["id"], kind=r["kind"], job=r["job"], node=r["node"], data=json.loads(r["data"]),
                           state=r["state"], ts=r["ts"], reply=json.loads(r["reply"]) if r["reply"] else None,
                           batch=r["batch"])

    def record_decision(self, d: DecisionRow) -> bool:
        """Persist a decision before it is carried out; False if this id was already recorded."""
        with self.tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO decisions (id, ts, kind, job, node, data, state, batch) VALUES (?,?,?,?,?,?,?,?)",
                (d.id, self.clock(), d.kind, d.job, d.node, json.dumps(d.data, sort_keys=True), d.state, d.batch))
            return cur.rowcount == 1

    def decision(self, decision_id: str) -> DecisionRow | None:
        with self.read() as db:
            r = db.execute("SELECT * FROM decisions WHERE id=?", (decision_id,)).fetchone()
        return None if r is None else self._decision_row(r)

    def set_decision_state(self, decision_id: str, state: str, reply: dict[str, Any] | None = None) -> None:
        with self.tx() as db:
            db.execute("UPDATE decisions SET state=?, reply=? WHERE id=?",
                       (state, json.dumps(reply) if reply is not None else None, decision_id))

    def service_key(self, name: str) -> bytes:
        """A random 256-bit key of the service's, made at first use and kept in the database
        (``meta``), e.g. the one aggregation secrets are derived from."""
        key = f"key:{name}"
        with self.tx(durable=True) as db:
            r = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
            if r is None:
                value = secrets.token_hex(32)
                db.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
            else:
                value = r[0]
        return bytes.fromhex(value)

    def pending_decisions(self) -> list[DecisionRow]:
        """Decisions logged but never carried out to the end, oldest first (for the resend after a restart)."""
        with self.read() as db:
            rows = db.execute("SELECT * FROM decisions WHERE state IN ('pending','sent') ORDER BY rowid").fetchall()
        return [self._decision_row(r) for r in rows]


def _private_file(path: str) -> None:
    """Create the database file readable by its owner only (it holds token digests and the
    aggregation key), or make an existing one so.  SQLite gives its -wal and -shm files the
    database's mode."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # SQLite reports an unusable path with its own error
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


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
