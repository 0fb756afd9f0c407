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
#
# A node's telemetry is parsed once, here, into a typed NodeTelemetry; every reader (the scheduler
# service, the Slurm shell, the remote-memory consumer, dlshare status) uses it.  Required parts that
# are missing or of the wrong type refuse the whole report (PayloadError); an optional figure that
# is absent or malformed reads as None (or 0 for counters), so one bad field never hides the rest.

TELEMETRY_REQUIRED = {"node": str, "ts": (int, float), "cpu": dict, "memory": dict, "gpus": dict, "rdma": dict}


def number(v: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (booleans, NaN, strings...)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:  # an integer beyond a double
            return None
        return f if math.isfinite(f) else None
    return None


def count(v: Any) -> int | None:
    """A non-negative JSON integer; None for anything else."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class GpuReport:
    index: int
    name: str
    util_percent: float | None = None
    memory_util_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


@dataclass(frozen=True)
class DonorReport:
    """A node's ``donor`` section (nodesvc/daemon/donor.py), in telemetry and in the retained state.
    A figure that is absent or malformed is None (the books) or 0 (the byte counts)."""

    enabled: bool = False
    addr: str | None = None  # HOST:PORT of its slab server, when valid
    provider: str = "tcp"
    slab_bytes: int | None = None  # a positive multiple of 4096, when valid
    total_slabs: int | None = None
    free_slabs: int | None = None
    lendable_bytes: int = 0
    lent_bytes: int = 0
    lent_to: dict[str, int] = field(default_factory=dict)

    @property
    def placeable(self) -> bool:
        """Whether a consumer may map slabs here from this report (a bad report never places a slab)."""
        return self.enabled and self.addr is not None and self.slab_bytes is not None and self.free_slabs is not None


@dataclass(frozen=True)
class NodeTelemetry:
    node: str
    ts: float | None  # the daemon's wall clock when it published (None when not a positive time)
    cpu_count: int = 0
    cpu_percent: float | None = None
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    reserved_unused_bytes: int = 0  # promised to local jobs and not used
    promised_bytes: int = 0
    gpus: tuple[GpuReport, ...] = ()
    gpus_simulated: bool = False
    gpu_reason: str | None = None
    donor: DonorReport | None = None
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per job: the daemon's usage record


def _addr(v: Any) -> str | None:
    if not isinstance(v, str) or ":" not in v:
        return None
    host, _, port = v.rpartition(":")
    return v if host and port.isascii() and port.isdigit() and 0 < int(port) < 65536 else None


def parse_donor(section: Any) -> DonorReport | None:
    """A ``donor`` section (None when there is none)."""
    if not isinstance(section, dict):
        return None
    slab_bytes = count(section.get("slab_bytes"))
    provider = section.get("provider", "tcp")
    lent_to = {k: v for k, v in _dict(section.get("lent_to")).items() if isinstance(k, str) and count(v) is not None}
    return DonorReport(
        enabled=section.get("enabled") is True, addr=_addr(section.get("addr")),
        provider=provider if isinstance(provider, str) else "tcp",
        slab_bytes=slab_bytes if slab_bytes and slab_bytes % 4096 == 0 else None,
        total_slabs=count(section.get("total_slabs")), free_slabs=count(section.get("free_slabs")),
        lendable_bytes=count(section.get("lendable_bytes")) or 0, lent_bytes=count(section.get("lent_bytes")) or 0,
        lent_to=lent_to)


def telemetry_from(obj: dict[str, Any]) -> NodeTelemetry:
    """The typed report of a decoded telemetry object (:func:`parse_telemetry` decodes too)."""
    for key, kind in TELEMETRY_REQUIRED.items():
        if key not in obj:
            raise PayloadError(f"telemetry lacks {key!r}")
        if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            raise PayloadError(f"telemetry {key!r} has the wrong type {type(obj[key]).__name__}")
    check_id(obj["node"], "node id")
    cpu, mem, gpus = obj["cpu"], obj["memory"], obj["gpus"]
    total, avail = count(mem.get("total_bytes")), count(mem.get("available_bytes"))
    if total is None or avail is None:
        raise PayloadError("telemetry memory.total_bytes and memory.available_bytes must be non-negative integers")
    devices = gpus.get("devices", [])
    if not isinstance(devices, list):
        raise PayloadError("telemetry gpus.devices must be a list")
    ts = number(obj["ts"])
    reports = []
    for i, g in enumerate(devices):
        if not isinstance(g, dict):
            continue
        idx = count(g.get("index"))
        reports.append(GpuReport(i if idx is None else idx, str(g.get("name", ""))[:100], number(g.get("util_percent")),
                                 number(g.get("memory_util_percent")), count(g.get("memory_used_bytes")) or None,
                                 count(g.get("memory_total_bytes")) or None))
    reason = gpus.get("reason")
    return NodeTelemetry(
        node=obj["node"], ts=ts if ts is not None and ts > 0 else None,
        cpu_count=count(cpu.get("count")) or 0, cpu_percent=number(cpu.get("percent")),
        memory_total_bytes=total, memory_available_bytes=avail,
        reserved_unused_bytes=count(mem.get("reserved_unused_bytes")) or 0,
        promised_bytes=count(mem.get("promised_bytes")) or 0,
        gpus=tuple(reports), gpus_simulated=gpus.get("simulated") is True,
        gpu_reason=reason if isinstance(reason, str) else None,
        donor=parse_donor(obj.get("donor")),
        jobs={k: v for k, v in _dict(obj.get("jobs")).items() if isinstance(k, str) and isinstance(v, dict)})


def parse_telemetry(payload: bytes | str) -> NodeTelemetry:
    """Decode and validate a node telemetry payload into its typed report."""
    return telemetry_from(decode(payload))
