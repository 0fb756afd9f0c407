"""The MQTT payload codec (nodesvc.bus.messages): every malformed payload is a PayloadError that says why."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from tests.nodesvc.strategies import json_values


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_parse_command_random_bytes_only_payload_error(raw):
    try:
        cmd = messages.parse_command(raw)
    except PayloadError:
        return
    assert isinstance(cmd.id, str) and cmd.id and isinstance(cmd.args, dict)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["schema", "id", "op", "args", "x"]), json_values, max_size=5))
def test_parse_command_random_objects(obj):
    raw = json.dumps(obj).encode()
    try:
        cmd = messages.parse_command(raw)
    except PayloadError as exc:
        assert str(exc)  # every rejection says why
        return
    assert obj["schema"] == 1 and cmd.op == obj["op"]


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({"schema": st.just(1)}, optional={
    "node": st.one_of(st.text(max_size=10), st.integers(), st.none()),
    "ts": json_values, "cpu": json_values, "gpus": json_values, "rdma": json_values,
    "memory": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "total_bytes": json_values, "available_bytes": json_values}))}))
def test_parse_telemetry_random_objects(obj):
    try:
        t = messages.parse_telemetry(json.dumps(obj))
    except PayloadError as exc:
        assert str(exc)
        return
    assert messages.valid_id(t.node) and t.memory_total_bytes >= 0


@settings(max_examples=120, deadline=None)
@given(cpu=json_values, gpus=st.one_of(json_values, st.fixed_dictionaries({}, optional={
           "devices": st.lists(st.one_of(json_values, st.dictionaries(
               st.sampled_from(["index", "name", "util_percent", "memory_util_percent", "memory_used_bytes",
                                "memory_total_bytes"]), json_values)), max_size=4),
           "simulated": json_values, "reason": json_values})),
       donor=st.one_of(json_values, st.dictionaries(
           st.sampled_from(["enabled", "addr", "provider", "slab_bytes", "total_slabs", "free_slabs",
                            "lendable_bytes", "lent_bytes", "lent_to"]), json_values)),
       jobs=json_values, ts=json_values)
def test_a_reports_optional_parts_never_refuse_it_and_always_come_out_typed(cpu, gpus, donor, jobs, ts):
    """Optional figures that are absent or malformed read as None/0, never as a wrong type or a crash."""
    obj = {"schema": 1, "node": "n1", "ts": ts, "cpu": cpu, "gpus": gpus, "rdma": {}, "donor": donor, "jobs": jobs,
           "memory": {"total_bytes": 10, "available_bytes": 5}}
    try:
        t = messages.parse_telemetry(json.dumps(obj))
    except PayloadError as exc:  # only the required parts may refuse it
        assert any(k in str(exc) for k in ("'ts'", "'cpu'", "'gpus'", "gpus.devices", "not usable JSON")), exc
        return
    assert t.ts is None or (isinstance(t.ts, float) and t.ts > 0)
    assert isinstance(t.cpu_count, int) and (t.cpu_percent is None or isinstance(t.cpu_percent, float))
    for g in t.gpus:
        assert isinstance(g.index, int) and isinstance(g.name, str)
        assert all(v is None or isinstance(v, float) for v in (g.util_percent, g.memory_util_percent))
    if t.donor is not None:
        d = t.donor
        assert isinstance(d.lendable_bytes, int) and d.lendable_bytes >= 0 and isinstance(d.enabled, bool)
        assert d.slab_bytes is None or (d.slab_bytes > 0 and d.slab_bytes % 4096 == 0)
        assert not d.placeable or (d.addr and d.free_slabs is not None)
    assert all(isinstance(v, dict) for v in t.jobs.values())


def test_a_donor_section_is_placeable_only_when_every_part_is_valid():
    good = {"enabled": True, "addr": "10.0.0.2:4100", "slab_bytes": 1 << 20, "free_slabs": 3, "lent_to": {"c": 5}}
    d = messages.parse_donor(good)
    assert d is not None and d.placeable and d.lent_to == {"c": 5} and d.provider == "tcp"
    for bad in ({"enabled": False}, {"addr": "10.0.0.2"}, {"addr": "h:0"}, {"addr": "h:\u00b2"}, {"addr": "h:\u0663"},
                {"slab_bytes": 1000},
                {"free_slabs": -1}, {"free_slabs": True}):
        d = messages.parse_donor({**good, **bad})
        assert d is not None and not d.placeable, bad
    assert messages.parse_donor("x") is None


def test_long_op_names_are_refused_not_echoed():
    with pytest.raises(PayloadError, match="'op'") as ei:
        messages.parse_command(json.dumps({"schema": 1, "id": "x", "op": "a" * 100_000}))
    assert len(str(ei.value)) < 200


def test_good_command_and_errors():
    cmd = messages.parse_command(messages.command("allocate", "c1", job="j-1", cpus=0.5, memory_bytes=64 << 20))
    assert (cmd.id, cmd.op, cmd.args) == ("c1", "allocate", {"job": "j-1", "cpus": 0.5, "memory_bytes": 64 << 20})
    for bad, msg in [
        (b'{"schema":1,"op":"ping"}', "'id'"),
        (b'{"schema":2,"id":"a","op":"ping"}', "unsupported schema"),
        (b'[1,2]', "JSON object"),
        (b'\xff\xfe', "UTF-8"),
        (b'{"schema":1,"id":"a","op":"x","args":[]}', "'args'"),
        (b'{"schema":1,"id":"a","op":"ping","v":NaN}', "NaN"),
    ]:
        with pytest.raises(PayloadError, match=None) as ei:
            messages.parse_command(bad)
        assert msg in str(ei.value), (bad, ei.value)
    assert messages.command_id_of(b'{"id":"x1","schema":9}') == "x1"


def test_ids_end_where_they_end_and_unparsable_commands_still_name_theirs():
    for bad in ("job\n", "job\r", "a/b", "", "a" * 129, ".x"):
        assert not messages.valid_id(bad), bad
    deep = b'{"schema":1,"id":"d1","op":"allocate","args":' + b"[" * 5000 + b"]" * 5000 + b"}"
    huge = b'{"schema":1,"id":"h\\"1","op":"x","args":{"n":' + b"9" * 5000 + b"}}"
    for raw, cid in ((deep, "d1"), (huge, 'h"1'), (b'{"id":"c1","op":"x","args":{', "c1"), (b"\xff", None)):
        with pytest.raises(PayloadError):
            messages.parse_command(raw)
        assert messages.command_id_of(raw) == cid


def test_bounded_numbers():
    assert messages.bounded({"x": 2}, "x", 0, 5) == 2.0
    assert messages.bounded({}, "x", 0, 5, required=False, default=0.0) == 0.0
    for v in (float("inf"), 1e308, -1, 10**400):
        with pytest.raises(PayloadError, match="'x'"):
            messages.bounded({"x": v}, "x", 0, 5)
    with pytest.raises(PayloadError, match="'n'"):
        messages.bounded({"n": 10**30}, "n", 0, 5, int)


def test_oversized_payload_refused_unparsed():
    with pytest.raises(PayloadError, match="exceeds"):
        messages.decode(b" " * (messages.MAX_PAYLOAD + 1))
