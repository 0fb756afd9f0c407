"""The aggregation wire protocol: pure encoding, parsing and validation, no I/O.

Every message is a fixed 48-byte little-endian header, then ``nbytes`` of
payload.  Data messages (PUSH, RESULT) carry raw tensor bytes; control
messages carry a small JSON object.

=======  ======  =====================================================
offset   type    field
=======  ======  =====================================================
0        4s      magic ``b"DLAG"``
4        u8      version (1)
5        u8      message type (:class:`MsgType`)
6        u8      dtype (:class:`DType`; 0 on control messages)
7        u8      op (:class:`Op`)
8        u32     job handle (assigned by the server in WELCOME)
12       u16     rank
14       u16     world size
16       u64     round
24       u32     key (a tensor or DDP bucket within the round)
28       u32     chunk index within the key
32       u32     number of chunks of the key
36       u32     payload bytes
40       u64     elements of the whole key (detects shape mismatches)
=======  ======  =====================================================

:func:`parse_header` raises :class:`ProtocolError` for anything a peer must
not send; it never raises anything else (the tests fuzz it).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from nodesvc.bus.messages import PayloadError, check_id

MAGIC = b"DLAG"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIHHQIIIIQ")
HEADER_SIZE = HEADER.size
MAX_CHUNK_BYTES = 16 << 20  # DESIGN: "chunks of at most a few MiB"; 16 MiB bounds a receive buffer
MAX_CONTROL_BYTES = 64 << 10
MAX_WORLD = 4096
MAX_NUMEL = 1 << 40


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text says what and is sent back to the peer."""


class MsgType(enum.IntEnum):
    HELLO = 1  # client -> server: {"job", "rank", "world"[, "secret", "layout", "next_round"]}
    WELCOME = 2  # server -> client: {"server", "job_handle"}
    PUSH = 3  # client -> server: a gradient chunk
    RESULT = 4  # server -> client: the reduced chunk
    ERROR = 5  # server -> client: {"code", "message"}; round/key/chunk name what failed
    REDIRECT = 6  # server -> client: this server drains; rounds >= {"from_round"} go elsewhere
    BYE = 7  # client -> server: orderly close, not a lost worker
    JOINED = 8  # server -> client: every rank said HELLO; use this server for rounds >= {"from_round"}
    DRAINED = 9  # client -> server: nothing of this rank's is left below the drain's from_round here


class DType(enum.IntEnum):
    F32 = 1
    F16 = 2
    BF16 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2

    @property
    def label(self) -> str:
        return {1: "float32", 2: "float16", 3: "bfloat16"}[int(self)]


class Op(enum.IntEnum):
    SUM = 0
    MEAN = 1


DATA_TYPES = (MsgType.PUSH, MsgType.RESULT)


@dataclass(frozen=True)
class Header:
    mtype: MsgType
    dtype: int = 0
    op: int = 0
    job: int = 0
    rank: int = 0
    world: int = 0
    round: int = 0
    key: int = 0
    chunk: int = 0
    nchunks: int = 0
    nbytes: int = 0
    numel: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, int(self.mtype), int(self.dtype), int(self.op), self.job, self.rank,
                           self.world, self.round, self.key, self.chunk, self.nchunks, self.nbytes, self.numel)

    def with_(self, **kw: Any) -> "Header":
        return replace(self, **kw)

    @property
    def unit(self) -> tuple[int, int, int]:
        """(round, key, chunk): one reduction, the unit of scheduling."""
        return (self.round, self.key, self.chunk)


def parse_header(data: bytes | bytearray | memoryview) -> Header:
    """Validate one header; data messages are checked for size, dtype, op and chunk bounds."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, mtype, dtype, op, job, rank, world, rnd, key, chunk, nchunks, nbytes, numel = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a dlshare aggregation peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} unsupported; this peer speaks {VERSION}")
    try:
        mt = MsgType(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    h = Header(mt, dtype, op, job, rank, world, rnd, key, chunk, nchunks, nbytes, numel)
    if mt in DATA_TYPES:
        _check_data(h)
    elif nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{mt.name} payload of {nbytes} bytes exceeds {MAX_CONTROL_BYTES}")
    return h


def _check_data(h: Header) -> None:
    try:
        dt = DType(h.dtype)
    except ValueError:
        raise ProtocolError(f"unknown dtype code {h.dtype} (known: 1 fp32, 2 fp16, 3 bf16)") from None
    if h.op not in (Op.SUM, Op.MEAN):
        raise ProtocolError(f"unknown op code {h.op} (known: 0 sum, 1 mean)")
    if not 1 <= h.world <= MAX_WORLD or h.rank >= h.world:
        raise ProtocolError(f"rank {h.rank} / world {h.world} out of range")
    if h.nbytes == 0 or h.nbytes > MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk of {h.nbytes} bytes: must be 1..{MAX_CHUNK_BYTES}")
    if h.nbytes % dt.itemsize:
        raise ProtocolError(f"chunk of {h.nbytes} bytes is not a whole number of {dt.name} elements")
    if h.nchunks == 0 or h.chunk >= h.nchunks:
        raise ProtocolError(f"chunk {h.chunk} of {h.nchunks} out of range")
    if h.numel == 0 or h.numel > MAX_NUMEL or h.numel * dt.itemsize < h.nbytes:
        raise ProtocolError(f"key of {h.numel} elements cannot hold a chunk of {h.nbytes} bytes")


def data_header(mtype: MsgType, dtype: DType, op: Op, job: int, rank: int, world: int, rnd: int, key: int,
                chunk: int, nchunks: int, nbytes: int, numel: int) -> Header:
    return Header(mtype, int(dtype), int(op), job, rank, world, rnd, key, chunk, nchunks, nbytes, numel)


# --- control payloads ------------------------------------------------------------------------


def control(mtype: MsgType, body: dict[str, Any], **fields: Any) -> bytes:
    """Header + JSON body of a control message."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    if len(payload) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control payload of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
    return Header(mtype, nbytes=len(payload), **fields).pack() + payload


