"""The remote-memory wire format in pure Python: the same framing as csrc/wire.c.

Used by tests (fuzzed against the C parser), by tools that speak to a donor
without the C extension, and as the executable description of the format.
All integers are little-endian; see csrc/wire.h for the layout.
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass, field

MAGIC = 0x4D534C44  # "DLSM"
VERSION = 1
REQ_HDR = struct.Struct("<IBBHQII16s")  # 40 bytes
RESP_HDR = struct.Struct("<IBBBBQII")  # 24 bytes
SEG = struct.Struct("<QII")  # 16 bytes
TOKEN_LEN = 16
MAX_SEGS = 1024
MAX_SEG_BYTES = 1 << 20
MAX_PAYLOAD = 16 << 20

OP_READ, OP_WRITE, OP_PING = 1, 2, 3
F_CRC = 1

# Status codes, as csrc/wire.h.
OK = 0
E_MAGIC, E_VERSION, E_OP, E_FLAGS, E_NSEG, E_SEGLEN, E_SIZE = 1, 2, 3, 4, 5, 6, 7
E_NOSLAB, E_TOKEN, E_BOUNDS, E_CRC, E_INTERNAL = 8, 9, 10, 11, 12
# Local outcomes: negative errnos, as every C function returns them.
NEED_MORE, E_IO, E_TIMEOUT, E_PROTO = -errno.EAGAIN, -errno.EIO, -errno.ETIMEDOUT, -errno.EPROTO
E_ARG, E_CLOSED, E_UNSUPPORTED = -errno.EINVAL, -errno.ESHUTDOWN, -errno.EOPNOTSUPP

STATUS_NAMES = {
    OK: "ok", E_MAGIC: "bad_magic", E_VERSION: "bad_version", E_OP: "bad_op", E_FLAGS: "bad_flags",
    E_NSEG: "bad_segment_count", E_SEGLEN: "bad_segment_length", E_SIZE: "message_too_large",
    E_NOSLAB: "no_such_slab", E_TOKEN: "bad_token", E_BOUNDS: "out_of_bounds", E_CRC: "checksum_mismatch",
    E_INTERNAL: "internal_error", NEED_MORE: "need_more", E_IO: "io_error", E_TIMEOUT: "timeout",
    E_PROTO: "protocol_error", E_ARG: "bad_argument", E_CLOSED: "closed", E_UNSUPPORTED: "unsupported",
}


def status_name(code: int) -> str:
    """A status's short name; another negative errno by its errno name (``enomem``)."""
    if code in STATUS_NAMES:
        return STATUS_NAMES[code]
    return errno.errorcode.get(-code, "unknown").lower() if code < 0 else "unknown"


@dataclass(frozen=True)
class Segment:
    offset: int
    length: int
    crc: int = 0


@dataclass(frozen=True)
class Request:
    op: int
    req_id: int
    slab: int
    token: bytes
    segments: tuple[Segment, ...] = ()
    payload: bytes = b""
    flags: int = 0


@dataclass
class ParseResult:
    """Outcome of :func:`parse_request`: ``status`` OK, NEED_MORE or an error code.

    ``frame_len``: the bytes of the frame (OK), bytes needed so far (NEED_MORE),
    or, on an error with ``resync``, the bytes to skip to the next frame.
    """

    status: int
    frame_len: int = 0
    resync: bool = False
    request: Request | None = None
    op: int = 0
    req_id: int = 0
    segments: list[Segment] = field(default_factory=list)


def encode_request(req: Request) -> bytes:
    if len(req.token) != TOKEN_LEN:
        raise ValueError(f"token must be {TOKEN_LEN} bytes")
    head = REQ_HDR.pack(MAGIC, VERSION, req.op, req.flags, req.req_id, req.slab, len(req.segments), req.token)
    return head + b"".join(SEG.pack(s.offset, s.length, s.crc) for s in req.segments) + req.payload


def parse_request(buf: bytes) -> ParseResult:
    """Parse one request from the start of ``buf`` exactly as the C server does."""
    n = len(buf)
    if n < REQ_HDR.size:
        if n and buf[: min(n, 4)] != struct.pack("<I", MAGIC)[: min(n, 4)]:
            return ParseResult(E_MAGIC)
        return ParseResult(NEED_MORE, REQ_HDR.size)
    magic, version, op, flags, req_id, slab, nseg, token = REQ_HDR.unpack_from(buf)
    if magic != MAGIC:
        return ParseResult(E_MAGIC)
    base = dict(op=op, req_id=req_id)
    if version != VERSION:
        return ParseResult(E_VERSION, **base)
    if nseg > MAX_SEGS:
        return ParseResult(E_NSEG, **base)
    desc_end = REQ_HDR.size + SEG.size * nseg
    if n < desc_end:
        return ParseResult(NEED_MORE, desc_end, **base)
    segs = [Segment(*SEG.unpack_from(buf, REQ_HDR.size + SEG.size * i)) for i in range(nseg)]
    total = 0
    for s in segs:
        if s.length == 0 or s.length > MAX_SEG_BYTES:
            return ParseResult(E_SEGLEN, **base)
        total += s.length
    if total > MAX_PAYLOAD:
        return ParseResult(E_SIZE, **base)
    frame = desc_end + (total if op == OP_WRITE else 0)
    if op not in (OP_READ, OP_WRITE, OP_PING):
        return ParseResult(E_OP, **base)
    if n < frame:
        return ParseResult(NEED_MORE, frame, **base)
    if flags & ~F_CRC:
        return ParseResult(E_FLAGS, frame, True, **base)
    if (op == OP_PING) != (nseg == 0):
        return ParseResult(E_NSEG, frame, True, **base)
    payload = bytes(buf[desc_end:frame]) if op == OP_WRITE else b""
    req = Request(op, req_id, slab, bytes(token), tuple(segs), payload, flags)
    return ParseResult(OK, frame, True, req, segments=segs, **base)


def check_bounds(segments: list[Segment] | tuple[Segment, ...], slab_size: int) -> int:
    for s in segments:
        if s.offset > slab_size or s.length > slab_size - s.offset:
            return E_BOUNDS
    return OK


@dataclass(frozen=True)
class ResponseHeader:
    op: int
    flags: int
    status: int
    req_id: int
    body_len: int
    nseg: int


def encode_response_header(h: ResponseHeader) -> bytes:
    return RESP_HDR.pack(MAGIC, VERSION, h.op, h.flags, h.status, h.req_id, h.body_len, h.nseg)


def parse_response_header(buf: bytes) -> tuple[int, ResponseHeader | None]:
    if len(buf) < RESP_HDR.size:
        return NEED_MORE, None
    magic, version, op, flags, status, req_id, body_len, nseg = RESP_HDR.unpack_from(buf)
    if magic != MAGIC:
        return E_MAGIC, None
    if version != VERSION:
        return E_VERSION, None
    if nseg > MAX_SEGS:
        return E_NSEG, None
    if body_len > MAX_PAYLOAD + 4 * MAX_SEGS:
        return E_SIZE, None
    return OK, ResponseHeader(op, flags, status, req_id, body_len, nseg)
