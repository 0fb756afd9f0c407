"""MQTT topic names and JSON payloads: pure parsing and validation, no I/O.

Topics (DESIGN.md): ``dlshare/v1/<kind>/<id>/<leaf>`` with kind in node, agg,
sched.  Every payload is a JSON object carrying ``"schema": SCHEMA``.  Parsers
raise :class:`PayloadError` with a message fit to send back to the sender.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1
PREFIX = "dlshare/v1"
MAX_PAYLOAD = 1 << 20  # a control message larger than 1 MiB is refused unparsed

# \Z, not $: "$" also matches before a final newline, and "job\n" is no id.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_OP_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}\Z")
_ID_FIELD = re.compile(r'"id"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.){1,128}")')


class PayloadError(ValueError):
    """A payload that cannot be used; the message says why."""


def valid_id(ident: str) -> bool:
    """Node, server and job ids: 1-128 of [A-Za-z0-9_.-], no MQTT wildcards or slashes."""
    return isinstance(ident, str) and bool(_ID_RE.match(ident))


def check_id(ident: str, what: str = "id") -> str:
    if not valid_id(ident):
        raise PayloadError(f"invalid {what} {ident!r}: use 1-128 characters of A-Z a-z 0-9 _ . -")
    return ident


def topic(kind: str, ident: str, leaf: str) -> str:
    return f"{PREFIX}/{kind}/{ident}/{leaf}"


def node_topic(node: str, leaf: str) -> str:
    return topic("node", node, leaf)


# Memory consumers send their ops (map, unmap, renew) on a node's ``mem`` topic, which carries
# nothing else: the broker can then let jobs borrow memory without letting them send ``run``,
# ``allocate`` or ``stop`` (those come on ``cmd``, from the scheduler and operators only).
MEMORY_LEAF = "mem"
MEMORY_OPS = frozenset({"ping", "map", "unmap", "renew", "donor_status"})


def parse_topic(t: str) -> tuple[str, str, str]:
    """``dlshare/v1/node/n1/telemetry`` -> (``node``, ``n1``, ``telemetry``)."""
    parts = t.split("/")
    if len(parts) != 5 or f"{parts[0]}/{parts[1]}" != PREFIX:
        raise PayloadError(f"not a dlshare v1 topic: {t!r}")
    return parts[2], parts[3], parts[4]


def encode(obj: dict[str, Any]) -> bytes:
    body = {"schema": SCHEMA, **obj}
    return json.dumps(body, separators=(",", ":"), allow_nan=False, default=_default).encode()


def _default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"cannot encode {type(o).__name__}")


def decode(payload: bytes | bytearray | str) -> dict[str, Any]:
    """Parse a JSON object payload and check its schema version."""
    if isinstance(payload, (bytes, bytearray)):
        if len(payload) > MAX_PAYLOAD:
            raise PayloadError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        try:
            text = bytes(payload).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadError(f"payload is not UTF-8: {exc.reason} at byte {exc.start}") from None
    elif isinstance(payload, str):
        text = payload
    else:
        raise PayloadError(f"payload must be bytes or str, not {type(payload).__name__}")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise PayloadError(f"payload is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise PayloadError("payload is nested too deeply") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise PayloadError(f"payload is not usable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PayloadError(f"payload must be a JSON object, not {type(obj).__name__}")
    schema = obj.get("schema")
    if schema != SCHEMA:
        raise PayloadError(f"unsupported schema {schema!r}; this node speaks schema {SCHEMA}")
    return obj


def _reject_constant(name: str) -> Any:
    raise PayloadError(f"payload contains {name}, which is not JSON")


@dataclass(frozen=True)
class Command:
    """A command sent to a daemon on ``.../cmd``; the reply goes to ``.../reply``."""

    id: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)


def parse_command(payload: bytes | str) -> Command:
    """Validate a command envelope: ``{"schema":1,"id":...,"op":...,"args":{...}}``.

    The id is parsed first where possible, so that even a bad command can be
    answered with its own id (see :func:`command_id_of`).
    """
    obj = decode(payload)
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid or len(cid) > 128:
        raise PayloadError("command needs an 'id': a non-empty string of at most 128 characters")
    op = obj.get("op")
    if not isinstance(op, str) or not _OP_RE.match(op):
        raise PayloadError("command needs an 'op': 1-64 characters of a-z 0-9 _ - starting with a letter")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise PayloadError(f"command 'args' must be an object, not {type(args).__name__}")
    return Command(id=cid, op=op, args=args)


def command_id_of(payload: bytes | str) -> str | None:
    """Best-effort id of a payload that failed to parse, for the error reply.  A payload that is
    not JSON as a whole (too deep, a giant number, cut short) may still name its id near the
    start: then the first ``"id": "..."`` is taken."""
    try:
        obj = json.loads(payload)
    except Exception:  # noqa: BLE001 - any garbage: look for an id the sender can match
        text = payload[:65536]
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "replace")
        m = _ID_FIELD.search(text) if isinstance(text, str) else None
        try:
            obj = {"id": json.loads(m.group(1))} if m else None
        except ValueError:
            obj = None
    cid = obj.get("id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and 0 < len(cid) <= 128 else None


def reply(cmd_id: str | None, ok: bool, result: Any = None, error: str | None = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"id": cmd_id, "ok": ok, **extra}
    if ok:
        body["result"] = result if result is not None else {}
    else:
        body["error"] = error or "error"
    return encode(body)


def command(op: str, cmd_id: str, **args: Any) -> bytes:
    return encode({"id": cmd_id, "op": op, "args": args})


# --- argument helpers for command handlers -------------------------------------------------


def arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True, default: Any = None) -> Any:
    """Fetch and type-check one command argument; bools are not ints here."""
    if name not in args or args[name] is None:
        if required:
            raise PayloadError(f"missing argument {name!r}")
        return default
    v = args[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:
        raise PayloadError(f"argument {name!r} must be {_kname(kinds)}, not bool")
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        try:
            v = float(v)
        except OverflowError:
            raise PayloadError(f"argument {name!r} is out of range") from None
    if not isinstance(v, kinds):
        raise PayloadError(f"argument {name!r} must be {_kname(kinds)}, not {type(v).__name__}")
    return v


def bounded(args: dict[str, Any], name: str, lo: float, hi: float, kind: type = float, required: bool = True,
            default: Any = None) -> Any:
    """A number argument (``kind`` float or int) within [lo, hi]: every number a command takes
    has finite bounds, so that 1e308 seconds or 10**30 bytes is refused, not obeyed."""
    if args.get(name) is None:
        return arg(args, name, kind, required, default)  # missing: an error, or the default as given
    v = arg(args, name, kind)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise PayloadError(f"argument {name!r} must be between {lo:g} and {hi:g}, got {v!r:.40}")
    return v


def _kname(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


# --- telemetry -------------------------------------------------------------------------------

TELEMETRY_REQUIRED = {"node": str, "ts": (int, float), "cpu": dict, "memory": dict, "gpus": dict, "rdma": dict}


def parse_telemetry(payload: bytes | str) -> dict[str, Any]:
    """Validate a node telemetry payload (the parts consumers rely on)."""
    obj = decode(payload)
    for key, kind in TELEMETRY_REQUIRED.items():
        if key not in obj:
            raise PayloadError(f"telemetry lacks {key!r}")
        if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            raise PayloadError(f"telemetry {key!r} has the wrong type {type(obj[key]).__name__}")
    check_id(obj["node"], "node id")
    mem = obj["memory"]
    for key in ("total_bytes", "available_bytes"):
        v = mem.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PayloadError(f"telemetry memory.{key} must be a non-negative integer")
    if not isinstance(obj["gpus"].get("devices", []), list):
        raise PayloadError("telemetry gpus.devices must be a list")
    return obj