def parse_body(payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"control payload is not a JSON object: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control payload must be a JSON object")
    return obj


MAX_LAYOUT_KEYS = 2048  # fits the 64 KiB control payload with room to spare

Layout = tuple[tuple[int, int, int], ...]  # sorted (key, elements, dtype code)


@dataclass(frozen=True)
class Hello:
    job: str
    rank: int
    world: int
    layout: Layout | None = None  # optional: the keys the job will push, checked on every push
    next_round: int | None = None  # the first round this rank has not started (asks for a JOINED)
    secret: str | None = field(default=None, repr=False)  # the job's shared secret (never logged)


MIN_SECRET = 8  # characters: shorter ones are refused as a typo or a placeholder
MAX_SECRET = 256
SECRET_ENV = "DLSHARE_AGG_SECRET"  # where clients read the job's secret when none is passed


def parse_layout(obj: Any) -> Layout:
    """``[[key, elements, dtype code], ...]`` -> a sorted tuple; keys unique."""
    if not isinstance(obj, list) or not 0 < len(obj) <= MAX_LAYOUT_KEYS:
        raise ProtocolError(f"layout must be a list of 1..{MAX_LAYOUT_KEYS} [key, elements, dtype] entries")
    out = []
    for ent in obj:
        if (not isinstance(ent, list) or len(ent) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in ent)):
            raise ProtocolError(f"layout entry {ent!r} is not [key, elements, dtype]")
        key, numel, dt = ent
        if not 0 <= key < 2**32:
            raise ProtocolError(f"layout key {key} out of range")
        if not 0 < numel <= MAX_NUMEL:
            raise ProtocolError(f"layout key {key}: {numel} elements out of range")
        if dt not in (1, 2, 3):
            raise ProtocolError(f"layout key {key}: unknown dtype code {dt}")
        out.append((key, numel, dt))
    out.sort()
    if len({k for k, _, _ in out}) != len(out):
        raise ProtocolError("layout names a key twice")
    return tuple(out)


def parse_hello(payload: bytes | bytearray | memoryview) -> Hello:
    obj = parse_body(payload)
    job = obj.get("job")
    try:
        check_id(job, "job id")
    except PayloadError as exc:
        raise ProtocolError(str(exc)) from None
    rank, world = obj.get("rank"), obj.get("world")
    for name, v in (("rank", rank), ("world", world)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(f"HELLO {name} must be an integer, not {type(v).__name__}")
    if not 1 <= world <= MAX_WORLD:
        raise ProtocolError(f"world size {world} out of range 1..{MAX_WORLD}")
    if not 0 <= rank < world:
        raise ProtocolError(f"rank {rank} out of range for world size {world}")
    layout = obj.get("layout")
    nxt = obj.get("next_round")
    if nxt is not None and (not isinstance(nxt, int) or isinstance(nxt, bool) or not 0 <= nxt < MAX_ROUND):
        raise ProtocolError(f"HELLO next_round must be an integer 0..{MAX_ROUND - 1}, not {nxt!r}")
    secret = obj.get("secret")
    if secret is not None and (not isinstance(secret, str) or not MIN_SECRET <= len(secret) <= MAX_SECRET
                               or not secret.isprintable()):
        raise ProtocolError(f"HELLO secret must be a printable string of {MIN_SECRET}..{MAX_SECRET} characters")
    return Hello(job, rank, world, None if layout is None else parse_layout(layout), nxt, secret)


MAX_ROUND = 1 << 62


def hello(job: str, rank: int, world: int, layout: Layout | None = None, next_round: int | None = None,
          secret: str | None = None) -> bytes:
    body: dict[str, Any] = {"job": job, "rank": rank, "world": world}
    if secret is not None:
        body["secret"] = secret
    if layout is not None:
        body["layout"] = [list(e) for e in layout]
    if next_round is not None:
        body["next_round"] = int(next_round)
    return control(MsgType.HELLO, body, rank=rank, world=world)


def parse_round_body(payload: bytes | bytearray | memoryview, field: str = "from_round") -> int:
    """The round a JOINED, REDIRECT or DRAINED message names."""
    v = parse_body(payload).get(field)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < MAX_ROUND:
        raise ProtocolError(f"{field} must be an integer 0..{MAX_ROUND - 1}, not {v!r}")
    return v


def error(code: str, message: str, rnd: int = 0, key: int = 0, chunk: int = 0, job: int = 0) -> bytes:
    return control(MsgType.ERROR, {"code": code, "message": message}, round=rnd, key=key, chunk=chunk, job=job)
