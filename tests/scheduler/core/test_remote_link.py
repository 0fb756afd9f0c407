"""The remote link's calibration: read back exactly what the cache bench writes, refuse anything else with
the field named; and the cached pipeline's predicted speed."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.remote_memory import RemoteLink, predicted_speed


def test_a_calibration_round_trips_and_names_its_source(tmp_path):
    link = RemoteLink(read_bytes_per_s=1.2e9, read_latency_s=3e-5, donor_bytes_per_s=1.1e9, region_bytes_per_s=8e8)
    doc = link.calibration("2026-11-25T21:00:00Z", "dlshare bench cache", sample_bytes=150592)
    path = tmp_path / "remote_link.json"
    path.write_text(json.dumps(doc))
    back = RemoteLink.from_file(str(path))
    assert (back.read_bytes_per_s, back.read_latency_s, back.donor_bytes_per_s, back.region_bytes_per_s) == \
        (1.2e9, 3e-5, 1.1e9, 8e8)
    assert back.source == "dlshare bench cache, 2026-11-25T21:00:00Z"
    only = RemoteLink.from_calibration({"schema": 1, "link": {"read_bytes_per_s": 5e8, "read_latency_s": 0.0}})
    assert only.donor_bytes_per_s == 5e8  # a donor serves what one reader measured, unless told
    assert "bench" in RemoteLink().source  # the defaults say which measurement they are


@pytest.mark.parametrize("doc, match", [
    ([], "JSON object"), ({"schema": 2, "link": {}}, "schema"), ({"schema": 1}, "'link'"),
    ({"schema": 1, "link": {"read_bytes_per_s": 1e9}}, "read_latency_s"),
    ({"schema": 1, "link": {"read_bytes_per_s": 1e9, "read_latency_s": 0, "speed": 3}}, "unknown"),
    ({"schema": 1, "link": {"read_bytes_per_s": "fast", "read_latency_s": 0}}, "read_bytes_per_s"),
    ({"schema": 1, "link": {"read_bytes_per_s": 0, "read_latency_s": 0}}, "> 0"),
    ({"schema": 1, "link": {"read_bytes_per_s": 1e9, "read_latency_s": -1}}, "latency"),
    ({"schema": 1, "link": {"read_bytes_per_s": 1e9, "read_latency_s": True}}, "read_latency_s"),
])
def test_bad_calibrations_are_refused_with_the_reason(doc, match):
    with pytest.raises(ValueError, match=match):
        RemoteLink.from_calibration(doc)


def test_bad_files_name_the_file(tmp_path):
    for bad in (tmp_path, tmp_path / "absent.json"):
        with pytest.raises(ValueError, match=str(bad.name)):
            RemoteLink.from_file(str(bad))
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match="x.bin"):
        RemoteLink.from_file(str(binary))


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=20), inner, max_size=4)),
                           max_leaves=15)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(["read_bytes_per_s", "read_latency_s", "donor_bytes_per_s", "schema", "link"]))
def test_any_document_gives_a_valid_link_or_a_value_error(junk, key):
    good = {"schema": 1, "link": {"read_bytes_per_s": 1e9, "read_latency_s": 1e-5}}
    for doc in (junk, {**good, key: junk}, {**good, "link": {**good["link"], key: junk}}):
        try:
            link = RemoteLink.from_calibration(doc)
        except ValueError:
            continue
        assert link.read_bytes_per_s > 0 and math.isfinite(link.read_latency_s)


def test_predicted_speed_runs_between_the_two_measured_points():
    assert predicted_speed(100.0, 0.25, 400.0, 1.0) == pytest.approx(400.0)   # every lent byte worth a local one
    assert predicted_speed(100.0, 0.25, 400.0, 0.0) == pytest.approx(100.0)   # worth nothing
    half = predicted_speed(100.0, 0.25, 400.0, 0.5)
    assert 100.0 < half < 400.0 and half == pytest.approx(1 / (1 / 400 + 0.5 * (1 / 100 - 1 / 400)))
    with pytest.raises(ValueError):
        predicted_speed(0.0, 0.25, 400.0, 1.0)
