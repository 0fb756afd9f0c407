"""Broker users and topic rights, in mosquitto's own file formats, for the embedded broker.

``dlshare broker`` (amqtt) enforces the same files a mosquitto cluster uses
(``deploy/mosquitto/dlshare.acl`` and a ``mosquitto_passwd`` password file), so the
single-machine stack and a cluster draw the security boundary in the same place.

- :class:`Acl`: an ACL file (``user NAME``, ``topic [read|write|readwrite|deny] TOPIC``, ``pattern
  ... TOPIC`` with ``%u`` and ``%c``), as mosquitto reads it: topic lines before the first
  ``user`` line are anonymous clients'; patterns are everyone's (but never for a user or client
  id containing ``+``, ``#`` or ``/``, which would turn into wildcards); a ``deny`` line wins;
  nothing is allowed that no line grants.
- A subscription is allowed when every topic it can match is readable (a read grant covers the
  whole filter); a delivered message is checked again against the reader's rights.
- Password files hold ``user:$7$ITERATIONS$SALT$HASH`` lines (PBKDF2-HMAC-SHA512, base64), the
  format ``mosquitto_passwd`` writes; :func:`password_line` writes them too.

Pure: no I/O but what the caller reads; every parser raises :class:`AclError` naming the line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass, field

MAX_FILE_BYTES = 1 << 20
_ACCESS = {"read": frozenset({"read"}), "write": frozenset({"write"}), "readwrite": frozenset({"read", "write"}),
           "deny": frozenset()}
ITERATIONS = 101  # mosquitto_passwd's PBKDF2 count (mosquitto 2.0); our passwords are 256 random bits


class AclError(ValueError):
    """An ACL or password file that cannot be used (the message names the line)."""


@dataclass(frozen=True)
class Rule:
    topic: str
    access: frozenset[str]  # empty: deny
    pattern: bool = False


@dataclass
class Acl:
    """The rules of one ACL file."""

    anonymous: list[Rule] = field(default_factory=list)
    users: dict[str, list[Rule]] = field(default_factory=dict)
    patterns: list[Rule] = field(default_factory=list)

    def rules_for(self, user: str | None, client_id: str = "") -> list[Rule]:
        """Every rule that applies to ``user`` (None: anonymous), with patterns filled in."""
        out = list(self.anonymous if user is None else self.users.get(user, []))
        for r in self.patterns:
            if ("%u" in r.topic and (user is None or _unsafe(user))) or ("%c" in r.topic and _unsafe(client_id)):
                continue
            out.append(Rule(r.topic.replace("%u", user or "").replace("%c", client_id), r.access, True))
        return out

    def may(self, user: str | None, access: str, topic: str, client_id: str = "") -> bool:
        """Whether ``user`` may ``access`` ("read" or "write") the concrete ``topic``."""
        if not valid_topic(topic):
            return False
        rules = [r for r in self.rules_for(user, client_id) if topic_matches(r.topic, topic)]
        if any(not r.access for r in rules):
            return False
        return any(access in r.access for r in rules)

    def may_subscribe(self, user: str | None, topic_filter: str, client_id: str = "") -> bool:
        """Whether every topic ``topic_filter`` matches is readable by ``user`` (stricter than
        mosquitto, which also checks each delivery: a filter wider than the grants is refused)."""
        if not valid_filter(topic_filter):
            return False
        rules = self.rules_for(user, client_id)
        if any(not r.access and filters_overlap(r.topic, topic_filter) for r in rules):
            return False
        return any("read" in r.access and filter_covers(r.topic, topic_filter) for r in rules)


def _unsafe(name: str) -> bool:
    return any(c in name for c in "+#/")


def valid_topic(topic: str) -> bool:
    return bool(topic) and "+" not in topic and "#" not in topic and "\x00" not in topic


def valid_filter(f: str) -> bool:
    if not f or "\x00" in f:
        return False
    levels = f.split("/")
    for i, lv in enumerate(levels):
        if "#" in lv and (lv != "#" or i != len(levels) - 1):
            return False
        if "+" in lv and lv != "+":
            return False
    return True


def topic_matches(flt: str, topic: str) -> bool:
    """MQTT matching of a concrete ``topic`` by filter ``flt`` (``$`` topics only by explicit filters)."""
    fl, tl = flt.split("/"), topic.split("/")
    if topic.startswith("$") and fl[0] in ("+", "#"):
        return False
    for i, f in enumerate(fl):
        if f == "#":
            return True
        if i >= len(tl) or (f != "+" and f != tl[i]):
            return False
    return len(fl) == len(tl)


def filter_covers(grant: str, flt: str) -> bool:
    """Whether every topic that ``flt`` matches is matched by ``grant``."""
    gl, fl = grant.split("/"), flt.split("/")
    for i, g in enumerate(gl):
        if g == "#":
            return True
        if i >= len(fl):
            return False
        f = fl[i]
        if f == "#":
            return False
        if g == "+":
            continue
        if f == "+" or f != g:
            return False
    return len(gl) == len(fl)


def filters_overlap(a: str, b: str) -> bool:
    """Whether some topic matches both filters."""
    al, bl = a.split("/"), b.split("/")
    for i in range(max(len(al), len(bl))):
        x = al[i] if i < len(al) else None
        y = bl[i] if i < len(bl) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != "+" and y != "+" and x != y:
            return False
    return True


def parse_acl(text: str, where: str = "ACL") -> Acl:
    """An ACL file's rules; :class:`AclError` names the first line it cannot use."""
    acl = Acl()
    current: list[Rule] = acl.anonymous
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word == "user":
            if not rest or any(c.isspace() for c in rest):
                raise AclError(f"{where} line {n}: 'user' needs one user name")
            current = acl.users.setdefault(rest, [])
            continue
        if word not in ("topic", "pattern"):
            raise AclError(f"{where} line {n}: expected user, topic or pattern, got {word!r}")
        access, _, topic = rest.partition(" ")
        if access in _ACCESS:
            topic = topic.strip()
        else:  # "topic TOPIC" means readwrite
            access, topic = "readwrite", rest
        if not topic or not valid_filter(topic):
            raise AclError(f"{where} line {n}: {topic!r} is not an MQTT topic filter")
        rule = Rule(topic, _ACCESS[access], word == "pattern")
        (acl.patterns if word == "pattern" else current).append(rule)
    return acl


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def password_line(user: str, password: str, salt: bytes | None = None) -> str:
    """One password-file line as ``mosquitto_passwd`` writes it (``$7$``: PBKDF2-HMAC-SHA512)."""
    if not user or ":" in user or any(c.isspace() for c in user):
        raise AclError(f"broker user name {user!r} must have no ':' or spaces")
    salt = salt if salt is not None else os.urandom(12)
    dk = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, ITERATIONS)
    return f"{user}:$7${ITERATIONS}${_b64(salt)}${_b64(dk)}"


