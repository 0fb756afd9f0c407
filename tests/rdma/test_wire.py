"""The wire parser: the pure-Python mirror and the C parser agree on every input."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma import wire
from rdma.native import ffi, lib


def c_parse(buf: bytes) -> tuple[int, int, int]:
    v = ffi.new("dls_req_view *")
    rc = lib.dls_wire_parse_req(buf, len(buf), v)
    return rc, int(v.frame_len), int(v.resync)


segments = st.lists(
    st.builds(wire.Segment, st.integers(0, 1 << 40), st.integers(1, 4096), st.integers(0, 2**32 - 1)),
    min_size=1, max_size=8,
)


@st.composite
def requests(draw):
    op = draw(st.sampled_from([wire.OP_READ, wire.OP_WRITE, wire.OP_PING]))
    segs = () if op == wire.OP_PING else tuple(draw(segments))
    payload = draw(st.binary(min_size=sum(s.length for s in segs), max_size=sum(s.length for s in segs))) \
        if op == wire.OP_WRITE else b""
    return wire.Request(op, draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)),
                        draw(st.binary(min_size=16, max_size=16)), segs, payload,
                        draw(st.sampled_from([0, wire.F_CRC])))


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(requests())
def test_roundtrip(req):
    frame = wire.encode_request(req)
    res = wire.parse_request(frame + b"trailing")
    assert res.status == wire.OK and res.frame_len == len(frame)
    assert res.request == req
    assert c_parse(frame + b"xx") == (wire.OK, len(frame), 1)


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(requests(), st.data())
def test_every_prefix_needs_more(req, data):
    frame = wire.encode_request(req)
    cut = data.draw(st.integers(0, len(frame) - 1))
    res = wire.parse_request(frame[:cut])
    assert res.status == wire.NEED_MORE
    assert cut < res.frame_len <= len(frame)
    rc, need, _ = c_parse(frame[:cut])
    assert (rc, need) == (wire.NEED_MORE, res.frame_len)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_agree(buf):
    py = wire.parse_request(buf)
    rc, frame_len, resync = c_parse(buf)
    assert rc == py.status
    if rc == wire.OK or (rc != wire.NEED_MORE and resync):
        assert frame_len == py.frame_len <= len(buf)
    assert bool(resync) == py.resync


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_mutated_frames_agree(req, data):
    frame = bytearray(wire.encode_request(req))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, min(len(frame), wire.REQ_HDR.size + 3 * wire.SEG.size) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    buf = bytes(frame)
    py = wire.parse_request(buf)
    rc, frame_len, resync = c_parse(buf)
    assert rc == py.status
    if rc == wire.OK:
        assert frame_len == py.frame_len <= len(buf)


def test_limits_are_errors():
    tok = bytes(16)
    head = wire.REQ_HDR.pack(wire.MAGIC, wire.VERSION, wire.OP_READ, 0, 1, 0, wire.MAX_SEGS + 1, tok)
    assert wire.parse_request(head).status == wire.E_NSEG == c_parse(head)[0]
    big = wire.encode_request(wire.Request(wire.OP_READ, 1, 0, tok, (wire.Segment(0, wire.MAX_SEG_BYTES + 1),)))
    assert wire.parse_request(big).status == wire.E_SEGLEN == c_parse(big)[0]
    many = wire.encode_request(wire.Request(wire.OP_READ, 1, 0, tok, tuple(
        wire.Segment(0, wire.MAX_SEG_BYTES) for _ in range(17))))
    assert wire.parse_request(many).status == wire.E_SIZE == c_parse(many)[0]
    bad_version = bytearray(wire.encode_request(wire.Request(wire.OP_PING, 1, 0, tok)))
    bad_version[4] = 9
    assert c_parse(bytes(bad_version))[0] == wire.E_VERSION
    assert c_parse(b"XXXX")[0] == wire.E_MAGIC
    assert c_parse(struct.pack("<I", wire.MAGIC)[:2])[0] == wire.NEED_MORE


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(1, 2**32 - 1)), min_size=1, max_size=6),
       st.integers(0, 2**63))
def test_bounds_never_overflow(pairs, slab_size):
    segs = [wire.Segment(o, n) for o, n in pairs]
    expect = wire.E_BOUNDS if any(o + n > slab_size for o, n in pairs) else wire.OK
    assert wire.check_bounds(segs, slab_size) == expect


def test_status_names_match_c():
    for code, name in wire.STATUS_NAMES.items():
        assert ffi.string(lib.dls_status_name(code)).decode() == name


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.binary(max_size=64))
def test_response_header_parser(buf):
    status, hdr = wire.parse_response_header(buf)
    r = ffi.new("dls_resp_view *")
    assert lib.dls_wire_parse_resp(buf, len(buf), r) == status
    if status == wire.OK:
        assert (hdr.op, hdr.status, hdr.req_id, hdr.body_len, hdr.nseg) == (r.op, r.status, r.req_id, r.body_len, r.nseg)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=9000), st.integers(0, 2**32 - 1))
def test_three_stream_page_crc_equals_serial_crc(data, init):
    buf = ffi.from_buffer(data)
    assert lib.dls_crc32c_pages(init, buf, len(data)) == lib.dls_crc32c(init, buf, len(data))


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.binary(min_size=1, max_size=64), st.integers(0, 300))
def test_crc_shift_is_appending_zero_bytes(data, nzeros):
    # raw state after data, shifted by n zero bytes == raw state after data + n zeros
    raw = lib.dls_crc32c(0, data, len(data)) ^ 0xFFFFFFFF
    longer = data + bytes(nzeros)
    assert lib.dls_crc32c_shift(raw, nzeros) == lib.dls_crc32c(0, longer, len(longer)) ^ 0xFFFFFFFF


def test_every_python_constant_is_the_c_one_by_name():
    """rdma/wire.py spells out csrc/wire.h's numbers for the pure-Python side; each must be the C value of
    the same name (a renumbered C code that Python kept testing by its old number once hid a dead donor)."""
    names = {"OP_READ": "DLS_OP_READ", "OP_WRITE": "DLS_OP_WRITE", "OP_PING": "DLS_OP_PING", "F_CRC": "DLS_F_CRC",
             "OK": "DLS_OK", "NEED_MORE": "DLS_NEED_MORE", "TOKEN_LEN": "DLS_TOKEN_LEN", "MAX_SEGS": "DLS_MAX_SEGS",
             "MAX_SEG_BYTES": "DLS_MAX_SEG_BYTES", "MAX_PAYLOAD": "DLS_MAX_PAYLOAD"}
    names |= {k: "DLS_" + k for k in dir(wire) if k.startswith("E_")}
    for py, c in names.items():
        assert getattr(wire, py) == getattr(lib, c), f"wire.{py} = {getattr(wire, py)}, {c} = {getattr(lib, c)}"
    assert (wire.REQ_HDR.size, wire.RESP_HDR.size, wire.SEG.size) == \
        (lib.DLS_REQ_HDR_LEN, lib.DLS_RESP_HDR_LEN, lib.DLS_SEG_LEN)
    c_errors = {k for k in dir(lib) if k.startswith("DLS_E_")}
    assert c_errors == {"DLS_" + k for k in dir(wire) if k.startswith("E_")}, "a C status code has no Python name"
