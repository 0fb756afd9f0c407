"""The sample cache's parsers: the sample codec and the sealed manifest.  Round trips are exact; any
other input gets the parser's own error, never another exception."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rdma.cache_manifest import ManifestError, check_manifest, open_sealed, seal
from rdma.sample_codec import SampleFormatError, decode, encode

torch = pytest.importorskip("torch")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1),
                    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=40))
arrays = st.builds(lambda dt, shape, seed: np.random.default_rng(seed).integers(0, 255, shape).astype(dt),
                   st.sampled_from(["u1", "i2", "<i4", "f4", "f8", "bool", "c8"]),
                   st.lists(st.integers(0, 5), max_size=3).map(tuple), st.integers(0, 100))
values = st.recursive(st.one_of(scalars, arrays), lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=12)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(values)
@example(np.zeros((4, 0)))  # found by this test: a zero-size array whose first dimension is not 0
@example(np.array(216, dtype=np.uint8))  # and a 0-d array
def test_samples_round_trip_exactly(v):
    assert same(v, decode(bytearray(encode(v))))


def test_tensors_and_images_round_trip_bit_for_bit():
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    for t in (torch.rand(3, 8, 8, generator=g), torch.rand(4, generator=g).to(torch.bfloat16),
              torch.randint(0, 9, (2, 3), generator=g), torch.rand(0, 4), torch.tensor(True)):
        back = decode(bytearray(encode((t, 7))))
        assert back[1] == 7 and back[0].dtype == t.dtype and torch.equal(back[0], t)
    img = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    back = decode(encode(img))
    assert back.mode == "RGB" and np.array_equal(np.asarray(back), np.asarray(img))
    with pytest.raises(SampleFormatError, match="cannot be cached"):
        encode(object())
    with pytest.raises(SampleFormatError, match="dtype"):
        encode(np.array([object()]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_the_format_error(raw):
    for data in (raw, b"DLS\x01" + raw):
        try:
            decode(data)
        except SampleFormatError:
            pass


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_damaged_samples_decode_or_raise_the_format_error(v, data):
    raw = bytearray(encode(v))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for buf in (raw, raw[:cut]):
        try:
            decode(buf)
        except SampleFormatError:
            pass


def good_doc() -> dict:
    tok = "ab" * 16
    return {"owner": "n1", "slots": 100, "page": 4096, "seg_bytes": 1 << 20, "rsegs": 4, "version": 3,
            "index": [{"first_page": 0, "npages": 2, "copies": [["127.0.0.1:7000", 3, tok, "live"]]}],
            "segments": {"0": {"gen": 1, "copies": [["127.0.0.1:7000", 4, tok, "live"],
                                                    ["127.0.0.1:7001", 0, tok, "rebuilding"]]}}}


def test_a_manifest_opens_only_with_its_secret_and_name():
    msg = seal(good_doc(), "imagenet-224", "secret-0123456789")
    m = check_manifest(open_sealed(msg, "imagenet-224", "secret-0123456789"))
    assert m.slots == 100 and m.segments[0].copies[1].state == "rebuilding" and m.index[0].copies[0].slab == 3
    assert "ab" * 16 not in json.dumps(msg)  # the tokens are not readable without the secret
    with pytest.raises(ManifestError, match="secret does not open"):
        open_sealed(msg, "imagenet-224", "secret-wrong-0000")
    with pytest.raises(ManifestError, match="not 'other'"):
        open_sealed(msg, "other", "secret-0123456789")
    tampered = dict(msg, box=msg["box"][:-4] + ("AAAA" if msg["box"][-4:] != "AAAA" else "BBBB"))
    with pytest.raises(ManifestError):
        open_sealed(tampered, "imagenet-224", "secret-0123456789")
    with pytest.raises(ValueError, match="8-256"):
        seal(good_doc(), "x", "short")


def test_segment_keys_must_be_ascii_digits():
    """'²' passes str.isdigit() but not int(); an Arabic-Indic digit passes both and would alias "3"."""
    for key in ("\u00b2", "\u0663", "-1", "4", "x"):
        doc = good_doc()
        doc["segments"] = {key: doc["segments"]["0"]}
        with pytest.raises(ManifestError, match="segment"):
            check_manifest(doc)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values, st.data())
def test_any_manifest_document_is_checked_or_refused(junk, data):
    for doc in (junk, {**good_doc(), data.draw(st.sampled_from(sorted(good_doc()))): junk}):
        try:
            check_manifest(doc)
        except ManifestError:
            pass
    for msg in (junk, {**seal(good_doc(), "c", "secret-0123456789"), data.draw(st.sampled_from(
            ["v", "cache", "nonce", "box", "mac"])): junk}):
        try:
            open_sealed(msg, "c", "secret-0123456789")
        except ManifestError:
            pass
