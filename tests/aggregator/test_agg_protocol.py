"""The wire protocol parser: round trips, clear errors, and fuzzing (it may only raise ProtocolError)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.protocol import (HEADER, HEADER_SIZE, MAGIC, MAX_CHUNK_BYTES, DType, Header, MsgType, Op,
                                 ProtocolError, data_header, hello, parse_body, parse_header, parse_hello)


def _push(**kw) -> Header:
    base = dict(mtype=MsgType.PUSH, dtype=DType.F32, op=Op.MEAN, job=3, rank=1, world=2, rnd=7, key=2, chunk=1,
                nchunks=3, nbytes=4096, numel=3000)
    base.update(kw)
    return data_header(base["mtype"], base["dtype"], base["op"], base["job"], base["rank"], base["world"],
                       base["rnd"], base["key"], base["chunk"], base["nchunks"], base["nbytes"], base["numel"])


def test_header_is_48_bytes_and_round_trips():
    assert HEADER_SIZE == 48
    h = _push()
    assert parse_header(h.pack()) == h
    assert h.unit == (7, 2, 1)


@pytest.mark.parametrize("kw,needle", [
    (dict(dtype=9), "dtype"),
    (dict(op=5), "op code"),
    (dict(rank=2, world=2), "rank 2 / world 2"),
    (dict(world=0, rank=0), "world 0"),
    (dict(nbytes=0), "chunk of 0 bytes"),
    (dict(nbytes=MAX_CHUNK_BYTES + 4), "chunk of"),
    (dict(nbytes=4094), "whole number of F32"),
    (dict(chunk=3), "chunk 3 of 3"),
    (dict(numel=10), "cannot hold"),
])
def test_bad_data_headers_are_named(kw, needle):
    with pytest.raises(ProtocolError, match=needle):
        parse_header(_push(**kw).pack())


def test_bad_magic_version_type_and_length():
    good = bytearray(_push().pack())
    with pytest.raises(ProtocolError, match="magic"):
        parse_header(b"XXXX" + bytes(good[4:]))
    bad = bytearray(good)
    bad[4] = 2
    with pytest.raises(ProtocolError, match="version 2"):
        parse_header(bytes(bad))
    bad = bytearray(good)
    bad[5] = 99
    with pytest.raises(ProtocolError, match="message type 99"):
        parse_header(bytes(bad))
    with pytest.raises(ProtocolError, match="48 bytes"):
        parse_header(bytes(good[:40]))
    ctl = Header(MsgType.HELLO, nbytes=1 << 20).pack()
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_header(ctl)


def test_hello_validation():
    msg = hello("job-1", 1, 4)
    h = parse_header(msg[:HEADER_SIZE])
    assert h.mtype == MsgType.HELLO and h.nbytes == len(msg) - HEADER_SIZE
    assert parse_hello(msg[HEADER_SIZE:]).job == "job-1"
    for body, needle in [(b'{"job":"a/b","rank":0,"world":2}', "invalid job id"),
                         (b'{"job":"a","rank":2,"world":2}', "rank 2 out of range"),
                         (b'{"job":"a","rank":0,"world":0}', "world size 0"),
                         (b'{"job":"a","rank":true,"world":2}', "rank must be an integer"),
                         (b"[1]", "JSON object"), (b"\xff\xfe", "not a JSON object")]:
        with pytest.raises(ProtocolError, match=needle):
            parse_hello(body)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_fuzz_random_bytes_only_raise_protocol_error(data):
    try:
        h = parse_header(data)
    except ProtocolError:
        return
    assert len(data) == HEADER_SIZE and h.pack() == data


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1),
       st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_fuzz_structured_headers(mtype, dtype, op, job, rank, world, rnd, key, chunk, nchunks, nbytes, numel):
    raw = HEADER.pack(MAGIC, 1, mtype, dtype, op, job, rank, world, rnd, key, chunk, nchunks, nbytes, numel)
    try:
        h = parse_header(raw)
    except ProtocolError:
        return
    if h.mtype in (MsgType.PUSH, MsgType.RESULT):  # whatever passes is safe to allocate and reduce
        it = DType(h.dtype).itemsize
        assert 0 < h.nbytes <= MAX_CHUNK_BYTES and h.nbytes % it == 0
        assert h.chunk < h.nchunks and h.rank < h.world and h.numel * it >= h.nbytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_control_bodies(data):
    try:
        parse_hello(data)
    except ProtocolError:
        pass
    try:
        assert isinstance(parse_body(data), dict)
    except ProtocolError:
        pass


def test_struct_layout_is_little_endian():
    raw = _push(job=0x01020304).pack()
    assert raw[:4] == MAGIC and struct.unpack_from("<I", raw, 8)[0] == 0x01020304


def test_hello_layout_round_trips_and_is_validated():
    from aggregator.protocol import HEADER_SIZE as HS

    msg = hello("j", 0, 2, ((3, 10, 1), (1, 4, 3)))
    assert parse_hello(msg[HS:]).layout == ((1, 4, 3), (3, 10, 1))
    for bad, needle in [('[[1, 4]]', "not \\[key"), ('[[1, 0, 1]]', "0 elements"), ('[[1, 4, 9]]', "dtype code 9"),
                        ('[[1, 4, 1], [1, 5, 1]]', "twice"), ('[]', "list of 1"), ('[[-1, 4, 1]]', "out of range"),
                        ('[[true, 4, 1]]', "not \\[key")]:
        with pytest.raises(ProtocolError, match=needle):
            parse_hello(('{"job":"j","rank":0,"world":2,"layout":%s}' % bad).encode())
