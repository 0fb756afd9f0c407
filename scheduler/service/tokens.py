"""Who is calling: API tokens that belong to users, stored as digests (never in plain text).

A token is ``dls_<id>.<secret>``: ``id`` (12 hex digits) names it in listings and revocations,
``secret`` (43 URL-safe characters, 256 random bits) proves it.  The store keeps only the
secret's SHA-256 digest: a digest of 256 random bits cannot be reversed or guessed, so a slow
password hash (scrypt, Argon2), which exists to protect guessable passwords, would only cost
CPU on every request.  A presented secret is compared with :func:`hmac.compare_digest`.

Each token belongs to a ``user`` (the POSIX account its jobs run as on the nodes), optionally an
``account`` (a group that shares quotas, as Slurm's accounts do), may be an ``admin`` (sees and
changes every job, manages tokens) and expires.  Revocation and expiry are checked on every
request against the database, so a revoked token is refused at once, by every thread.

The **bootstrap token** (``sched.token``, or the one generated into ``<db>.token``) is the
single-user deployment's credential: an admin acting as ``sched.token_user`` (default: the
service's own user).  It lives where the operator keeps it (config or the 0600 file), not in
the database.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.service.store import JobStore

TOKEN_PREFIX = "dls_"
_TOKEN = re.compile(r"^dls_([0-9a-f]{12})\.([A-Za-z0-9_-]{43})$")
# A POSIX user name as useradd accepts it (and 32 characters, the utmp limit): the node daemon
# resolves it with getpwnam, so anything else could never run.
USER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$"
ACCOUNT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
_USER = re.compile(USER_PATTERN)
_ACCOUNT = re.compile(ACCOUNT_PATTERN)
MAX_TTL_S = 10 * 365 * 86400.0
BOOTSTRAP_ID = "bootstrap"


class TokenError(ValueError):
    """A token request that cannot be honoured (the message says why)."""


@dataclass(frozen=True)
class Principal:
    """The caller of one request: whose jobs it may see and change."""

    user: str
    account: str = ""
    admin: bool = False
    token_id: str = ""

    def may_see(self, owner: str) -> bool:
        return self.admin or owner == self.user


@dataclass(frozen=True)
class TokenRecord:
    """A stored token as listings show it (its digest stays in the database)."""

    id: str
    user: str
    account: str
    admin: bool
    created_at: float
    expires_at: float
    revoked_at: float | None = None
    note: str = ""
    created_by: str = ""

    def state(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if now >= self.expires_at else "active"

    def to_json(self, now: float) -> dict[str, Any]:
        return {"id": self.id, "user": self.user, "account": self.account, "admin": self.admin,
                "created_at": self.created_at, "expires_at": self.expires_at, "revoked_at": self.revoked_at,
                "note": self.note, "created_by": self.created_by, "state": self.state(now)}


def check_user(name: str, what: str = "user") -> str:
    if not isinstance(name, str) or not _USER.fullmatch(name):
        raise TokenError(f"{what} {name!r} is not a user name: 1-32 characters of A-Z a-z 0-9 _ . -, "
                         "not starting with a digit, '.' or '-'")
    return name


def check_account(name: str) -> str:
    if not isinstance(name, str) or (name and not _ACCOUNT.fullmatch(name)):
        raise TokenError(f"account {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . - (or empty)")
    return name


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(text: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed user token, else None."""
    m = _TOKEN.fullmatch(text)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class AuthResult:
    principal: Principal | None
    why: str = ""  # when refused: a reason fit for the caller (who holds the token)


class TokenBook:
    """Tokens in the service's database (table ``tokens``) plus the bootstrap token.

    ``clock``: wall-clock seconds (expiry is a date)."""

    def __init__(self, store: JobStore, bootstrap: str, bootstrap_user: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.bootstrap = bootstrap
        self.bootstrap_principal = Principal(check_user(bootstrap_user, "sched.token_user"), "", True, BOOTSTRAP_ID)
        self.clock = clock

    def authenticate(self, presented: str) -> AuthResult:
        """The principal of a presented bearer token, or why it is refused."""
        if self.bootstrap and hmac.compare_digest(presented.encode(), self.bootstrap.encode()):
            return AuthResult(self.bootstrap_principal)
        parsed = parse_token(presented)
        if parsed is None:
            return AuthResult(None, "wrong bearer token")
        tid, secret = parsed
        with self.store.read() as db:
            r = db.execute("SELECT * FROM tokens WHERE id=?", (tid,)).fetchone()
        # The same work whether or not the id exists: the digest comparison is the only check.
        have = r["digest"] if r is not None else "0" * 64
        if not hmac.compare_digest(have.encode(), digest(secret).encode()) or r is None:
            return AuthResult(None, "wrong bearer token")
        rec = _record(r)
        state = rec.state(self.clock())
        if state != "active":
            return AuthResult(None, f"token {tid} is {state}")
        return AuthResult(Principal(rec.user, rec.account, rec.admin, rec.id))

    def create(self, user: str, account: str = "", admin: bool = False, ttl_s: float = 90 * 86400.0,
               note: str = "", created_by: str = "") -> tuple[TokenRecord, str]:
        """A new token for ``user``; returns its record and the token itself (shown only once)."""
        check_user(user)
        check_account(account)
        if not 60.0 <= ttl_s <= MAX_TTL_S:
            raise TokenError(f"a token lives from 60 s to 10 years; got {ttl_s:g} s")
        if len(note) > 200 or any(ord(c) < 32 or ord(c) == 127 for c in note):
            raise TokenError("note must be at most 200 characters, without control characters")
        now = self.clock()
        secret = secrets.token_urlsafe(32)
        with self.store.tx(durable=True) as db:
            for _ in range(8):
                tid = secrets.token_hex(6)
                if db.execute("SELECT 1 FROM tokens WHERE id=?", (tid,)).fetchone() is None:
                    break
            else:  # pragma: no cover - 2^48 ids
                raise TokenError("could not draw an unused token id")
            rec = TokenRecord(tid, user, account, bool(admin), now, now + ttl_s, None, note, created_by)
            db.execute("INSERT INTO tokens (id, digest, user, account, admin, created_at, expires_at, revoked_at, "
                       "note, created_by) VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (tid, digest(secret), user, account, int(rec.admin), now, rec.expires_at, None, note,
                        created_by))
        return rec, f"{TOKEN_PREFIX}{tid}.{secret}"

    def list(self, user: str | None = None) -> list[TokenRecord]:
        q, args = "SELECT * FROM tokens", []
        if user is not None:
            q += " WHERE user=?"
            args.append(user)
        with self.store.read() as db:
            rows = db.execute(q + " ORDER BY created_at, id", args).fetchall()
        return [_record(r) for r in rows]

    def get(self, token_id: str) -> TokenRecord | None:
        with self.store.read() as db:
            r = db.execute("SELECT * FROM tokens WHERE id=?", (token_id,)).fetchone()
        return _record(r) if r is not None else None

    def revoke(self, token_id: str) -> TokenRecord | None:
        """Revoke a token (from the next request on); None when there is no such token."""
        with self.store.tx(durable=True) as db:
            db.execute("UPDATE tokens SET revoked_at=? WHERE id=? AND revoked_at IS NULL", (self.clock(), token_id))
        return self.get(token_id)


def _record(r: Any) -> TokenRecord:
    return TokenRecord(id=r["id"], user=r["user"], account=r["account"], admin=bool(r["admin"]),
                       created_at=r["created_at"], expires_at=r["expires_at"], revoked_at=r["revoked_at"],
                       note=r["note"] or "", created_by=r["created_by"] or "")