@dataclass(frozen=True)
class PasswordEntry:
    iterations: int
    salt: bytes
    digest: bytes

    def verify(self, password: str) -> bool:
        dk = hashlib.pbkdf2_hmac("sha512", password.encode(), self.salt, self.iterations)
        return hmac.compare_digest(dk, self.digest)


def parse_passwords(text: str, where: str = "password file") -> dict[str, PasswordEntry]:
    """user -> entry of a ``$7$`` password file (other hash kinds are refused by name)."""
    out: dict[str, PasswordEntry] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, h = line.partition(":")
        if not sep or not user:
            raise AclError(f"{where} line {n}: expected USER:HASH")
        parts = h.split("$")
        if len(parts) != 5 or parts[0] or parts[1] != "7":
            raise AclError(f"{where} line {n}: user {user}: only mosquitto's $7$ (PBKDF2-SHA512) hashes are read")
        try:
            it = int(parts[2])
            salt, dk = base64.b64decode(parts[3], validate=True), base64.b64decode(parts[4], validate=True)
        except (ValueError, binascii.Error):
            raise AclError(f"{where} line {n}: user {user}: unreadable hash") from None
        if not 1 <= it <= 10_000_000 or not salt or len(dk) != 64:
            raise AclError(f"{where} line {n}: user {user}: unreadable hash")
        out[user] = PasswordEntry(it, salt, dk)
    return out


def read_text(path: str, what: str) -> str:
    """A small UTF-8 file, or AclError naming it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise AclError(f"{what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise AclError(f"{what} {path}: larger than 1 MiB")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise AclError(f"{what} {path}: not UTF-8 text") from None
